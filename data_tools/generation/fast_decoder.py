"""Fast HF-model generation: the trainer's rollouts when vLLM is absent, and the ``hf`` engine of stage one and
evaluation (``data_tools.generation.engines.HFEngine``).

TRL's ``DistillationTrainer._generate_single_turn`` (HF path) calls ``model.generate`` with a dynamic
KV cache and ``disable_compile=True``: every decode step pays the Python overhead of the generate
loop, its logits processors and a host synchronisation, and the GQA KV cache is re-expanded to all
query heads in every layer: far slower than a decode's memory-bandwidth floor (TRL's generation against this
decoder's, 32 x 1,024 tokens of a 1.5B model: bench/results/2026-11-29-run-2.md).

``FastGenerator`` keeps the same contract (prompt token ids in, completion token ids out, cut after
the first EOS, EOS included) and decodes the whole batch in one call:

- all samples of the batch (G per prompt, prompts repeated consecutively) share one prefill call
  and one decode loop;
- a static KV cache (``kv_cache.DecodeKV``: one K and one V tensor per layer, written at a
  position buffer, so the same code serves every transformers version's cache protocol) whose length is
  rounded up to ``len_bucket``, so the decode step has fixed shapes across calls; the prefill runs the
  model's own attention (sdpa for flash-attention models) under an additive 4-D mask;
- on CUDA, one decode step (mask update, model forward, sampling, EOS bookkeeping, buffer updates)
  is captured once as a CUDA graph and replayed N-2 times with no host synchronisation (a check
  for "all finished" every ``check_every`` steps only); the graph, cache and buffers are kept on
  the model and reused while the weights keep their storage (in-place optimizer updates do);
- decode attention over the static cache is a grouped-query kernel that reads each KV head once
  (HF's SDPA path with a mask repeats the KV heads to all query heads every step), called from
  ``kv_cache.cache_attention``, which also writes the new token's K/V;
- ``compaction`` (``OPDConfig.decode_compaction``): the decode attention reads only the written length
  rounded up to a bucket, and finished rows are dropped by moving the live ones into a smaller batch
  bucket, one captured graph per (batch, length) window (``data_tools.generation.kv_cache``);
- ``compile_step`` (``OPDConfig.decode_compile``): the decode step's decoder layers are ``torch.compile``d
  (once per batch bucket) and captured inside the same CUDA graphs;
- ``kv_growth`` (``OPDConfig.decode_kv_growth``, with ``compaction``): the KV cache holds only the window, its
  length grown with the length bucket and its rows shrunk at each compaction, so its memory peaks at
  ``max over windows (b x cap) x bytes per token`` instead of ``B x L x bytes per token`` (``data_tools.generation.kv_cache``).

The trainer's side (the drop-in for TRL's HF branch, FSDP2's whole weights for the call) is in
``trainers.fast_generation``.

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
import time
from dataclasses import dataclass

import torch

from data_tools.generation.kv_cache import (KV_ATTN_NAME, DecodeKV, active_kv, attn_len, batch_buckets,
                                            compiled_batch_sizes, decode_layers_compiled, register_kv_attention)

log = logging.getLogger(__name__)


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


def group_runs(prompt_ids: list[list[int]]) -> list[int]:
    """Lengths of runs of identical consecutive prompts (a prompt's G samples come in a row)."""
    runs: list[int] = []
    for i, p in enumerate(prompt_ids):
        if i and p == prompt_ids[i - 1]:
            runs[-1] += 1
        else:
            runs.append(1)
    return runs


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


class _DecodeState:
    """Static buffers, the ``DecodeKV`` cache and (on CUDA) the captured decode steps for one (B, L, sampling) shape.

    Per-slot buffers (``cur_tok``, ``pos_ids``, ``finished``, ``rows``, ``force_len`` and the cache) hold the
    live rows in slots ``[:kv.b]``; ``rows`` maps a slot to its row of ``out`` (the caller's order), so batch
    compaction moves slots and never the output. ``graphs`` holds one captured step per window
    ``(kv.b, kv.lb)``, all in one memory pool (they run one after another, and everything they keep lives in
    the static buffers, so their scratch memory can be shared), every one captured on the cache storage of
    ``graph_epoch``; when the storage is replaced (``kv.epoch`` moves: growth) they go to ``retired``, never
    replayed again and destroyed after the call's final synchronisation.
    """

    def __init__(self, model, B: int, L: int, N: int, sp: SamplingParams, eos: torch.Tensor, pad_id: int,
                 use_graph: bool, use_gqa: bool, compiled: bool, forcing: bool, record_logprobs: bool = False,
                 kv_growth: bool = False):
        dev = next(model.parameters()).device
        self.model, self.B, self.L, self.N, self.sp = model, B, L, N, sp
        self.use_graph, self.use_gqa, self.compiled, self.forcing = use_graph, use_gqa, compiled, forcing
        self.dtype = next(model.parameters()).dtype
        self.kv = DecodeKV(B, L, self.dtype, dev, growth=kv_growth)
        self.eos, self.pad_id = eos, pad_id
        # an id that is no EOS, written in place of an EOS sampled before a forced length (bench/test hook)
        self.filler = next(i for i in range(len(eos) + 1) if i not in set(eos.tolist()))
        self.cur_tok = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.pos_ids = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.write_pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.step_idx = torch.zeros(1, dtype=torch.long, device=dev)
        self.out = torch.full((B, N), pad_id, dtype=torch.long, device=dev)
        self.finished = torch.zeros(B, dtype=torch.bool, device=dev)
        # optional (B, N) log-prob of each sampled token (the behaviour policy of async generation)
        self.logp = torch.zeros(B, N, dtype=torch.float32, device=dev) if record_logprobs else None
        self.rows = torch.arange(B, device=dev)
        self.force_len = torch.zeros(B, dtype=torch.long, device=dev)
        self.mask_stub = torch.zeros(B, 1, 1, 1, dtype=self.dtype, device=dev)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.graph_epoch, self.retired = self.kv.epoch, []
        self.pool = None
        self.pass_cache_position = "cache_position" in inspect.signature(model.forward).parameters
        self.weights_key = _weights_key(model)

    @property
    def row_ids(self) -> torch.Tensor:
        """``(b,)`` the caller's row of each live slot of the current window (after compactions)."""
        return self.rows[: self.kv.b]

    def force(self, nxt: torch.Tensor, s) -> torch.Tensor:
        """Bench/test hook: slot i emits EOS as its ``force_len[i]``-th token and no EOS before."""
        fl = self.force_len[: nxt.numel()]
        if self.eos.numel():
            nxt = torch.where(torch.isin(nxt, self.eos), torch.full_like(nxt, self.filler), nxt)
        return torch.where(fl == s + 1, self.eos[:1].expand_as(nxt), nxt)

    # one decode step over the window (kv.b, kv.lb): everything on device, in place on the static buffers
    def step(self):
        m, kv = self.model, self.kv
        b = kv.b
        kv.pos = self.write_pos
        kv.mask[:b].index_fill_(3, self.write_pos, 0.0)
        kw = {"cache_position": self.write_pos} if self.pass_cache_position else {}
        if self.use_gqa:  # cache_attention writes and reads the cache and its mask; the model sees neither
            # (a 4-D mask passes HF's mask creation as is in every version; its shape is fixed per b, so the
            # compiled layers' guards never see the length bucket or the static length)
            kw.update(attention_mask=self.mask_stub[:b], past_key_values=None, use_cache=False)
        else:  # the model's own attention over DecodeKV's window
            kw.update(attention_mask=kv.mask[:b, :, :, : kv.lb], past_key_values=kv, use_cache=True)
        with contextlib.ExitStack() as stack:
            stack.enter_context(attn_implementation(m, KV_ATTN_NAME if self.use_gqa else None))
            if self.use_gqa:
                stack.enter_context(active_kv(kv))
            if self.compiled:
                stack.enter_context(decode_layers_compiled(m, b))
            out = m(input_ids=self.cur_tok[:b], position_ids=self.pos_ids[:b], **kw)
        logits = out.logits[:, -1, :].float()
        del out
        allow = (self.step_idx >= self.sp.min_new_tokens) if self.sp.min_new_tokens else None
        nxt = sample_next(logits, self.sp, self.eos, allow)
        if self.forcing:
            nxt = self.force(nxt, self.step_idx)
        fin = self.finished[:b]
        nxt = torch.where(fin, torch.full_like(nxt, self.pad_id), nxt)
        self.out.index_put_((self.rows[:b], self.step_idx.expand(b)), nxt)
        if self.logp is not None:
            self.logp.index_put_((self.rows[:b], self.step_idx.expand(b)), sampled_logprob(logits, nxt, self.sp))
        if self.eos.numel():
            fin.logical_or_(torch.isin(nxt, self.eos))
        self.cur_tok[:b].copy_(nxt.unsqueeze(1))
        self.pos_ids[:b].add_(1)
        self.write_pos.add_(1)
        self.step_idx.add_(1)

    def retire_stale_graphs(self) -> None:
        """Retire every graph if the cache storage was replaced since they were captured (``kv.epoch``).

        A captured step reads the K/V tensors at their capture-time addresses; after a reallocation those are
        freed (and may hold anything), so the graphs must never be replayed again. They are kept (not destroyed)
        until the call's final synchronisation: the last replays may still be running on the device.
        """
        if self.kv.epoch != self.graph_epoch:
            self.retired.extend(self.graphs.values())
            self.graphs.clear()
            self.graph_epoch = self.kv.epoch

    def free_graphs(self) -> None:
        """Destroy every graph (call only when no replay can be running, e.g. after a synchronisation).

        The next capture gets a new memory pool: the old one has no graph left (PyTorch frees it at the next
        ``empty_cache``) and cannot take another capture.
        """
        self.graphs.clear()
        self.retired.clear()
        self.pool = None

    def compact(self, nb: int, written: int) -> None:
        """Keep ``nb`` slots, live rows first (plus finished ones up to ``nb``); ``written`` cache positions."""
        b = self.kv.b
        idx = torch.argsort(self.finished[:b].to(torch.uint8), stable=True)[:nb]
        self.kv.compact(idx, written)
        for buf in (self.cur_tok, self.pos_ids, self.finished, self.rows, self.force_len):
            buf[:nb].copy_(buf[:b].index_select(0, idx))


@contextlib.contextmanager
def attn_implementation(model, name: str | None):
    """``model``'s attention implementation set to ``name`` for the block.

    ``None``: the model's own if it takes the decoder's additive 4-D masks (``sdpa``, ``eager``), else ``sdpa``
    (flash-attention kernels take no such mask; every HF decoder also runs on sdpa).
    """
    old = model.config._attn_implementation
    if name is None:
        name = old if old in ("sdpa", "eager") else "sdpa"
    model.config._attn_implementation = name
    try:
        yield
    finally:
        model.config._attn_implementation = old


def _weights_key(model) -> tuple:
    # A captured step reads the weights at their capture-time addresses: reuse it only while every
    # parameter is still there (in-place optimizer updates keep them; FSDP2's per-call all-gather in
    # ``fsdp2_full_weights`` allocates them anew, so a kept graph is re-captured unless they land back).
    return tuple(p.data_ptr() for p in model.parameters())


_warned_compile: set = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned_compile:
        _warned_compile.add(msg)
        log.warning(msg)


class FastGenerator:
    """Batched generation with a static KV cache and a CUDA-graph decode step (see module docstring).

    Args:
        pad_token_id: written after a sequence's EOS (as HF generate does).
        eos_token_ids: every id that ends a completion.
        len_bucket: the static cache length P + N is rounded up to a multiple of this, so calls with
            nearby prompt lengths reuse the captured step.
        use_cuda_graph: None = on CUDA devices.
        gqa_attention: decode with ``kv_cache.gqa_decode_attention`` (True) or the model's own attention.
        check_every: decode steps between "all sequences finished?" checks (the only host syncs; with
            ``compaction`` also where the batch is compacted).
        keep_cache: keep the static KV cache and captured graphs between calls (no re-capture, but the
            cache, ~1.1 GiB for 32 x 1,280 tokens of a Qwen2.5-1.5B, stays allocated through the
            update phase). False (default): free them after each call and capture again next call
            (one eager step + a capture per window, tens of milliseconds each), so training peaks no higher
            than TRL's.
        compaction: stop paying for finished rows and unwritten positions (``data_tools.generation.kv_cache``): the
            decode attention reads ``[:lb]`` (``attn_len`` buckets of ``attn_bucket``), and at a check the
            live rows are moved to the smallest batch bucket (halvings of B, down to ``min_batch_bucket``)
            that holds them. One CUDA graph per window ``(b, lb)`` met. Greedy tokens equal compaction off.
        compile_step: the decode step's decoder layers through ``torch.compile`` (``dynamic=False``, one
            compile per batch bucket; needs CUDA graphs and ``gqa_attention``: otherwise it is off, with a
            warning). The attention over the cache stays eager inside the captured graph.
        kv_growth: with ``compaction`` (otherwise off, with a warning): the KV cache storage holds only the window,
            ``(b, KVH, cap, D)`` per layer with ``cap`` the window's length bucket (grown when a step needs more)
            and ``b`` its batch bucket (a compaction allocates the ``nb`` rows and frees the old storage), instead
            of ``(B, KVH, L, D)`` for the whole call. The cache then peaks at ``max over windows (b x cap) x
            kv_token_bytes`` (``data_tools.generation.kv_cache``; 10.5 GiB instead of 28.9 GiB on the realistic
            batch), for one copy of the live rows' written KV per reallocation (about 30 a call) and an
            ``empty_cache`` after each. Reallocations happen between windows, never inside a capture; a graph
            captured on a replaced storage is never replayed. Same tokens as off (greedy and seeded sampling).
            The storage and the graphs are freed at the end of every call, ``keep_cache`` or not (the next
            call starts again at ``B`` rows x the first bucket).
        attn_bucket: base of the attention length buckets (tokens).
        min_batch_bucket: smallest batch a compaction goes to (below it, the weights' read dominates a step).
        capture_error_mode: ``torch.cuda.graph``'s mode; "thread_local" when another thread keeps
            launching work during the capture (``trainers.async_rollouts``).
        capture_lock: a lock held around each capture, not its warm-up (``async_rollouts.CAPTURE_LOCK``): no
            capture mode lets another thread synchronize the whole device while a stream captures.
        stop_event: a ``threading.Event`` (or anything with ``is_set()``, e.g. ``engines.StopAt``, a deadline) checked
            at each "all finished?" check: set = stop decoding early. The call's output is then incomplete:
            ``last["stopped"]`` is True and ``last["unfinished"]`` lists the rows still decoding (a row that ended in
            an EOS before the stop is complete; the trainer's async rollouts discard the whole call, stage one keeps
            the finished rows).
    """

    def __init__(self, pad_token_id: int, eos_token_ids, *, len_bucket: int = 256, use_cuda_graph: bool | None = None,
                 gqa_attention: bool = True, check_every: int = 128, keep_cache: bool = False,
                 compaction: bool = False, compile_step: bool = False, attn_bucket: int = 256,
                 min_batch_bucket: int = 8, capture_error_mode: str = "global", stop_event=None,
                 kv_growth: bool = False, capture_lock=None):
        self.pad_id = int(pad_token_id)
        self.eos_ids = [int(e) for e in ([eos_token_ids] if isinstance(eos_token_ids, int) else eos_token_ids or [])]
        self.len_bucket = max(1, int(len_bucket))
        self.use_cuda_graph = use_cuda_graph
        self.gqa_attention = gqa_attention and register_kv_attention()
        self.check_every = max(1, int(check_every))
        self.keep_cache = keep_cache
        self.compaction, self.compile_step = bool(compaction), bool(compile_step)
        self.kv_growth = bool(kv_growth)
        self.attn_bucket, self.min_batch_bucket = max(1, int(attn_bucket)), max(1, int(min_batch_bucket))
        self.capture_error_mode = capture_error_mode
        self.capture_lock = capture_lock if capture_lock is not None else contextlib.nullcontext()
        self.stop_event = stop_event
        self._state: _DecodeState | None = None
        self._streams: dict = {}  # device -> the side stream of every warm-up step (``warmup_stream``)
        #: cumulative: ``captures`` decode states built, ``graphs`` CUDA graphs captured, ``compactions``
        self.stats: dict[str, float] = {}
        #: the last call: ``steps``, ``row_steps`` (sum of b), ``attn_row_tokens`` (sum of b x lb), ``graphs``,
        #: ``compactions``, ``capture_s`` (warm-up steps + captures, synchronised), ``compiled_batch_sizes``,
        #: ``windows`` ((t, b, lb, cap, cache bytes) at each change, the prefill's first), ``kv_peak_bytes``
        #: (``DecodeKV.peak_bytes``), ``reallocations`` (growths and shrinks of the cache storage)
        self.last: dict = {}

    def warmup_stream(self, device):
        """The side stream that every warm-up step before a capture runs on, one per device for this generator.

        A new ``torch.cuda.Stream()`` per capture (27 a realistic call) walks through the device's pool of 32
        streams, and cuBLAS keeps a workspace for every (handle, stream) pair it has run on, allocated from the
        caching allocator and never freed (``torch._C._cuda_clearCublasWorkspaces`` aside): 32 MiB each on Hopper by
        default (``CUBLAS_WORKSPACE_CONFIG``), so ``memory/allocated_gib`` climbs by one workspace per new stream
        until the pool's 32 are all used (~1 GiB). One stream per generator keeps that to one workspace (the capture
        stream has its own). Memory over many steps with this decoder: bench/results/2026-12-05-h200-memory.md.
        """
        key = torch.device(device)
        s = self._streams.get(key)
        if s is None:
            s = self._streams[key] = torch.cuda.Stream(device=key)
        return s

    def _get_state(self, model, B, L, N, sp, eos, use_graph, forcing, record_logprobs=False) -> _DecodeState:
        use_gqa = self.gqa_attention
        compiled = self.compile_step
        if compiled and not (use_graph and use_gqa):
            _warn_once("decode_compile needs CUDA graphs and the GQA decode attention (a CUDA device, "
                       "gqa_attention=True): the decode step runs eagerly")
            compiled = False
        growth = self.kv_growth and self.compaction
        if self.kv_growth and not growth:
            _warn_once("decode_kv_growth needs decode_compaction (the window it follows): the KV cache stays at full "
                       "size")
        st = self._state
        if (st is not None and st.model is model and (st.B, st.L, st.N, st.sp) == (B, L, N, sp)
                and (st.use_graph, st.compiled, st.forcing, st.kv.growth) == (use_graph, compiled, forcing, growth)
                and st.weights_key == _weights_key(model) and (st.logp is not None) == record_logprobs):
            return st
        self._state = None  # drop the old cache/graph before allocating a new one
        if st is not None:
            del st
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        self._state = _DecodeState(model, B, L, N, sp, eos, self.pad_id, use_graph, use_gqa, compiled, forcing,
                                   record_logprobs, growth)
        self.stats["captures"] = self.stats.get("captures", 0) + 1
        return self._state

    @torch.no_grad()
    def generate(self, model, prompt_ids: list[list[int]], sp: SamplingParams,
                 forced_lengths: list[int] | None = None, *, return_logprobs: bool = False):
        """Completion ids per prompt, cut after the first EOS (EOS kept), like TRL's HF path.

        ``return_logprobs``: return ``(ids, logprobs)``, ``logprobs[i][j]`` the fp32 log-prob of token j of
        completion i under the sampling model (``sampled_logprob``), aligned with ``ids[i]``.

        ``forced_lengths``: bench/test hook (random-weight models): row i ends with an EOS as its
        ``forced_lengths[i]``-th token (an EOS sampled earlier is replaced by a non-EOS id); needs EOS ids.
        """
        dev = next(model.parameters()).device
        B = len(prompt_ids)
        N = int(sp.max_new_tokens)
        if B == 0 or N <= 0:
            empty = [[] for _ in prompt_ids]
            return (empty, [[] for _ in prompt_ids]) if return_logprobs else empty
        if forced_lengths is not None and (len(forced_lengths) != B or not self.eos_ids):
            raise ValueError("forced_lengths needs one length per prompt and an EOS id")
        P = max(len(p) for p in prompt_ids)
        L = int(math.ceil((P + N) / self.len_bucket) * self.len_bucket)
        use_graph = dev.type == "cuda" if self.use_cuda_graph is None else (self.use_cuda_graph and dev.type == "cuda")
        eos = torch.tensor(self.eos_ids, dtype=torch.long, device=dev)
        st = self._get_state(model, B, L, N, sp, eos, use_graph, forced_lengths is not None, return_logprobs)

        ids = torch.full((B, P), self.pad_id, dtype=torch.long)
        pmask = torch.zeros(B, P, dtype=torch.bool)
        for i, p in enumerate(prompt_ids):
            if p:
                ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
                pmask[i, P - len(p):] = True
        ids, pmask = ids.to(dev), pmask.to(dev)
        pos = (pmask.long().cumsum(-1) - 1).masked_fill(~pmask, 0)
        minf = torch.finfo(st.dtype).min
        # additive masks (0 / dtype min, not -inf): a left-pad query row that sees no key stays finite
        causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril()
        pre_mask = torch.where(causal[None, None] & pmask[:, None, None, :], 0.0, minf).to(st.dtype)

        was_training = model.training
        model.eval()
        kv = st.kv
        try:
            # growth: a fresh storage of B rows x the first decode step's bucket (the prefill writes [:P] of it)
            kv.begin(attn_len(P + 1, L, self.attn_bucket))
            kv.b, kv.lb, kv.pos, kv.seen = B, P, torch.arange(P, device=dev), 0
            kv.mask.fill_(minf)
            kv.mask[:, 0, 0, :P] = torch.where(pmask, 0.0, minf).to(st.dtype)
            st.finished.zero_()
            st.out.fill_(self.pad_id)
            st.rows.copy_(torch.arange(B, device=dev))
            if forced_lengths is not None:
                st.force_len.copy_(torch.tensor(forced_lengths, dtype=torch.long))
            kw = {"cache_position": kv.pos} if st.pass_cache_position else {}
            with attn_implementation(model, None):
                out = model(input_ids=ids, attention_mask=pre_mask, position_ids=pos, past_key_values=kv,
                            use_cache=True, logits_to_keep=1, **kw)
            del pre_mask
            kv.seen, kv.lb = P, L
            allow = torch.tensor(sp.min_new_tokens <= 0, device=dev) if sp.min_new_tokens else None
            out_logits = out.logits[:, -1, :].float()
            del out
            first = sample_next(out_logits, sp, eos, allow)
            if st.forcing:
                first = st.force(first, 0)
            st.out[:, 0] = first
            if st.logp is not None:
                st.logp[:, 0] = sampled_logprob(out_logits, first, sp)
            if eos.numel():
                st.finished.copy_(torch.isin(first, eos))
            st.cur_tok.copy_(first.unsqueeze(1))
            st.pos_ids.copy_(pos[:, -1:] + 1)
            st.write_pos.fill_(P)
            st.step_idx.fill_(1)
            del out_logits
            self._decode(st, N, P)
            toks = st.out.cpu()  # synchronises: no replay of this call is still running
            if self.last.get("stopped"):  # the rows still decoding when stop_event was set (their slots' rows)
                b = kv.b
                self.last["unfinished"] = sorted(st.rows[:b][~st.finished[:b]].tolist())
            lps = st.logp.cpu().tolist() if st.logp is not None else None
            if kv.growth:  # the next call allocates its own storage: free its graphs and this one now
                st.free_graphs()
                kv.drop()
        finally:
            model.train(was_training)
            if not self.keep_cache:
                self._state = None  # frees the cache, buffers and the graphs' memory pool
                del st, kv
        res = []
        eos_set = set(self.eos_ids)
        for row in toks.tolist():
            cut = next((j + 1 for j, t in enumerate(row) if t in eos_set), len(row))
            res.append(row[:cut])
        if return_logprobs:
            return res, [lp[: len(r)] for lp, r in zip(lps, res)]
        return res

    def _decode(self, st: _DecodeState, N: int, P: int) -> None:
        """Decode steps 1..N-1: a check every ``check_every`` steps (all finished? compact?), then one step."""
        kv = st.kv
        buckets = batch_buckets(st.B, self.min_batch_bucket) if self.compaction else [st.B]
        last = {"steps": 0, "row_steps": 0, "attn_row_tokens": 0, "graphs": 0, "compactions": 0, "capture_s": 0.0,
                "windows": [(0, kv.b, P, kv.cap, kv.nbytes())], "reallocations": 0}
        self.last = last
        t = 1
        try:
            while t < N:
                epoch = kv.epoch
                if t % self.check_every == 0:
                    live = int((~st.finished[: kv.b]).sum())  # the host sync
                    if live == 0:
                        return
                    if self.stop_event is not None and self.stop_event.is_set():
                        last["stopped"] = True  # the caller keeps the finished rows (``last["unfinished"]``)
                        return
                    nb = min((x for x in buckets if x >= live), default=kv.b)
                    if nb < kv.b:
                        st.compact(nb, P + t - 1)
                        last["compactions"] += 1
                if self.compaction:  # the step at t writes position P + t - 1 and attends over [:P + t]
                    kv.lb = attn_len(P + t, st.L, self.attn_bucket)
                    # growth: a larger storage before the window's graph is captured or replayed (never inside)
                    kv.reserve(kv.lb, P + t - 1)
                if kv.epoch != epoch:
                    last["reallocations"] += 1
                st.retire_stale_graphs()  # a graph captured on a replaced storage is never replayed
                if last["windows"][-1][1:4] != (kv.b, kv.lb, kv.cap):
                    last["windows"].append((t, kv.b, kv.lb, kv.cap, kv.nbytes()))
                key = (kv.b, kv.lb)
                last["steps"] += 1
                last["row_steps"] += kv.b
                last["attn_row_tokens"] += kv.b * kv.lb
                if not st.use_graph:
                    st.step()
                elif key in st.graphs:
                    st.graphs[key].replay()
                else:  # warm-up (a real decode step, also where a compile happens) on a side stream, then capture
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    s = self.warmup_stream(st.kv.mask.device)  # one stream: one cuBLAS workspace, not one per capture
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s):
                        st.step()
                    torch.cuda.current_stream().wait_stream(s)
                    if t + 1 < N:  # the capture records a step for the next ones; it executes nothing
                        if st.pool is None:
                            st.pool = torch.cuda.graph_pool_handle()
                        g = torch.cuda.CUDAGraph()
                        # the capture only (torch.cuda.graph synchronizes on entry): a compile never waits inside it
                        with self.capture_lock, torch.cuda.graph(g, pool=st.pool,
                                                                 capture_error_mode=self.capture_error_mode):
                            st.step()
                        st.graphs[key] = g
                        last["graphs"] += 1
                        self.stats["graphs"] = self.stats.get("graphs", 0) + 1
                    torch.cuda.synchronize()
                    last["capture_s"] += time.perf_counter() - t0
                t += 1
        finally:
            self.stats["compactions"] = self.stats.get("compactions", 0) + last["compactions"]
            last["kv_peak_bytes"] = kv.peak_bytes
            last["compiled_batch_sizes"] = sorted(compiled_batch_sizes(st.model)) if st.compiled else []


def decode_options(compaction: bool, compile_step: bool, kv_growth: bool) -> dict:
    """``FastGenerator``'s keyword arguments from the three decode flags (``OPDConfig.decode_compaction`` /
    ``decode_compile`` / ``decode_kv_growth``, or an engine's). The KV cache's growth follows the compaction window,
    so without compaction it is off here, quietly: the config's help says so, and ``FastGenerator`` warns only when
    called with growth and no compaction directly."""
    return {"compaction": bool(compaction), "compile_step": bool(compile_step),
            "kv_growth": bool(kv_growth) and bool(compaction)}


def generator_for(model, pad_token_id: int, eos_token_ids, **kw) -> FastGenerator:
    """The ``FastGenerator`` kept on ``model`` (created on first use; reused while ids and ``kw`` match)."""
    g = getattr(model, "_opd_fast_generator", None)
    key = (int(pad_token_id), tuple(eos_token_ids if not isinstance(eos_token_ids, int) else [eos_token_ids]),
           tuple(sorted(kw.items())))
    if g is None or getattr(g, "_key", None) != key:
        g = FastGenerator(pad_token_id, eos_token_ids, **kw)
        g._key = key
        setattr(model, "_opd_fast_generator", g)
    return g


__all__ = ["SamplingParams", "sampling_params_from", "FastGenerator", "decode_options", "generator_for", "sample_next",
           "sampled_logprob", "group_runs", "attn_implementation"]
