"""What makes the realistic stage-two step realistic: drawn completion lengths, EOS forced at them for
every generator alike, and the memory-bandwidth floor of decoding that batch.

Length distribution
-------------------
Reasoning completions are long-tailed. The only length statistic this project has measured is the reference
recipe's MATH-500 clip rate: 6.45% of samples hit the 12,288-token cap (docs/design.md section 1, "clip rate 0.0645 at
step 40"). We take a log-normal, ln L ~ Normal(mu, sigma), the usual model of a positive, right-skewed length, and

- scale it to the bench's cap: mu is solved so that P(L > cap) = ``clip_rate`` (6.45%) at the cap of the run
  (8,192 for the formal recipe), i.e. the recipe's distribution with lengths measured in units of the cap;
- sigma = 0.75 (an assumption: no measured spread is on record; with it the median is 0.32 x cap = 2,624 tokens
  at 8,192, the capped mean 0.40 x cap = 3,241 tokens, and 0.6% of samples are under 400 tokens).

A draw L is rounded to an integer >= 1; L > cap means the completion is *clipped*: ``cap`` tokens and no EOS (the
decoder runs into max_new_tokens, as a real clipped sample does); otherwise the completion is exactly L tokens
and its last one is EOS. Each generation call (one batch) draws its lengths from ``seed`` and a batch id, so the
k-th batch of every trainer has the same lengths, row for row.

Forcing EOS
-----------
Both generators suppress EOS until ``min_new_tokens`` = cap (the generators' own path, as the 1,024-token bench
does), and the hook forces EOS at a row's drawn step:

- TRL / HF ``generate``: ``ForcedEOSProcessor``, a ``LogitsProcessor`` passed through ``model.generate`` (HF runs
  custom processors after its min-new-tokens processor and before the sampling warpers, so the forced row samples
  EOS with probability 1).
- ``data_tools.generation.fast_decoder.FastGenerator``: ``fast_decoder.sample_next`` is wrapped (module global, looked up
  at call time by the decode step) to replace the sampled token by EOS where ``step == L - 1``. The replacement is
  three element-wise ops on ``(B,)`` tensors next to a sampling pass over ``(B, 152k)`` logits and a 1.5B forward
  per step, inside the same captured CUDA graph, so it does not change the timed path materially. The step index is
  the decode state's ``step_idx`` (a device tensor, so the graph replays it right); a generator that compacts its
  batch must expose ``row_ids`` (the original row of each current row, a device ``LongTensor``) on its decode
  state, else the hook raises instead of forcing the wrong rows.

Every call's completions are checked against the drawn lengths afterwards (outside the timed region).
"""

from __future__ import annotations

import contextlib
import math
import statistics
from dataclasses import dataclass

import torch

#: docs/design.md section 1: MATH-500 clip rate of the reference recipe at its 12,288-token cap.
CLIP_RATE = 0.0645
#: Log-normal shape parameter (assumption, see the module docstring).
SIGMA = 0.75


def lognormal_mu(cap: int, clip_rate: float = CLIP_RATE, sigma: float = SIGMA) -> float:
    """mu of ln L ~ N(mu, sigma) with P(L > cap) = clip_rate: ln cap - sigma * Phi^-1(1 - clip_rate)."""
    if not 0.0 < clip_rate < 1.0 or sigma <= 0 or cap < 1:
        raise ValueError(f"need 0 < clip_rate < 1, sigma > 0, cap >= 1 (got {clip_rate}, {sigma}, {cap})")
    return math.log(cap) - sigma * statistics.NormalDist().inv_cdf(1.0 - clip_rate)


def draw_lengths(n: int, cap: int, seed: int, batch: int = 0, clip_rate: float = CLIP_RATE,
                 sigma: float = SIGMA) -> tuple[list[int], list[bool]]:
    """``n`` completion lengths and clipped flags for batch ``batch`` (see the module docstring).

    Returns ``(lengths, clipped)``: lengths in [1, cap] tokens; ``clipped[i]`` iff the draw exceeded ``cap``
    (then ``lengths[i] == cap`` and the completion has no EOS). Deterministic in (seed, batch).
    """
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(batch))
    z = torch.randn(n, generator=g, dtype=torch.float64)
    raw = torch.exp(lognormal_mu(cap, clip_rate, sigma) + sigma * z).round().clamp(min=1).long().tolist()
    return [min(x, cap) for x in raw], [x > cap for x in raw]


@dataclass
class Batch:
    """Targets of one generation call: ``eos_step[i]`` = index of the forced EOS, or -1 for a clipped row."""

    lengths: list[int]
    clipped: list[bool]

    @property
    def eos_step(self) -> list[int]:
        return [-1 if c else n - 1 for n, c in zip(self.lengths, self.clipped)]


class ForcedLengths:
    """Per-trainer schedule of drawn lengths: the generation call made while ``batch_id`` = k decodes batch k, and
    each call advances ``batch_id`` by one (so an asynchronous trainer's early call for the next step gets the next
    batch). The bench sets ``batch_id`` only to align a trainer with another's batches."""

    def __init__(self, cap: int, eos_id: int, seed: int = 0, clip_rate: float = CLIP_RATE, sigma: float = SIGMA):
        self.cap, self.eos_id, self.seed, self.clip_rate, self.sigma = cap, int(eos_id), seed, clip_rate, sigma
        self.batch_id = 0
        self.calls: list[dict] = []  # per call: batch id, rows, total tokens, mismatches

    def batch(self, n: int, batch_id: int | None = None) -> Batch:
        b = self.batch_id if batch_id is None else batch_id
        return Batch(*draw_lengths(n, self.cap, self.seed, b, self.clip_rate, self.sigma))

    def check(self, batch: Batch, completions: list[list[int]]) -> int:
        """Rows whose completion differs from its target (length, EOS last iff not clipped, no early EOS)."""
        bad = 0
        for ids, n, c in zip(completions, batch.lengths, batch.clipped):
            ok = len(ids) == n and (ids[-1] != self.eos_id if c else ids[-1] == self.eos_id) \
                and self.eos_id not in ids[:-1]
            bad += not ok
        return bad + abs(len(completions) - len(batch.lengths))


class ForcedEOSProcessor:
    """HF ``LogitsProcessor``: row i may only emit EOS at new-token index ``eos_step[i]`` (-1: never), and must."""

    def __init__(self, eos_step: list[int], eos_id: int):
        self.eos_step = torch.tensor(eos_step, dtype=torch.long)
        self.eos_id = int(eos_id)
        self.p0: int | None = None  # prompt length (input_ids width at the first call)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.p0 is None:
            self.p0 = input_ids.shape[1]
            self.eos_step = self.eos_step.to(scores.device)
        t = input_ids.shape[1] - self.p0  # index of the token being chosen
        scores[:, self.eos_id] = float("-inf")
        force = self.eos_step == t
        if bool(force.any()):
            scores[force] = float("-inf")
            scores[force, self.eos_id] = 0.0
        return scores


# ---- FastGenerator hook (module-level patch of fast_decoder) -----------------------------------------------------

_ACTIVE: dict = {"targets": None, "state": None}


@contextlib.contextmanager
def fast_generator_hook():
    """Patch ``data_tools.generation.fast_decoder`` so FastGenerator forces EOS at ``_ACTIVE['targets']`` (device (B,) eos steps).

    Installed once for the whole bench; with no active targets the patched functions behave as the originals.
    """
    from data_tools.generation import fast_decoder as gen

    orig_sample = gen.sample_next
    state_cls = getattr(gen, "_DecodeState", None)
    orig_step = getattr(state_cls, "step", None)

    def sample_next(logits, sp, eos, allow_eos):
        nxt = orig_sample(logits, sp, eos, allow_eos)
        tg = _ACTIVE["targets"]
        if tg is None:
            return nxt
        st = _ACTIVE["state"]
        if st is None:  # the first token, sampled from the prefill over the whole batch
            step = torch.zeros(1, dtype=torch.long, device=nxt.device)
            rows = None
        else:
            step = st.step_idx
            rows = getattr(st, "row_ids", None)
        t = tg
        if rows is not None:
            t = t.index_select(0, rows.to(nxt.device))
        elif t.numel() != nxt.numel():
            raise RuntimeError(f"forced lengths: the decoder samples {nxt.numel()} rows but the batch has {t.numel()}; "
                               "a compacting decoder must expose row_ids on its decode state")
        e = int(_ACTIVE["eos_id"])
        nxt = torch.where(nxt == e, torch.full_like(nxt, _ACTIVE["alt_id"]), nxt)  # no EOS but the forced one
        return torch.where(t == step, torch.full_like(nxt, e), nxt)

    def step(self, *a, **k):
        prev = _ACTIVE["state"]
        _ACTIVE["state"] = self
        try:
            return orig_step(self, *a, **k)
        finally:
            _ACTIVE["state"] = prev

    gen.sample_next = sample_next
    if orig_step is not None:
        state_cls.step = step
    try:
        yield
    finally:
        gen.sample_next = orig_sample
        if orig_step is not None:
            state_cls.step = orig_step


def install_forced(trainer, forced: ForcedLengths, record: dict | None = None) -> None:
    """Wrap ``trainer._generate_single_turn`` so each call decodes to the drawn lengths (HF and fast paths alike).

    Sets the targets for ``fast_generator_hook`` and injects a ``ForcedEOSProcessor`` into ``trainer.model.generate``
    for the call; afterwards checks the completions (``forced.calls``). Install after the bench's phase timer so
    the set-up and the check stay outside the timed region.
    """
    inner = trainer._generate_single_turn
    model = trainer.model
    orig_generate = model.generate
    eos, pad = forced.eos_id, trainer.processing_class.pad_token_id
    specials = set(getattr(trainer.processing_class, "all_special_ids", []) or []) | {eos, pad}
    alt = next(i for i in range(len(specials) + 1) if i not in specials)  # an ordinary token

    def generate(*a, **k):
        from transformers import LogitsProcessorList

        proc = ForcedEOSProcessor(_ACTIVE["eos_list"], eos)
        extra = list(getattr(trainer, "_bench_processors", None) or [])  # e.g. the bench's step-time tracer
        lp = LogitsProcessorList(list(k.pop("logits_processor", None) or []) + [proc] + extra)
        return orig_generate(*a, logits_processor=lp, **k)

    def wrapped(prompt_ids, *a, **k):
        bid = forced.batch_id
        forced.batch_id += 1
        b = forced.batch(len(prompt_ids), bid)
        dev = trainer.accelerator.device
        new = torch.tensor(b.eos_step, dtype=torch.long, device=dev)
        buf = _ACTIVE.get("buf")  # one persistent buffer: a graph kept across calls reads it at a fixed address
        if buf is None or buf.shape != new.shape or buf.device != new.device:
            buf = _ACTIVE["buf"] = new
        else:
            buf.copy_(new)
        _ACTIVE.update(targets=buf, eos_id=eos, alt_id=alt, eos_list=b.eos_step)
        model.generate = generate
        try:
            out = inner(prompt_ids, *a, **k)
        finally:
            _ACTIVE.update(targets=None)
            model.generate = orig_generate
        forced.calls.append({"batch": bid, "rows": len(out), "tokens": sum(map(len, out)),
                             "clipped": sum(b.clipped), "mismatched": forced.check(b, out)})
        return out

    trainer._generate_single_turn = wrapped


# ---- the floor ---------------------------------------------------------------------------------------------------

def kv_bytes_per_token(config, dtype_bytes: int = 2) -> int:
    """K and V of one token over all layers: 2 x layers x kv_heads x head_dim x dtype bytes (Qwen2.5-1.5B: 28,672)."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * hd * dtype_bytes


def weight_bytes(model) -> int:
    """Bytes of the model's distinct parameter storages (a tied embedding/head counted once)."""
    seen, n = set(), 0
    for p in model.parameters():
        k = p.untyped_storage().data_ptr()
        if k not in seen:
            seen.add(k)
            n += p.untyped_storage().nbytes()
    return n


def decode_floor(lengths: list[int], prompt_lens: list[int], w_bytes: int, kv_tok: int,
                 bandwidth: float) -> dict:
    """Memory-bandwidth floor of decoding a batch: seconds and bytes.

    Row r emits ``lengths[r]`` tokens: token 0 from the prefill, tokens t = 1..L_r-1 from decode steps. Decode step
    t (t = 1 .. max L - 1) reads the weights once (``w_bytes``) and, for every row still live (L_r > t), its KV of
    ``prompt_lens[r] + t`` tokens (``kv_tok`` bytes each): bytes_t = w_bytes + kv_tok x sum_{r: L_r > t} (P_r + t).
    floor = sum_t bytes_t / bandwidth (bytes/s). The prefill (compute-bound, ~1% here) is not counted.
    Returns ``{"steps", "weight_bytes", "kv_bytes", "bytes", "seconds"}``.
    """
    T = max(lengths) if lengths else 0
    steps = max(T - 1, 0)
    kv = 0
    for L, P in zip(lengths, prompt_lens):
        m = L - 1  # decode steps t = 1..L-1 in which this row is live
        kv += m * P + m * (m + 1) // 2
    kv *= kv_tok
    wb = steps * w_bytes
    return {"steps": steps, "weight_bytes": wb, "kv_bytes": kv, "bytes": wb + kv, "seconds": (wb + kv) / bandwidth}


def hbm_bandwidth(device: str, nbytes: int = 4 << 30, reps: int = 10) -> float:
    """Measured device memory bandwidth in bytes/s: a device-to-device copy of ``nbytes`` counts 2 x nbytes
    (read + write); median of ``reps``. NaN off CUDA."""
    if device != "cuda":
        return float("nan")
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times)
