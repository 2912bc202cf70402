"""One-line fallbacks: a path that cannot be tested in advance is checked where it starts and, if it fails, replaced
by the tested path with one logged line (``say_once``).

``guarded_compile`` (the decoder's ``decode_compile``, the trainer's ``compile_layers``) wraps a ``torch.compile``d
function so that an error while compiling it (``torch.compile`` itself, or dynamo / inductor at a call, where
compilation happens) logs one line and runs the eager function from then on; out-of-memory errors and activation
checkpointing's early stop of a recompute are re-raised (``PASS_THROUGH``). The trainer's vLLM colocate probe
(``trainers.guards``) says its fallback with ``say_once`` too.
"""

from __future__ import annotations

import logging

import torch
from torch.utils.checkpoint import _StopRecomputationError

log = logging.getLogger(__name__)

#: Raised through, never taken for a compile error: out of memory (hiding it would only move it), and the
#: exception with which non-reentrant activation checkpointing stops a recompute early once it has the tensors it
#: needs (``torch.utils.checkpoint``'s early stop, on by default). Caught, it sent the recompute down the eager path,
#: where checkpointing raised "Unexpected state: target_frame.early_stop is set" in the first backward of the
#: formal recipe (bench/results/2026-12-05-h200-rehearsal.md).
PASS_THROUGH: tuple[type[BaseException], ...] = (torch.OutOfMemoryError, _StopRecomputationError)

_said: set[str] = set()


def say_once(message: str) -> None:
    """Log ``message`` as a warning once per process (a fallback's one line)."""
    if message not in _said:
        _said.add(message)
        log.warning(message)


def first_line(e: BaseException) -> str:
    """``"<type>: <first line of the message>"`` (200 characters at most): an error named in one line."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def raise_recompile_limit(entries: int) -> None:
    """Make room for ``entries`` more compiled entries of one function in dynamo's per-function cache (and in its
    total over all functions). The decoder layers of a model share one function (``type(layer).forward``) but dynamo
    keys an entry by the layer too (its ``layer_idx`` is a constant of the graph), so every compiled shape costs one
    entry per layer, for the student, the teacher and the decode windows alike; past the limit dynamo runs the layer
    eagerly, with only a log line. Each compile adds its own need to the limits, so those of both models and of
    the decoder add up."""
    import torch._dynamo  # ~1 s to import, only where something is compiled

    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # torch >= 2.6 names it recompile_limit (the other an alias)
        if hasattr(cfg, name):
            setattr(cfg, name, getattr(cfg, name) + entries)
            break
    for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, getattr(cfg, name) + entries)
            break


def guarded_compile(eager, what: str, compiled=None, **compile_kw):
    """``torch.compile(eager, **compile_kw)`` (or ``compiled``) behind a fallback to ``eager``.

    If ``torch.compile`` raises, or a call of the compiled function raises anything but ``PASS_THROUGH``,
    ``what`` is named in one logged line and ``eager`` runs from then on (that call included). A genuine error of
    the function then surfaces from the eager call. Returns the wrapper; ``wrapper.state["failed"]`` says whether it fell back.
    """
    state = {"fn": compiled, "failed": False}
    if compiled is None:
        try:
            state["fn"] = torch.compile(eager, **compile_kw)
        except Exception as e:  # noqa: BLE001
            state["failed"] = True
            say_once(f"{what}: torch.compile failed ({first_line(e)}); running eagerly")

    def call(*args, **kwargs):
        if not state["failed"]:
            try:
                return state["fn"](*args, **kwargs)
            except PASS_THROUGH:
                raise
            except Exception as e:  # noqa: BLE001 - compile errors surface at the first call of a shape
                state["failed"] = True
                say_once(f"{what}: the compiled function failed ({first_line(e)}); running eagerly from now on")
        return eager(*args, **kwargs)

    call.state = state
    return call
