"""Fast HF-model generation for on-policy training when vLLM is absent.

TRL's ``DistillationTrainer._generate_single_turn`` (HF path) calls ``model.generate`` with a dynamic
KV cache and ``disable_compile=True``: every decode step pays the Python overhead of the generate
loop, its logits processors and a host synchronisation, and the GQA KV cache is re-expanded to all
query heads in every layer. On an H200 that is ~26 s for 32 x 1,024 tokens of a 1.5B model, against
a memory-bandwidth floor near 1 s (design.md section 8).

``FastGenerator`` keeps the same contract (prompt token ids in, completion token ids out, cut after
the first EOS, EOS included) and decodes the whole batch in one call:

- all samples of the batch (G per prompt, prompts repeated consecutively) share one prefill call
  and one decode loop;
- a static KV cache (``transformers.StaticCache``) whose length is rounded up to ``len_bucket``, so
  the decode step has fixed shapes across calls;
- on CUDA, one decode step (mask update, model forward, sampling, EOS bookkeeping, buffer updates)
  is captured once as a CUDA graph and replayed N-2 times with no host synchronisation (a check
  for "all finished" every ``check_every`` steps only); the graph, cache and buffers are kept on
  the model and reused while the weights keep their storage (in-place optimizer updates do);
- decode attention over the static cache is a grouped-query kernel that reads each KV head once
  (HF's SDPA path with a mask repeats the KV heads to all query heads every step).

Under FSDP2 (``fully_shard``, e.g. accelerate's ``fsdp_version: 2``) ``fsdp2_full_weights`` all-gathers
the student's weights once per generation call and detaches FSDP's forward hooks for the call, so the
decode loop (and its captured graph) runs on whole weights with no per-layer, per-token collectives.

On CPU (tests) the same step function runs eagerly. Sampling follows HF's order (min-new-tokens
EOS suppression, temperature, top-k, top-p, min-p); greedy decoding matches ``model.generate``.
Features it does not implement (repetition penalty, beams, suppress_tokens, ...) make
``sampling_params_from`` return None so the caller keeps HF generate.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

_ATTN_NAME = "opd_gqa_decode"


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    min_new_tokens: int = 0
    do_sample: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float | None = None


def sampling_params_from(gc) -> SamplingParams | None:
    """``SamplingParams`` from a ``transformers.GenerationConfig``, or None if it uses a feature we lack."""
    if (gc.num_beams or 1) != 1 or (gc.num_return_sequences or 1) != 1:
        return None
    if gc.repetition_penalty not in (None, 1.0) or gc.suppress_tokens or gc.begin_suppress_tokens:
        return None
    if gc.bad_words_ids or gc.no_repeat_ngram_size or gc.forced_bos_token_id is not None \
            or gc.forced_eos_token_id is not None or gc.max_new_tokens is None:
        return None
    if getattr(gc, "typical_p", 1.0) not in (None, 1.0) or getattr(gc, "epsilon_cutoff", 0.0) \
            or getattr(gc, "eta_cutoff", 0.0):
        return None
    do_sample = bool(gc.do_sample)
    temp = 1.0 if gc.temperature is None else float(gc.temperature)
    if do_sample and temp == 0.0:
        do_sample = False
    return SamplingParams(max_new_tokens=int(gc.max_new_tokens), min_new_tokens=int(gc.min_new_tokens or 0),
                          do_sample=do_sample, temperature=temp, top_k=int(gc.top_k or 0),
                          top_p=1.0 if gc.top_p is None else float(gc.top_p), min_p=gc.min_p)


def gqa_decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention of a few new queries over a static cache, grouped by KV head (no KV repeat).

    query ``(B, H, q, D)``, key/value ``(B, KVH, L, D)``, attention_mask additive ``(B, 1, q, L)`` float.
    Returns ``((B, q, H, D), None)`` like HF's attention functions.
    """
    B, H, q, D = query.shape
    kvh = key.shape[1]
    rep = H // kvh
    scaling = D ** -0.5 if scaling is None else scaling
    qg = query.reshape(B, kvh, rep * q, D)  # query head h = kvh_index * rep + r
    s = torch.matmul(qg, key.transpose(-1, -2)).float() * scaling  # (B, kvh, rep*q, L)
    if attention_mask is not None:
        m = attention_mask[:, :, :, : key.shape[-2]]
        s = (s.view(B, kvh, rep, q, -1) + m.unsqueeze(2).float()).view(B, kvh, rep * q, -1)
    p = torch.softmax(s, dim=-1).to(value.dtype)
    o = torch.matmul(p, value).view(B, H, q, D).transpose(1, 2).contiguous()
    return o, None


def _register_attention() -> bool:
    try:
        from transformers import AttentionInterface

        AttentionInterface.register(_ATTN_NAME, gqa_decode_attention)
        return True
    except Exception as e:  # pragma: no cover - older/newer transformers
        log.warning("cannot register the GQA decode attention (%s): decoding with the model's attention", e)
        return False


def sample_next(logits: torch.Tensor, sp: SamplingParams, eos: torch.Tensor, allow_eos: torch.Tensor | None):
    """Next token ids ``(B,)`` from fp32 logits ``(B, V)``; no host synchronisation (graph-capturable)."""
    if allow_eos is not None and eos.numel():
        pen = torch.where(allow_eos, 0.0, float("-inf")).to(logits.dtype)
        logits = logits.index_add(1, eos, pen.expand(logits.size(0), eos.numel()).contiguous())
    if not sp.do_sample:
        return logits.argmax(dim=-1)
    if sp.temperature != 1.0:
        logits = logits / sp.temperature
    if sp.top_k and 0 < sp.top_k < logits.size(-1):
        kth = torch.topk(logits, sp.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sp.top_p < 1.0:
        srt, idx = torch.sort(logits, dim=-1, descending=False)
        cum = torch.softmax(srt, dim=-1).cumsum(dim=-1)
        remove = cum <= (1.0 - sp.top_p)
        remove[:, -1] = False
        logits = logits.masked_fill(remove.scatter(1, idx, remove), float("-inf"))
    if sp.min_p:
        probs = torch.softmax(logits, dim=-1)
        thr = sp.min_p * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < thr, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    # Exponential race = sampling from probs (vLLM's sampler); capturable, unlike multinomial's checks.
    q = torch.empty_like(probs).exponential_()
    return (probs / q).argmax(dim=-1)


def sampled_logprob(logits: torch.Tensor, tokens: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """``(B,)`` fp32 log-prob of ``tokens`` under ``log_softmax(logits / T)``, T = ``sp.temperature`` (1 if 0).

    The distribution the trainer scores (``losses.token_logprobs`` at the trainer's temperature, no
    top-k / top-p / min-new-tokens processing), as vLLM's default raw log-probs are: the behaviour
    log-prob that the rollout importance weights compare with. Graph-capturable.
    """
    z = logits.float()
    if sp.temperature not in (0.0, 1.0):
        z = z / sp.temperature
    return z.gather(1, tokens.unsqueeze(1)).squeeze(1) - torch.logsumexp(z, dim=-1)


def group_runs(prompt_ids: list[list[int]]) -> list[int]:
    """Lengths of runs of identical consecutive prompts (a prompt's G samples come in a row)."""
    runs: list[int] = []
    for i, p in enumerate(prompt_ids):
        if i and p == prompt_ids[i - 1]:
            runs[-1] += 1
        else:
            runs.append(1)
    return runs


class _DecodeState:
    """Static buffers, cache and (on CUDA) the captured decode step for one (B, L, sampling) shape."""

    def __init__(self, model, B: int, L: int, N: int, sp: SamplingParams, eos: torch.Tensor, pad_id: int,
                 use_graph: bool, use_gqa: bool, record_logprobs: bool = False):
        from transformers import StaticCache

        dev = next(model.parameters()).device
        self.model, self.B, self.L, self.N, self.sp = model, B, L, N, sp
        self.use_graph, self.use_gqa = use_graph, use_gqa
        self.cache = StaticCache(config=model.config, max_cache_len=L)
        self.eos, self.pad_id = eos, pad_id
        self.dtype = next(model.parameters()).dtype
        self.mask = torch.zeros(B, 1, 1, L, dtype=torch.bool, device=dev)
        self.cur_tok = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.pos_ids = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.write_pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.step_idx = torch.zeros(1, dtype=torch.long, device=dev)
        self.out = torch.full((B, N), pad_id, dtype=torch.long, device=dev)
        self.finished = torch.zeros(B, dtype=torch.bool, device=dev)
        # optional (B, N) log-prob of each sampled token (behaviour policy of async generation)
        self.logp = torch.zeros(B, N, dtype=torch.float32, device=dev) if record_logprobs else None
        self.graph = None
        self.pass_cache_position = "cache_position" in inspect.signature(model.forward).parameters
        self.weights_key = _weights_key(model)

    # one decode step: everything on device, in place on the static buffers
    def step(self):
        m = self.model
        self.mask.index_fill_(3, self.write_pos, True)
        am = torch.where(self.mask, 0.0, torch.finfo(self.dtype).min).to(self.dtype)
        kw = {"cache_position": self.write_pos} if self.pass_cache_position else {}
        attn = m.config._attn_implementation
        if self.use_gqa:
            m.config._attn_implementation = _ATTN_NAME
        try:
            out = m(input_ids=self.cur_tok, position_ids=self.pos_ids, attention_mask=am,
                    past_key_values=self.cache, use_cache=True, **kw)
        finally:
            m.config._attn_implementation = attn
        logits = out.logits[:, -1, :].float()
        allow = (self.step_idx >= self.sp.min_new_tokens) if self.sp.min_new_tokens else None
        nxt = sample_next(logits, self.sp, self.eos, allow)
        if self.logp is not None:
            self.logp.index_copy_(1, self.step_idx, sampled_logprob(logits, nxt, self.sp).unsqueeze(1))
        nxt = torch.where(self.finished, torch.full_like(nxt, self.pad_id), nxt)
        self.out.index_copy_(1, self.step_idx, nxt.unsqueeze(1))
        if self.eos.numel():
            self.finished.logical_or_(torch.isin(nxt, self.eos))
        self.cur_tok.copy_(nxt.unsqueeze(1))
        self.pos_ids.add_(1)
        self.write_pos.add_(1)
        self.step_idx.add_(1)


def _weights_key(model) -> tuple:
    # A captured step reads the weights at their capture-time addresses: reuse it only while every
    # parameter is still there (in-place optimizer updates keep them; FSDP2's per-call all-gather in
    # ``fsdp2_full_weights`` allocates them anew, so a kept graph is re-captured unless they land back).
    return tuple(p.data_ptr() for p in model.parameters())


class FastGenerator:
    """Batched generation with a static KV cache and a CUDA-graph decode step (see module docstring).

    Args:
        pad_token_id: written after a sequence's EOS (as HF generate does).
        eos_token_ids: every id that ends a completion.
        len_bucket: the static cache length P + N is rounded up to a multiple of this, so calls with
            nearby prompt lengths reuse the captured step.
        use_cuda_graph: None = on CUDA devices.
        gqa_attention: decode with ``gqa_decode_attention`` (True) or the model's own attention.
        check_every: decode steps between "all sequences finished?" checks (the only host syncs).
        keep_cache: keep the static KV cache and captured graph between calls (no re-capture, but the
            cache, ~1.1 GiB for 32 x 1,280 tokens of a Qwen2.5-1.5B, stays allocated through the
            update phase). False (default): free them after each call and capture again next call
            (one eager step + a capture, tens of milliseconds), so training peaks no higher than TRL's.
        capture_error_mode: ``torch.cuda.graph``'s mode; "thread_local" when another thread keeps
            launching work during the capture (``trainers.async_rollouts``).
        stop_event: a ``threading.Event`` checked at each "all finished?" check: set = stop decoding
            early (the call's output is then incomplete; the caller discards it).
    """

    def __init__(self, pad_token_id: int, eos_token_ids, *, len_bucket: int = 256, use_cuda_graph: bool | None = None,
                 gqa_attention: bool = True, check_every: int = 128, keep_cache: bool = False,
                 capture_error_mode: str = "global", stop_event=None):
        self.pad_id = int(pad_token_id)
        self.eos_ids = [int(e) for e in ([eos_token_ids] if isinstance(eos_token_ids, int) else eos_token_ids or [])]
        self.len_bucket = max(1, int(len_bucket))
        self.use_cuda_graph = use_cuda_graph
        self.gqa_attention = gqa_attention and _register_attention()
        self.check_every = max(1, int(check_every))
        self.keep_cache = keep_cache
        self.capture_error_mode = capture_error_mode
        self.stop_event = stop_event
        self._state: _DecodeState | None = None
        self.stats: dict[str, float] = {}

    def _get_state(self, model, B, L, N, sp, eos, use_graph, record_logprobs=False) -> _DecodeState:
        st = self._state
        if (st is not None and st.model is model and (st.B, st.L, st.N, st.sp) == (B, L, N, sp)
                and st.use_graph == use_graph and st.weights_key == _weights_key(model)
                and (st.logp is not None) == record_logprobs):
            return st
        self._state = None  # drop the old cache/graph before allocating a new one
        if st is not None:
            del st
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        use_gqa = self.gqa_attention and getattr(model.config, "_attn_implementation", "eager") in ("sdpa", "eager")
        self._state = _DecodeState(model, B, L, N, sp, eos, self.pad_id, use_graph, use_gqa, record_logprobs)
        self.stats["captures"] = self.stats.get("captures", 0) + 1
        return self._state

    @torch.no_grad()
    def generate(self, model, prompt_ids: list[list[int]], sp: SamplingParams, *, return_logprobs: bool = False):
        """Completion ids per prompt, cut after the first EOS (EOS kept), like TRL's HF path.

        ``return_logprobs``: return ``(ids, logprobs)``, ``logprobs[i][j]`` the fp32 log-prob of token j of
        completion i under the sampling model (``sampled_logprob``), aligned with ``ids[i]``.
        """
        dev = next(model.parameters()).device
        B = len(prompt_ids)
        N = int(sp.max_new_tokens)
        if B == 0 or N <= 0:
            empty = [[] for _ in prompt_ids]
            return (empty, [[] for _ in prompt_ids]) if return_logprobs else empty
        P = max(len(p) for p in prompt_ids)
        L = int(math.ceil((P + N) / self.len_bucket) * self.len_bucket)
        use_graph = dev.type == "cuda" if self.use_cuda_graph is None else (self.use_cuda_graph and dev.type == "cuda")
        eos = torch.tensor(self.eos_ids, dtype=torch.long, device=dev)
        st = self._get_state(model, B, L, N, sp, eos, use_graph, return_logprobs)

        ids = torch.full((B, P), self.pad_id, dtype=torch.long)
        pmask = torch.zeros(B, P, dtype=torch.long)
        for i, p in enumerate(prompt_ids):
            if p:
                ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
                pmask[i, P - len(p):] = 1
        ids, pmask = ids.to(dev), pmask.to(dev)
        pos = (pmask.cumsum(-1) - 1).masked_fill(pmask == 0, 0)

        was_training = model.training
        model.eval()
        try:
            st.cache.reset()
            st.finished.zero_()
            st.out.fill_(self.pad_id)
            st.mask.zero_()
            st.mask[:, 0, 0, :P] = pmask.bool()
            kw = {"cache_position": torch.arange(P, device=dev)} if st.pass_cache_position else {}
            out = model(input_ids=ids, attention_mask=pmask, position_ids=pos, past_key_values=st.cache,
                        use_cache=True, logits_to_keep=1, **kw)
            allow = torch.tensor(sp.min_new_tokens <= 0, device=dev) if sp.min_new_tokens else None
            first = sample_next(out.logits[:, -1, :].float(), sp, eos, allow)
            if st.logp is not None:
                st.logp[:, 0] = sampled_logprob(out.logits[:, -1, :], first, sp)
            del out
            st.out[:, 0] = first
            if eos.numel():
                st.finished.copy_(torch.isin(first, eos))
            st.cur_tok.copy_(first.unsqueeze(1))
            st.pos_ids.copy_(pos[:, -1:] + 1)
            st.write_pos.fill_(P)
            st.step_idx.fill_(1)
            self._decode(st, N)
            toks = st.out.cpu()
            lps = st.logp.cpu().tolist() if st.logp is not None else None
        finally:
            model.train(was_training)
            if not self.keep_cache:
                self._state = None  # frees the cache, buffers and the graph's memory pool
                del st
        res = []
        eos_set = set(self.eos_ids)
        for row in toks.tolist():
            cut = next((j + 1 for j, t in enumerate(row) if t in eos_set), len(row))
            res.append(row[:cut])
        if return_logprobs:
            return res, [lp[: len(r)] for lp, r in zip(lps, res)]
        return res

    def _stop(self, st: _DecodeState) -> bool:
        # the only host syncs of the loop: every check_every steps
        return bool(st.finished.all()) or (self.stop_event is not None and self.stop_event.is_set())

    def _decode(self, st: _DecodeState, N: int) -> None:
        t = 1
        if not st.use_graph:
            while t < N:
                st.step()
                t += 1
                if t % self.check_every == 0 and self._stop(st):
                    return
            return
        if st.graph is None:
            if t < N:  # warm-up on a side stream (a real decode step), then capture (not executed)
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    st.step()
                torch.cuda.current_stream().wait_stream(s)
                t += 1
            if t >= N:
                return
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, capture_error_mode=self.capture_error_mode):
                st.step()
            st.graph = g
        while t < N:
            st.graph.replay()
            t += 1
            if t % self.check_every == 0 and self._stop(st):
                return


def generator_for(model, pad_token_id: int, eos_token_ids, **kw) -> FastGenerator:
    """The ``FastGenerator`` kept on ``model`` (created on first use; reused while ids match)."""
    g = getattr(model, "_opd_fast_generator", None)
    key = (int(pad_token_id), tuple(eos_token_ids if not isinstance(eos_token_ids, int) else [eos_token_ids]))
    if g is None or (g.pad_id, tuple(g.eos_ids)) != key:
        g = FastGenerator(pad_token_id, eos_token_ids, **kw)
        setattr(model, "_opd_fast_generator", g)
    return g


class FSDPHooksNotFound(RuntimeError):
    """``fsdp2_full_weights`` could not identify FSDP2's forward hooks (an FSDP2 internal changed)."""


def _fsdp2_modules(model) -> list:
    """The modules of ``model`` sharded by FSDP2 ``fully_shard`` (root included), or [] without FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _hook_of(hook, state) -> bool:
    """True if ``hook`` is a bound method of ``state`` or a ``functools.wraps`` wrapper of one.

    FSDP2 registers ``state._pre_forward`` / ``state._post_forward`` directly on a module sharded alone and
    wrapped (``functools.wraps``, ``_dynamo_disable``) on the modules of a grouped ``fully_shard([a, b])``.
    """
    for _ in range(16):
        if hook is None:
            return False
        if getattr(hook, "__self__", None) is state:
            return True
        hook = getattr(hook, "__wrapped__", None)
    return False


@contextlib.contextmanager
def fsdp2_full_weights(model):
    """Run an FSDP2-sharded ``model`` as a plain module on its full weights for the ``with`` block.

    On entry: FSDP2's forward pre/post hooks are detached from every ``FSDPModule`` of ``model`` and each
    one's parameters are all-gathered **once** (``FSDPModule.unshard()``, not recursive, so called on every
    sharded module; the unsharded parameters follow the ``MixedPrecisionPolicy``, i.e. bf16 under
    accelerate's bf16 config, and are registered on the modules as plain tensors). Inside, a forward runs
    no FSDP code at all: no all-gather / reshard per layer per decode step, no stream syncs or input casts
    (the weights already have the compute dtype), so every rank may run a different number of forwards
    (its own decode length) without a collective. On exit (also on error): the hooks are put back in
    their original order and every module is resharded (``FSDPModule.reshard()``: the gathered copies are
    freed, the DTensor shards are registered again). Call it between optimizer steps, under ``no_grad``:
    FSDP state between a forward and its backward is not preserved. Without FSDP2 modules it does nothing.

    Raises ``FSDPHooksNotFound`` on entry (with nothing changed) if a module's FSDP hooks cannot be found.
    """
    mods = _fsdp2_modules(model)
    if not mods:
        yield model
        return
    detached: list[tuple[dict, list]] = []  # (a module's hook dict, its items before)
    try:
        for m in mods:
            state = m._get_fsdp_state()
            found = 0
            for hooks in (m._forward_pre_hooks, m._forward_hooks):
                before = list(hooks.items())
                keep = [(k, h) for k, h in before if not _hook_of(h, state)]
                if len(keep) < len(before):
                    detached.append((hooks, before))
                    hooks.clear()
                    hooks.update(keep)  # same dict object: RemovableHandles keep a reference to it
                    found += len(before) - len(keep)
            if not found:
                raise FSDPHooksNotFound(f"no FSDP2 forward hooks found on {type(m).__name__}")
        for m in mods:  # one all-gather per FSDP parameter group (a grouped module's second call is a no-op)
            m.unshard()
        yield model
    finally:
        for hooks, before in reversed(detached):
            added = [(k, h) for k, h in hooks.items() if k not in dict(before)]
            hooks.clear()
            hooks.update(before)
            hooks.update(added)
        for m in mods:  # no-op for a module whose parameters are already sharded
            m.reshard()


def fast_path_unsupported(trainer) -> str | None:
    """Why ``fast_generate_single_turn`` cannot run under ``trainer``'s distributed setup; None if it can.

    FSDP1 can only materialise full weights with ``summon_full_params``, inside which no forward may run
    (its wrappers' forward is the sharding logic), and ZeRO-3 gathers inside each module's hooks: both
    keep TRL's HF generate. FSDP2 (``fsdp2_full_weights``), DDP and ZeRO-1/2 take the fast path.
    """
    state = trainer.accelerator.state
    ds = getattr(state, "deepspeed_plugin", None)
    if ds is not None and getattr(ds, "zero_stage", 0) == 3:
        return "DeepSpeed ZeRO-3"
    if getattr(trainer, "is_fsdp_enabled", False):
        version = getattr(getattr(state, "fsdp_plugin", None), "fsdp_version", 1)
        if version != 2:
            return f"FSDP version {version} (only FSDP2 is supported)"
    return None


_warned_hooks = False


def fast_generate_single_turn(trainer, prompt_ids: list[list[int]]) -> list[list[int]] | None:
    """Drop-in for ``DistillationTrainer._generate_single_turn``'s HF branch (text-only prompts).

    Returns None when the fast path does not apply (then call TRL's path): a generation config feature
    ``FastGenerator`` lacks, or a setup ``fast_path_unsupported`` names (FSDP1, ZeRO-3).

    Under FSDP2 the student's weights are gathered once for the call (``fsdp2_full_weights``) instead of
    per layer per decode token in FSDP's hooks. The CUDA graph stays on: the gathered weights live at new
    addresses after every all-gather, but the captured step is only replayed while ``_weights_key`` (the
    parameters' ``data_ptr``s) matches the capture, and the default ``keep_cache=False`` re-captures on
    every call anyway; the graph contains no FSDP code (hooks detached) and no collective, so each rank
    replays it independently. DDP and ZeRO-1/2 keep whole weights at fixed addresses.
    """
    global _warned_hooks
    from trl.models.utils import unwrap_model_for_generation

    sp = sampling_params_from(trainer.generation_config)
    if sp is None or fast_path_unsupported(trainer) is not None:
        return None
    with contextlib.ExitStack() as stack:
        unwrapped = stack.enter_context(unwrap_model_for_generation(
            trainer.model_wrapped, trainer.accelerator, gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
            generation_kwargs=trainer.generation_kwargs,
            gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs))
        stack.enter_context(torch.no_grad())
        try:
            stack.enter_context(fsdp2_full_weights(unwrapped))
        except FSDPHooksNotFound as e:
            if not _warned_hooks:
                log.warning("fast generation off under FSDP2 (%s): using TRL's HF generate", e)
                _warned_hooks = True
            return None
        gen = generator_for(unwrapped, trainer._tokenizer.pad_token_id, trainer.eos_token_ids)
        return gen.generate(unwrapped, [list(p) for p in prompt_ids], sp)


__all__ = ["SamplingParams", "sampling_params_from", "FastGenerator", "generator_for", "fast_generate_single_turn",
           "fast_path_unsupported", "fsdp2_full_weights", "FSDPHooksNotFound", "gqa_decode_attention", "sample_next",
           "sampled_logprob", "group_runs"]


def compile_decoder_layers(model, *, only_with_grad: bool) -> bool:
    """Regional ``torch.compile`` of a causal LM's decoder layers (one compiled function, all layers).

    Compiling the repeated block rather than the whole model keeps compile time to one layer's
    graph (~8 s on an H200 for Qwen2.5-1.5B) and works with gradient checkpointing. Measured in
    ``bench/RESULTS.md`` (run 2): update phase 1.21x TRL's tokens/s at 0.91x its peak memory.

    Args:
        model: a transformers causal LM whose layers are ``model.model.layers``.
        only_with_grad: run eagerly under ``no_grad`` (the student's generation keeps its own
            CUDA-graph decode path) and compiled when gradients are on (training forward and the
            checkpoint recompute); ``False`` for the frozen teacher, which only ever scores.

    Returns:
        True if the layers were wrapped, False if the model has no ``model.layers`` to compile.
    """
    import torch._dynamo

    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        return False
    # one guard set per layer instance (distinct `self`): raise the cache so 28+ layers all fit
    torch._dynamo.config.cache_size_limit = max(64, 2 * len(layers), torch._dynamo.config.cache_size_limit)
    fn = type(layers[0]).forward
    comp = torch.compile(fn, dynamic=False)
    for layer in layers:
        def fwd(*a, _layer=layer, **k):
            if only_with_grad and not torch.is_grad_enabled():
                return fn(_layer, *a, **k)
            return comp(_layer, *a, **k)
        layer.forward = fwd
    return True
