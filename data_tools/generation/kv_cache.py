"""The decoder's KV cache, its length and batch buckets, and the compiled decode layers (``fast_decoder``).

A static batch decoded to its longest member reads, at every step, the KV cache of every row over the whole
static length ``L``, finished rows and unwritten positions included (masked, but read). With long-tailed
completion lengths (most rows finish early, a few run to the cap) most of that work is wasted. ``DecodeKV``
keeps one K and one V tensor ``(B, KVH, L, D)`` per layer, allocated once (or sized to the window: growth,
below), and a *window* ``(b, lb)``:

- **length bucket** ``lb``: the attention of a decode step reads positions ``[:lb]`` only, ``lb`` the next
  position rounded up by ``attn_len`` (steps of ``base`` tokens up to ``16 * base``, then 1/16 of a power of
  two: less than 1/8 of the read is padding, and a 256-token prompt + an 8,192 cap has 25 buckets);
- **batch bucket** ``b``: after ``compact`` the live rows sit in slots ``[:b]`` (a prefix of the batch dim of
  the same storage: no second cache, only a copy of the live rows' written KV), ``b`` a halving of ``B``
  (``batch_buckets``). This is the static-shape form of what vLLM / SGLang do with continuous batching
  (their paged caches free a finished sequence's blocks at once; refilling freed slots with new prompts is
  left out here: the trainer's batch is fixed per step).

Each ``(b, lb)`` is one static shape: ``fast_decoder`` captures one CUDA graph per window met (one
memory pool for all; the windows met form one path, the length growing and the batch shrinking), so the
realistic call of ``bench/decode_bench.py`` (128 rows, prompts up to 512 tokens, cap 8,192) captures 27.

Memory. By default the storage is allocated once at full size and compaction frees nothing: the cache holds
``B x L x kv_token_bytes`` (``kv_token_bytes = 2 x layers x KVH x D x dtype bytes``: 28,672 B for a
Qwen2.5-1.5B in bf16), 28.9 GiB for 128 x 8,448 tokens. With **growth** (``DecodeKV(growth=True)``,
``FastGenerator(kv_growth=True)``, ``OPDConfig.decode_kv_growth``) the storage follows the window instead: its
length capacity ``cap`` is the window's length bucket (``reserve``: grown to ``lb`` when a window needs more,
the written positions of the live rows copied over) and its rows are the window's ``b`` (``compact``
allocates ``nb`` rows and drops the old storage). Then the cache peaks at

    max over windows (b x cap) x kv_token_bytes   (+ one layer's old K or V while it is being replaced)

(``window_path`` replays a call's windows; ``FastGenerator.last["windows"]`` records the real ones). For the
realistic batch of bench/opd_step_realistic.py (``bench/step_realism.py`` lengths, seed 0, 128 rows, prompts of <= 256 tokens,
cap 8,192, L = 8,448, check every 128 steps, 256-token buckets) the largest window is the last one before the
first compaction to 64 rows: 128 x 2,816 positions at step 2,305 in the timed batch (batch 1: 9.6 GiB), 128 x
3,072 at step 2,561 in the warm-up batch (batch 0: 10.5 GiB), against 28.9 GiB without growth; a reallocation
adds one layer's old K or V (under 0.2 GiB). ``bench/opd_step_realistic.py`` records the expected and the measured
peak per variant (``decode_kv``), ``bench/decode_bench.py`` per mode.
Every reallocation gives the storage new addresses, so the CUDA graphs captured on the old one are retired
(``epoch``), and it happens between two decode steps, outside any capture (``fast_decoder.FastGenerator._decode``).

``decode_layers_compiled``: the decode step's decoder layers run through one ``torch.compile``d function
(``dynamic=False``, inductor's default mode: no cudagraph trees, the caller captures the graph). The
attention over the cache is left out of the compiled region (``cache_attention`` is
``torch.compiler.disable``d and reads the window from ``DecodeKV``, not from its arguments), so the compiled
code sees only ``(b, 1, ...)`` shapes: it compiles once per batch bucket, never per length bucket or per call.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math

import torch

from data_tools.generation.fallback import guarded_compile, raise_recompile_limit

log = logging.getLogger(__name__)

#: attention implementation name of the decode step with ``DecodeKV`` (the cache is not passed to the model)
KV_ATTN_NAME = "opd_kv_decode"


def attn_len(n: int, L: int, base: int) -> int:
    """Attention length bucket for ``n`` positions: ``n`` rounded up to a multiple of ``g``, at most ``L``.

    ``g = base`` while ``n <= 16 * base``, then doubles with ``n`` (``g`` is 1/16 of a power of two, so
    ``g < n / 8``): the padding read is below ``max(base, n / 8)`` and the number of buckets grows with
    log(L) (16 per doubling). Units: tokens.
    """
    g = max(1, int(base))
    while n > 16 * g:
        g *= 2
    return min(int(L), int(math.ceil(n / g) * g))


def batch_buckets(B: int, smallest: int) -> list[int]:
    """Batch sizes a decode may compact to: ``B``, ``ceil(B/2)``, ``ceil(B/4)``, ... while ``>= smallest``."""
    out = [int(B)]
    while (nxt := -(-out[-1] // 2)) >= max(1, smallest) and nxt < out[-1]:
        out.append(nxt)
    return out


class DecodeKV:
    """Per-layer K/V tensors ``(rows, KVH, cap, D)``, an additive mask ``(B, 1, 1, L)`` and the window ``(b, lb)``.

    Duck-types the part of transformers' ``Cache`` a decoder's attention uses (``update``), so the model's
    own attention can run on it (prefill, or ``gqa_attention=False``); ``cache_attention`` uses it without
    the model seeing it. Tensors are allocated on the first ``update`` of each layer (shapes and dtype from
    the key states), zero-filled: positions never written are finite and masked.

    Without ``growth`` the storage is ``(B, KVH, L, D)``, allocated once and kept (``rows = B``, ``cap = L``).
    With ``growth`` it holds only the window: ``begin(cap)`` drops it before a prefill (the next ``update``
    allocates ``B`` rows x ``cap`` positions), ``reserve`` grows ``cap`` and ``compact`` shrinks the rows to
    ``nb``, each through a new tensor per layer (the old one freed before the next layer's is allocated).

    Attributes:
        b, lb: slots ``[:b]`` and positions ``[:lb]`` are read and written by the next forward (``lb <= cap``).
        cap: positions each storage tensor holds (``L`` without growth).
        epoch: changes whenever a storage tensor is allocated or replaced; a CUDA graph captured under another
            epoch reads freed memory and must not be replayed (``fast_decoder``).
        peak_bytes: most bytes the K/V storage held at once since ``begin``, counting the old and the new
            tensor of the layer being replaced (and the gathered rows of a compaction).
        pos: ``(q,)`` long positions the next forward writes (``arange(P)`` at prefill, the decode step's
            write position buffer afterwards).
        mask: ``(B, 1, 1, L)`` additive mask in the model dtype (0 = attend, dtype min = masked).
    """

    def __init__(self, B: int, L: int, dtype: torch.dtype, device, growth: bool = False):
        self.B, self.L = int(B), int(L)
        self.growth = bool(growth)
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.b, self.lb, self.cap = self.B, self.L, self.L
        self.epoch, self.peak_bytes = 0, 0
        self.pos: torch.Tensor | None = None
        self.seen = 0
        self.mask = torch.full((B, 1, 1, L), torch.finfo(dtype).min, dtype=dtype, device=device)
        # cached blocks of a replaced storage are returned to the device (see _release)
        self._release_cached = torch.device(device).type == "cuda"

    def begin(self, cap: int | None = None) -> None:
        """Start a call: reset ``peak_bytes``; with growth also drop the storage and set ``cap`` (positions, <= L).

        Without growth ``cap`` is ignored (the storage is kept at ``(B, KVH, L, D)``).
        """
        if self.growth:
            self.drop()
            self.cap = min(self.L, int(cap if cap is not None else self.L))
        self.peak_bytes = self.nbytes()

    def drop(self) -> None:
        """Free the storage (the next ``update`` of each layer allocates ``(B, KVH, cap, D)`` again)."""
        if self.k or self.v:
            self.k.clear()
            self.v.clear()
            self.epoch += 1
            self._release()

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Write ``(b, KVH, q, D)`` states at ``pos`` of layer ``layer_idx``; return its ``(b, KVH, lb, D)`` views."""
        if layer_idx not in self.k:
            shape = (self.B, key_states.shape[1], self.cap, key_states.shape[-1])
            self.k[layer_idx] = torch.zeros(shape, dtype=key_states.dtype, device=key_states.device)
            self.v[layer_idx] = torch.zeros(shape[:-1] + (value_states.shape[-1],), dtype=value_states.dtype,
                                            device=value_states.device)
            self.epoch += 1
            self._note_peak()
        if self.lb > self.cap:  # host-side check only: growth must happen before the step (never inside a capture)
            raise RuntimeError(f"DecodeKV: window length {self.lb} exceeds the storage capacity {self.cap} "
                               "(reserve first)")
        k, v = self.k[layer_idx][: self.b], self.v[layer_idx][: self.b]
        k.index_copy_(2, self.pos, key_states)
        v.index_copy_(2, self.pos, value_states)
        return k[:, :, : self.lb], v[:, :, : self.lb]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def reserve(self, n: int, written: int) -> bool:
        """Growth: make the storage hold positions ``[:n]`` (``n`` capped at ``L``; the caller passes a bucket).

        If ``n > cap``, each layer's K and V are replaced by ``(b, KVH, n, D)`` tensors holding positions
        ``[:written]`` of the live slots ``[:b]`` (the rest zero); ``cap = n`` and ``epoch`` changes. Returns
        True if it reallocated. Call it between decode steps, outside a CUDA-graph capture. No-op without growth.
        """
        n = min(self.L, int(n))
        if not self.growth or n <= self.cap:
            return False
        self._realloc(None, self.b, n, written)
        return True

    def compact(self, idx: torch.Tensor, written: int) -> None:
        """Move slots ``idx`` (``(nb,)`` long, distinct) to slots ``[:nb]``; copies positions ``[:written]`` only.

        Without growth: in place, one layer at a time through a temporary of the gathered rows
        (``nb x KVH x written x D``), so no second cache is allocated and nothing is freed. With growth: each
        layer's storage is replaced by ``(nb, KVH, cap, D)`` (``epoch`` changes), so the memory of the dropped
        rows is freed. Sets ``b = nb``.
        """
        nb = int(idx.numel())
        if self.growth:
            self._realloc(idx, nb, self.cap, written)
        else:
            for store in (self.k, self.v):
                for t in store.values():
                    t[:nb, :, :written].copy_(t[:, :, :written].index_select(0, idx))
        self.mask[:nb].copy_(self.mask.index_select(0, idx))
        self.b = nb

    def _realloc(self, idx: torch.Tensor | None, rows: int, cap: int, written: int) -> None:
        """Each storage tensor replaced by ``(rows, KVH, cap, D)``: slots ``idx`` (or ``[:rows]``), positions
        ``[:written]`` copied, the rest zero."""
        for store in (self.k, self.v):
            for layer in list(store):  # keys only: the old tensor of a layer is freed before the next is allocated
                old = store[layer]
                src = old[:rows, :, :written] if idx is None else old[:, :, :written].index_select(0, idx)
                new = old.new_empty((rows, old.shape[1], cap, old.shape[3]))
                new[:, :, :written].copy_(src)
                new[:, :, written:].zero_()  # never written: finite (read under the mask)
                self._note_peak(new.nbytes + (src.nbytes if idx is not None else 0))
                store[layer] = new
                del old, src, new
        self.cap = cap
        self.epoch += 1
        self._release()

    def _note_peak(self, extra: int = 0) -> None:
        self.peak_bytes = max(self.peak_bytes, self.nbytes() + int(extra))

    def _release(self) -> None:
        # The caching allocator keeps a freed storage's blocks for reuse, but a grown storage never fits in the
        # smaller blocks it replaced: without this, ~11 generations of a growing cache (67 GiB for the realistic
        # batch) would stay reserved until an allocation fails (and one failing inside a graph capture cannot
        # free them). Called between decode steps, never during a capture; the graphs' private pool is kept.
        if self._release_cached and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def nbytes(self) -> int:
        """Bytes of the K/V storage now (all layers)."""
        return sum(t.numel() * t.element_size() for s in (self.k, self.v) for t in s.values())


def window_path(prompt_len: int, lengths: list[int], max_new_tokens: int, L: int, *, check_every: int,
                attn_bucket: int, min_batch_bucket: int, growth: bool) -> list[tuple[int, int, int, int]]:
    """The windows a compacting decode of completions of ``lengths`` tokens meets: ``(t, b, lb, cap)`` per change.

    Replays ``FastGenerator._decode``'s rule (``compaction=True``) on the host: step ``t`` (1 .. N-1) attends over
    ``lb = attn_len(P + t)``; at ``t % check_every == 0`` the live rows (``lengths[i] > t``; a row of length
    N never finishes) go to the smallest batch bucket that holds them, and the decode stops with none live.
    ``cap`` is the storage's length capacity: ``lb`` with ``growth`` (``attn_len(P + 1)`` from the prefill on),
    else ``L``. The first entry is the prefill's ``(0, B, P, cap)``. Units: tokens, rows.
    """
    B, P, N = len(lengths), int(prompt_len), int(max_new_tokens)
    buckets = batch_buckets(B, min_batch_bucket)
    b, cap = B, (attn_len(P + 1, L, attn_bucket) if growth else L)
    path = [(0, B, P, cap)]
    for t in range(1, N):
        if t % check_every == 0:
            live = sum(n > t for n in lengths)
            if live == 0:
                break
            b = min((x for x in buckets if x >= live), default=b)
        lb = attn_len(P + t, L, attn_bucket)
        if growth and lb > cap:
            cap = lb
        if path[-1][1:] != (b, lb, cap):
            path.append((t, b, lb, cap))
    return path


def kv_peak_bytes(path: list[tuple[int, int, int, int]], B: int, growth: bool, kv_token_bytes: int) -> int:
    """Steady peak of the K/V storage over a ``window_path``: ``max(b x cap) x kv_token_bytes`` with growth,
    ``B x L x kv_token_bytes`` without (``kv_token_bytes = 2 x layers x KVH x D x dtype bytes``). The transient
    of a reallocation (one layer's old K or V, plus the gathered rows at a compaction) comes on top."""
    return max((b if growth else B) * cap for _, b, _, cap in path) * int(kv_token_bytes)


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


#: the ``DecodeKV`` ``cache_attention`` reads; set only around a decode step's forward (``active_kv``)
_ACTIVE: list = [None]


@contextlib.contextmanager
def active_kv(kv: DecodeKV):
    _ACTIVE[0] = kv
    try:
        yield kv
    finally:
        _ACTIVE[0] = None


@torch.compiler.disable
def cache_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """Attention of the decode step over the active ``DecodeKV`` (an HF attention function).

    ``key`` / ``value``: the new token's states ``(b, KVH, 1, D)``, written at ``DecodeKV.pos`` of layer
    ``module.layer_idx``; the query ``(b, H, 1, D)`` then attends over the window ``[:b, :, :lb]`` under
    ``DecodeKV.mask`` (``attention_mask`` is ignored). Returns ``((b, 1, H, D), None)``. Not traced by
    ``torch.compile``: the window's shape stays out of the compiled code's guards.
    """
    kv = _ACTIVE[0]
    if kv is None:
        raise RuntimeError(f"{KV_ATTN_NAME} attention called outside a decode step (no active DecodeKV)")
    k, v = kv.update(key, value, module.layer_idx)
    return gqa_decode_attention(module, query, k, v, kv.mask[: kv.b, :, :, : kv.lb], scaling=scaling)


def register_kv_attention() -> bool:
    """Register ``cache_attention`` with transformers as ``KV_ATTN_NAME``; False (and a warning) if it cannot."""
    try:  # inside the try: a transformers without AttentionInterface keeps the model's own attention
        from transformers import AttentionInterface

        AttentionInterface.register(KV_ATTN_NAME, cache_attention)
        return True
    except Exception as e:  # pragma: no cover - older/newer transformers
        log.warning("cannot register the KV decode attention (%s)", e)
        return False


def _layers(model):
    return getattr(getattr(model, "model", None), "layers", None)


def compiled_batch_sizes(model) -> set:
    """Batch sizes the decode layers of ``model`` were compiled for so far (one compile each)."""
    return getattr(model, "_opd_decode_compiled_b", set())


@contextlib.contextmanager
def decode_layers_compiled(model, b: int):
    """Run ``model``'s decoder layers through one compiled function inside the block (decode steps only).

    The compiled function (``torch.compile(type(layer).forward, dynamic=False)``, kept on ``model`` so its
    compiled code outlives the call) replaces each layer's ``forward`` for the block and the previous one
    (the class method, or ``compile_decoder_layers``' wrapper) is put back on exit. Its guards see only the
    layer inputs ``(b, 1, hidden)`` etc.: one compile per batch size ``b`` (recorded in
    ``compiled_batch_sizes``); dynamo's recompile limit is raised to hold them all next to the training
    compile's entries (``fallback.raise_recompile_limit``). Raises ``ValueError`` if the model has no
    ``model.layers``.
    """
    layers = _layers(model)
    if not layers:
        raise ValueError("decode_compile: the model has no model.layers to compile")
    comp = getattr(model, "_opd_decode_compiled", None)
    if comp is None:
        # a compile error (at torch.compile or a first call): one line, then the eager forward
        comp = guarded_compile(type(layers[0]).forward, "decode_compile", dynamic=False)
        model._opd_decode_compiled = comp
        model._opd_decode_compiled_b = set()
        raise_recompile_limit(8 * len(layers))  # one entry per layer for each batch bucket (up to 8)
    saved = [layer.__dict__.get("forward") for layer in layers]
    for layer in layers:
        layer.forward = functools.partial(comp, layer)
    model._opd_decode_compiled_b.add(int(b))
    try:
        yield
    finally:
        for layer, fwd in zip(layers, saved):
            if fwd is None:
                del layer.forward
            else:
                layer.forward = fwd


__all__ = ["DecodeKV", "gqa_decode_attention", "attn_len", "batch_buckets", "window_path", "kv_peak_bytes", "cache_attention", "active_kv",
           "register_kv_attention", "decode_layers_compiled", "compiled_batch_sizes", "KV_ATTN_NAME"]
