"""Calls into TRL whose signatures changed between 0.29 and 1.16 (``trainers.trl_compat`` re-exports them)."""

from __future__ import annotations

import contextlib
import inspect


def unwrap_for_generation(model, accelerator, **kwargs):
    """``trl.models.utils.unwrap_model_for_generation`` with the keyword arguments this TRL's signature accepts
    (``gradient_checkpointing_kwargs`` arrived after 1.0)."""
    from trl.models.utils import unwrap_model_for_generation

    accepted = inspect.signature(unwrap_model_for_generation).parameters
    return unwrap_model_for_generation(model, accelerator, **{k: v for k, v in kwargs.items() if k in accepted})


def profiling(trainer, name: str):
    """TRL's ``profiling_context`` (timings into its loggers) where it exists, else a no-op context."""
    try:
        from trl.extras.profiling import profiling_context
    except ImportError:  # pragma: no cover - present from 0.29 on
        return contextlib.nullcontext()
    return profiling_context(trainer, name)
