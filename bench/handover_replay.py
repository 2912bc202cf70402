"""How far did Adam's carried moments inflate the steps after an SFT -> on-policy hand-over? A replay estimate.

A run's ``metrics/train.jsonl`` logs each step's pre-clip gradient norm, not its direction. This script replays
the logged norms (clipped at ``--max_grad_norm``) through torch's ``AdamW`` on a synthetic parameter vector whose
gradient at step t is ``c_t * (alpha * d + sqrt(1 - alpha^2) * z_t)``: ``c_t`` the logged clipped norm, ``d`` a
fixed unit direction (one for the SFT steps, another for the on-policy steps: the two objectives pull different
ways), ``z_t`` fresh isotropic noise of unit norm. ``alpha`` sets how consistent the gradient is from step to
step (0: pure noise; real gradients lie in between). Three optimizers see the same on-policy gradients:
- **carried**: the run as it was, Adam's moments built over the SFT steps (``sft_handover_reset`` 0);
- **fresh**: moments cleared at the hand-over, full rate at once;
- **fresh + re-warm N**: cleared, rate ramped over N steps (``sft_handover_reset`` N).
It prints the mean step length over the on-policy steps, in units of the learning rate, and the ratios. The
ratio carried / fresh is the factor by which the carried moments scaled the on-policy steps against an optimizer
that had only ever seen on-policy gradients. Runs from the hand-over on: this is a model of the optimizer, not a
measurement of the run; ``optim/update_rms`` (logged by ``OPDTrainer`` since 2026-12-03) measures the real one.

usage:  python bench/handover_replay.py --metrics RUN/arms/j/metrics/train.jsonl [--alphas 0,0.3,0.7] [--rewarm 10]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch


def replay(norms: list[float], handover: int, alpha: float, *, start: int = 0, rewarm: int = 0, dims: int = 20000,
           seed: int = 0) -> list[float]:
    """Step lengths ``||delta theta|| / lr`` (one per entry of ``norms``) of AdamW (betas 0.9/0.999, eps 1e-8, no
    weight decay) fed the gradients described in the module docstring. ``start``: the step index of ``norms[0]``
    (a fresh optimizer starts at the hand-over); ``rewarm``: ramp the rate as ``min(1, (k + 1) / rewarm)`` over the
    k-th step after the hand-over."""
    g = torch.Generator().manual_seed(seed)
    d_sft, d_on = (v / v.norm() for v in (torch.randn(dims, generator=g), torch.randn(dims, generator=g)))
    p = torch.nn.Parameter(torch.zeros(dims))
    opt = torch.optim.AdamW([p], lr=1.0, weight_decay=0.0)
    out = []
    for k, c in enumerate(norms):
        t = start + k
        z = torch.randn(dims, generator=g)
        p.grad = c * (alpha * (d_sft if t < handover else d_on) + math.sqrt(1 - alpha ** 2) * z / z.norm())
        opt.param_groups[0]["lr"] = min(1.0, (t - handover + 1) / rewarm) if rewarm and t >= handover else 1.0
        before = p.detach().clone()
        opt.step()
        out.append(float((before - p.detach()).norm()))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--metrics", required=True, help="a run's metrics/train.jsonl (sft/off_policy_step and grad_norm)")
    ap.add_argument("--alphas", default="0,0.3,0.7", help="gradient consistency values to replay (comma-separated)")
    ap.add_argument("--rewarm", type=int, default=10, help="the re-warm-up steps of the reset optimizer")
    ap.add_argument("--max_grad_norm", type=float, default=1.0)
    ap.add_argument("--dims", type=int, default=20000)
    a = ap.parse_args(argv)
    rows = [json.loads(x) for x in Path(a.metrics).read_text().splitlines() if x.strip()]
    flags = [r.get("sft/off_policy_step") for r in rows]
    if 0.0 not in flags or 1.0 not in flags:
        raise SystemExit(f"{a.metrics}: no hand-over (needs SFT steps, sft/off_policy_step 1, then on-policy ones)")
    ho = flags.index(0.0)
    norms = [min(float(r["grad_norm"]), a.max_grad_norm) for r in rows]
    print(f"{a.metrics}: {ho} SFT steps, then {len(rows) - ho} on-policy; pre-clip grad norm, last 50 SFT steps median "
          f"{statistics.median(r['grad_norm'] for r in rows[max(0, ho - 50):ho]):.3f}, on-policy median "
          f"{statistics.median(r['grad_norm'] for r in rows[ho:]):.3f}")
    print("| alpha | late SFT step | carried | fresh | fresh + re-warm | carried / fresh (steps 1-5, 6-end, all) "
          "| carried / fresh + re-warm |")
    print("|---|---|---|---|---|---|---|")
    for alpha in (float(x) for x in a.alphas.split(",")):
        full = replay(norms, ho, alpha, dims=a.dims)
        car = full[ho:]
        fr = replay(norms[ho:], ho, alpha, start=ho, dims=a.dims, seed=1)
        frw = replay(norms[ho:], ho, alpha, start=ho, rewarm=a.rewarm, dims=a.dims, seed=1)
        m = statistics.mean
        print(f"| {alpha:g} | {m(full[max(0, ho - 50):ho]):.3f} | {m(car):.3f} | {m(fr):.3f} | {m(frw):.3f} | "
              f"{m(car[:5]) / m(fr[:5]):.2f}, {m(car[5:]) / m(fr[5:]):.2f}, {m(car) / m(fr):.2f} | "
              f"{m(car) / m(frw):.2f} |")
    print("step lengths: ||delta theta|| / lr, mean over the steps; multiply by each phase's rate for weight units")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
