"""The trainer's fast generation: the fast decoder (``data_tools.generation.fast_decoder``) in place of TRL's HF
generate, where the trainer's distributed set-up allows it (``OPDConfig.fast_generation``).

``fast_generate_single_turn`` is the drop-in for ``DistillationTrainer._generate_single_turn``'s HF branch;
``fast_path_unsupported`` says when it cannot run (FSDP1, ZeRO-3). Under FSDP2 (``fully_shard``, e.g. accelerate's
``fsdp_version: 2``) ``fsdp2_full_weights`` all-gathers the student's weights once per generation call and detaches
FSDP's forward hooks for the call, so the decode loop (and its captured graph) runs on whole weights with no
per-layer, per-token collectives.
"""

from __future__ import annotations

import contextlib
import copy
import logging

import torch
from trainers.trl_calls import unwrap_for_generation

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - torch without FSDP2 (or without torch.distributed): nothing is sharded
    FSDPModule = None

from data_tools.generation.fast_decoder import decode_options, generator_for, sampling_params_from

log = logging.getLogger(__name__)


class FSDPHooksNotFound(RuntimeError):
    """``fsdp2_full_weights`` could not identify FSDP2's forward hooks (an FSDP2 internal changed)."""


def _fsdp2_modules(model) -> list:
    """The modules of ``model`` sharded by FSDP2 ``fully_shard`` (root included), or [] without FSDP2."""
    return [] if FSDPModule is None else [m for m in model.modules() if isinstance(m, FSDPModule)]


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


def make_snapshot(model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A frozen deep copy of ``model`` for a generator: eval mode, no grad, own config; its parameters cast to
    ``dtype`` when given (buffers keep theirs: the rotary frequencies stay float32).

    Instance-level ``forward`` overrides (``compile_decoder_layers``' closures bind the *original*
    layers) are removed so the copy runs its own weights; its config is a separate object, so the
    decode step's attention switch never shows in the trainer's forward.
    """
    kept = model.__dict__.pop("_opd_fast_generator", None)  # a captured graph is not copyable
    # each parameter enters the copy already in its dtype (deepcopy's memo): copying the fp32 model whole and casting
    # after would hold both copies at once (~7 GB more at the peak for a 1.78B student, not 3.6); tied weights stay tied
    memo = {id(p): torch.nn.Parameter(p.detach().to(dtype or p.dtype, copy=True), requires_grad=False)
            for p in model.parameters() if p.is_floating_point()}
    try:
        snap = copy.deepcopy(model, memo)
    finally:
        if kept is not None:
            model._opd_fast_generator = kept
    for m in snap.modules():
        m.__dict__.pop("forward", None)
        m._forward_hooks.clear()
        m._forward_pre_hooks.clear()
    for p in snap.parameters():
        p.requires_grad_(False)
        p.grad = None
    if dtype is not None and getattr(snap, "config", None) is not None:
        snap.config.dtype = dtype
    return snap.eval()


@torch.no_grad()
def decode_weights(trainer, model: torch.nn.Module, owner=None) -> torch.nn.Module:
    """The model the decoder runs for ``trainer``'s student ``model`` (unwrapped, whole weights): ``model`` itself,
    or where ``OPDConfig.decode_dtype`` asks for another dtype, a copy in that dtype kept as ``owner.decode_copy``
    (made once; ``owner``: the trainer's rollout source, ``trainers.rollout_source.FastDecoder``, else ``trainer``)
    with the student's current weights copied in."""
    choose = getattr(trainer.args, "decode_torch_dtype", None)  # an OPDConfig's; other trainers decode the model
    if choose is None or _fsdp2_modules(model):
        return model
    weights = next(model.parameters()).dtype
    want = choose(weights)
    if want == weights:
        return model
    owner = trainer if owner is None else owner
    snap = getattr(owner, "decode_copy", None)
    if snap is None:
        snap = owner.decode_copy = make_snapshot(model, want)
        log.info("fast_generation: decoding from a %s copy of the student's %s weights", want, weights)
    src, dst = list(model.parameters()), list(snap.parameters())
    if len(src) != len(dst):
        raise RuntimeError(f"the decode copy has {len(dst)} parameters, the student {len(src)}")
    torch._foreach_copy_(dst, [p.detach() for p in src])
    return snap


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


def fast_generate_single_turn(trainer, prompt_ids: list[list[int]], owner=None) -> list[list[int]] | None:
    """Drop-in for ``DistillationTrainer._generate_single_turn``'s HF branch (text-only prompts); ``owner`` keeps the
    decode copy (``decode_weights``).

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
    sp = sampling_params_from(trainer.generation_config)
    if sp is None or fast_path_unsupported(trainer) is not None:
        return None
    with contextlib.ExitStack() as stack:
        unwrapped = stack.enter_context(unwrap_for_generation(
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
        args = trainer.args
        unwrapped = decode_weights(trainer, unwrapped, owner)
        gen = generator_for(unwrapped, trainer._tokenizer.pad_token_id, trainer.eos_token_ids,
                            **decode_options(getattr(args, "decode_compaction", False),
                                             getattr(args, "decode_compile", False),
                                             getattr(args, "decode_kv_growth", False)))
        return gen.generate(unwrapped, [list(p) for p in prompt_ids], sp)


__all__ = ["decode_weights", "fast_generate_single_turn", "fast_path_unsupported", "fsdp2_full_weights", "make_snapshot",
           "FSDPHooksNotFound"]
