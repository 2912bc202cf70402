"""Schedules over the wall clock: pure ``fraction -> factor`` maps and a torch ``LambdaLR`` that reads them.

A formal run's step count is unknown in advance (the horizon is time, docs/design.md section 6), so a
decay over ``max_steps`` cannot be used. These schedules take the *fraction of the training window
used*, f in [0, 1] (``OPDTrainer.time_fraction()``), and return a multiplier of the peak value:

- warmup, for f < w:     factor = f / w                                  (linear ramp from 0)
- after warmup, with progress p = (f - w) / (1 - w) and final ratio r:
  - ``constant``:        factor = 1
  - ``linear``:          factor = r + (1 - r) * (1 - p)
  - ``cosine``:          factor = r + (1 - r) * (1 + cos(pi * p)) / 2

With r = 0 these are transformers' ``get_constant_schedule_with_warmup`` /
``get_linear_schedule_with_warmup`` / ``get_cosine_schedule_with_warmup`` (half a cycle) with the step
ratio ``step / num_training_steps`` replaced by f. Seed evidence for decaying at all: at fixed steps,
linear decay scored 54.22 vs 50.56 for constant (AIME24 avg@12, OPSD on Qwen3).

Because the factor reads the clock, nothing of the schedule is in the optimizer's state: a resumed run
continues from the fraction f0 its checkpoint saved (``OPDTrainer``'s ``opd_clock.json``), with
f = f0 + (1 - f0) x the new window's used share, so it reaches the schedule's end at the new horizon.

Beside them, ``adam_update_sumsq``: the step Adam takes per weight in units of the rate (the metric
``optim/update_rms``). A schedule sets the rate; this says how far that rate actually moved the weights, which
differs from 1 when the optimizer's moments were built on other gradients (an SFT phase before on-policy steps).
"""

from __future__ import annotations

import math
from typing import Callable

#: Shapes after warmup, by name.
SHAPES = ("constant", "linear", "cosine")


def decay_factor(shape: str, fraction: float, *, warmup: float = 0.0, final: float = 0.0) -> float:
    """Multiplier of the peak value at ``fraction`` of the window (see the module docstring).

    Args:
        shape: ``constant`` | ``linear`` | ``cosine``.
        fraction: share of the training window used; values outside [0, 1] are clipped.
        warmup: warmup share of the window, in [0, 1).
        final: the decayed multiplier at fraction 1 (``linear`` / ``cosine``), in [0, 1].

    Returns:
        A float in [0, 1].

    Raises:
        ValueError: unknown ``shape``; ``warmup`` outside [0, 1); ``final`` outside [0, 1].
    """
    if shape not in SHAPES:
        raise ValueError(f"schedule shape must be one of {SHAPES}, got {shape!r}")
    if not 0.0 <= warmup < 1.0:
        raise ValueError(f"warmup must be a share of the window in [0, 1), got {warmup}")
    if not 0.0 <= final <= 1.0:
        raise ValueError(f"final must be in [0, 1], got {final}")
    f = min(1.0, max(0.0, float(fraction)))
    if warmup > 0 and f < warmup:
        return f / warmup
    if shape == "constant":
        return 1.0
    p = (f - warmup) / (1.0 - warmup)
    decayed = 1.0 - p if shape == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))
    return final + (1.0 - final) * decayed


def time_lambda_lr(optimizer, fraction: Callable[[], float], shape: str, *, warmup: float = 0.0,
                   final: float = 0.0):
    """A ``torch.optim.lr_scheduler.LambdaLR`` whose factor is ``decay_factor(shape, fraction(), ...)``.

    The step argument LambdaLR passes is ignored: each ``scheduler.step()`` reads the clock. The
    factor is a plain function, so ``state_dict()`` stores no schedule state (LambdaLR saves only
    callable *objects*); after ``load_state_dict`` the next step's factor is again read from the clock.

    Args:
        optimizer: the optimizer whose param groups' ``initial_lr`` (the peak) is scaled.
        fraction: returns the share of the training window used, in [0, 1].
        shape, warmup, final: as ``decay_factor`` (checked here, once).
    """
    from torch.optim.lr_scheduler import LambdaLR

    decay_factor(shape, 0.0, warmup=warmup, final=final)  # validate now, not at the first step

    def factor(_step: int) -> float:
        return decay_factor(shape, fraction(), warmup=warmup, final=final)

    return LambdaLR(optimizer, factor)


def adam_update_sumsq(optimizer) -> tuple[float, int]:
    """Sum of squares and count of Adam's last step per parameter element, in units of the learning rate.

    For every parameter that had a gradient in the step just taken, the element's step without weight decay
    is ``lr * u`` with ``u = m_hat / (sqrt(v_hat) + eps)``, ``m_hat = exp_avg / (1 - beta1^t)``, ``v_hat =
    exp_avg_sq / (1 - beta2^t)`` (Loshchilov & Hutter 2019, Algorithm 2; torch's ``AdamW``; ``max_exp_avg_sq``
    under ``amsgrad``). Returns ``(sum of u^2, number of elements)`` over this process's parameters (its shards
    under FSDP), so sums reduced across processes give the RMS of ``u`` (the ``optim/update_rms`` metric):
    ~1 where every gradient points the same way step after step, below 1 for noisy ones, and above 1 where
    the second moments still hold gradients smaller than today's (a run whose gradient scale jumped).

    Call it after ``optimizer.step()`` and before ``zero_grad``. ``(0.0, 0)`` for an optimizer without Adam
    moments (SGD, DeepSpeed's own state) or before the first step.
    """
    import torch

    opt = getattr(optimizer, "optimizer", optimizer)  # the torch optimizer inside accelerate's wrapper
    parts, count = [], 0
    with torch.no_grad():
        for group in getattr(opt, "param_groups", ()):
            betas, eps = group.get("betas"), group.get("eps")
            if betas is None or eps is None:
                continue
            for p in group["params"]:
                st = opt.state.get(p) if p.grad is not None else None
                if not st or "exp_avg" not in st:
                    continue
                t = float(st["step"])
                v = st["max_exp_avg_sq"] if group.get("amsgrad") else st["exp_avg_sq"]
                m, v = (getattr(x, "_local_tensor", x) for x in (st["exp_avg"], v))  # DTensor: the local shard
                # two temporaries of the parameter's size (the 152k-row embedding: ~2 GB in fp32), in place after
                u = m.float().div(1 - betas[0] ** t)
                u.div_(v.float().div(1 - betas[1] ** t).sqrt_().add_(eps))
                parts.append(u.square_().sum())  # one host sync at the end, not one per parameter
                count += u.numel()
    return (float(torch.stack([x.to(parts[0].device) for x in parts]).sum()) if parts else 0.0), count
