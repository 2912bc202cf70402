"""The decoder's KV cache, its length and batch buckets, and the compiled decode layers (``trainers.generation``).

A static batch decoded to its longest member reads, at every step, the KV cache of every row over the whole
static length ``L``, finished rows and unwritten positions included (masked, but read). With long-tailed
completion lengths (most rows finish early, a few run to the cap) most of that work is wasted. ``DecodeKV``
keeps one K and one V tensor ``(B, KVH, L, D)`` per layer, allocated once, and a *window* ``(b, lb)``:

- **length bucket** ``lb``: the attention of a decode step reads positions ``[:lb]`` only, ``lb`` the next
  position rounded up by ``attn_len`` (steps of ``base`` tokens up to ``16 * base``, then 1/16 of a power of
  two: less than 1/8 of the read is padding, and a 256-token prompt + an 8,192 cap has 25 buckets);
- **batch bucket** ``b``: after ``compact`` the live rows sit in slots ``[:b]`` (a prefix of the batch dim of
  the same storage: no second cache, only a copy of the live rows' written KV), ``b`` a halving of ``B``
  (``batch_buckets``). This is the static-shape form of what vLLM / SGLang do with continuous batching
  (their paged caches free a finished sequence's blocks at once; refilling freed slots with new prompts is
  left out here: the trainer's batch is fixed per step).

Each ``(b, lb)`` is one static shape: ``trainers.generation`` captures one CUDA graph per window met (one
memory pool for all; the windows met form one path, the length growing and the batch shrinking), so the
realistic call of ``bench/decode_bench.py`` (128 rows, prompts up to 512 tokens, cap 8,192) captures 27.
Compaction frees no memory (the cache keeps its ``B`` rows): the peak is the prefill's anyway.

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
    """Per-layer K/V tensors ``(B, KVH, L, D)``, an additive mask ``(B, 1, 1, L)`` and the window ``(b, lb)``.

    Duck-types the part of transformers' ``Cache`` a decoder's attention uses (``update``), so the model's
    own attention can run on it (prefill, or ``gqa_attention=False``); ``cache_attention`` uses it without
    the model seeing it. Tensors are allocated on the first ``update`` of each layer (shapes and dtype from
    the key states), zero-filled: positions never written are finite and masked.

    Attributes:
        b, lb: slots ``[:b]`` and positions ``[:lb]`` are read and written by the next forward.
        pos: ``(q,)`` long positions the next forward writes (``arange(P)`` at prefill, the decode step's
            write position buffer afterwards).
        mask: ``(B, 1, 1, L)`` additive mask in the model dtype (0 = attend, dtype min = masked).
    """

    def __init__(self, B: int, L: int, dtype: torch.dtype, device):
        self.B, self.L = int(B), int(L)
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.b, self.lb = self.B, self.L
        self.pos: torch.Tensor | None = None
        self.seen = 0
        self.mask = torch.full((B, 1, 1, L), torch.finfo(dtype).min, dtype=dtype, device=device)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Write ``(b, KVH, q, D)`` states at ``pos`` of layer ``layer_idx``; return its ``(b, KVH, lb, D)`` views."""
        if layer_idx not in self.k:
            shape = (self.B, key_states.shape[1], self.L, key_states.shape[-1])
            self.k[layer_idx] = torch.zeros(shape, dtype=key_states.dtype, device=key_states.device)
            self.v[layer_idx] = torch.zeros(shape[:-1] + (value_states.shape[-1],), dtype=value_states.dtype,
                                            device=value_states.device)
        k, v = self.k[layer_idx][: self.b], self.v[layer_idx][: self.b]
        k.index_copy_(2, self.pos, key_states)
        v.index_copy_(2, self.pos, value_states)
        return k[:, :, : self.lb], v[:, :, : self.lb]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def compact(self, idx: torch.Tensor, written: int) -> None:
        """Move slots ``idx`` (``(nb,)`` long, distinct) to slots ``[:nb]``; copies positions ``[:written]`` only.

        One layer at a time through a temporary of the gathered rows (``nb x KVH x written x D``), so no second
        cache is allocated. Sets ``b = nb``.
        """
        nb = int(idx.numel())
        for store in (self.k, self.v):
            for t in store.values():
                t[:nb, :, :written].copy_(t[:, :, :written].index_select(0, idx))
        self.mask[:nb].copy_(self.mask.index_select(0, idx))
        self.b = nb

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in (self.k, self.v) for t in s.values())


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
    from trainers.generation import gqa_decode_attention

    kv = _ACTIVE[0]
    if kv is None:
        raise RuntimeError(f"{KV_ATTN_NAME} attention called outside a decode step (no active DecodeKV)")
    k, v = kv.update(key, value, module.layer_idx)
    return gqa_decode_attention(module, query, k, v, kv.mask[: kv.b, :, :, : kv.lb], scaling=scaling)


def register_kv_attention() -> bool:
    try:
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
    compile's entries. Raises ``ValueError`` if the model has no ``model.layers``.
    """
    import torch._dynamo

    layers = _layers(model)
    if not layers:
        raise ValueError("decode_compile: the model has no model.layers to compile")
    comp = getattr(model, "_opd_decode_compiled", None)
    if comp is None:
        comp = torch.compile(type(layers[0]).forward, dynamic=False)
        model._opd_decode_compiled = comp
        model._opd_decode_compiled_b = set()
    cfg = torch._dynamo.config
    # entries per code object: (batch buckets + training's) x layers, should dynamo key them by layer instance
    need = 64 + 8 * len(layers)
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(need, getattr(cfg, name)))
    if hasattr(cfg, "accumulated_recompile_limit"):
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 16 * need)
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


__all__ = ["DecodeKV", "attn_len", "batch_buckets", "cache_attention", "active_kv", "register_kv_attention",
           "decode_layers_compiled", "compiled_batch_sizes", "KV_ATTN_NAME"]
