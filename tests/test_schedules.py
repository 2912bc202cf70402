"""Clock-based learning-rate schedules: factors against transformers' step schedules, resume from the clock."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.test_trainer import curriculum_path, make_trainer, tokenizer  # noqa: F401 - pytest fixtures
from trainers.schedules import adam_update_sumsq, decay_factor, time_lambda_lr


def _hf_factors(name: str, T: int, warmup: int) -> list[float]:
    """transformers' step schedule factors at steps 0..T (the reference the time schedules follow)."""
    from transformers import get_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=T)
    out = []
    for _ in range(T + 1):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("shape,hf", [("linear", "linear"), ("cosine", "cosine"), ("constant", "constant_with_warmup")])
@pytest.mark.parametrize("warmup_steps", [0, 10])
def test_factor_matches_transformers_at_step_fraction(shape, hf, warmup_steps):
    T = 100
    ref = _hf_factors(hf, T, warmup_steps)
    got = [decay_factor(shape, s / T, warmup=warmup_steps / T) for s in range(T + 1)]
    assert got == pytest.approx(ref, abs=1e-12)
    assert got[0] == (0.0 if warmup_steps else 1.0)


def test_final_ratio_and_clipping_plain_formula():
    w, r = 0.1, 0.2
    for f in (0.0, 0.05, 0.1, 0.37, 0.8, 1.0):
        p = max(0.0, (f - w) / (1 - w))
        lin = f / w if f < w else r + (1 - r) * (1 - p)
        cos = f / w if f < w else r + (1 - r) * 0.5 * (1 + math.cos(math.pi * p))
        assert decay_factor("linear", f, warmup=w, final=r) == pytest.approx(lin)
        assert decay_factor("cosine", f, warmup=w, final=r) == pytest.approx(cos)
    assert decay_factor("linear", 1.7, final=r) == pytest.approx(r)  # past the horizon: the floor
    assert decay_factor("linear", -0.3) == 1.0
    for bad in (dict(shape="step"), dict(warmup=1.0), dict(final=1.5)):
        kw = dict(shape="linear", fraction=0.5) | bad
        with pytest.raises(ValueError):
            decay_factor(kw.pop("shape"), kw.pop("fraction"), **kw)


def test_lambda_lr_reads_the_clock_and_resumes_from_it():
    clock = {"f": 0.0}
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=1e-3)
    sched = time_lambda_lr(opt, lambda: clock["f"], "linear", warmup=0.1)
    assert opt.param_groups[0]["lr"] == 0.0  # warmup starts from 0
    for f in (0.05, 0.3, 0.55):
        clock["f"] = f
        opt.step()
        sched.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * decay_factor("linear", f, warmup=0.1))
    state, opt_state = sched.state_dict(), opt.state_dict()
    assert "f" not in str(state["lr_lambdas"])  # no schedule state saved beyond the peak

    # a resumed process: same peak, the clock now at 0.8 -> continues from 0.8, not from 0 or 0.55
    clock["f"] = 0.8
    p2 = torch.nn.Parameter(torch.zeros(2))
    opt2 = torch.optim.AdamW([p2], lr=1e-3)
    sched2 = time_lambda_lr(opt2, lambda: clock["f"], "linear", warmup=0.1)
    opt2.load_state_dict(opt_state)
    sched2.load_state_dict(state)
    opt2.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(1e-3 * (1 - (0.8 - 0.1) / 0.9))


def test_trainer_time_schedule_and_resume(tmp_path, tokenizer, curriculum_path):  # noqa: F811
    """OPDTrainer with linear_time: each step's LR is peak x factor(time_fraction) at the previous step's end
    (LambdaLR steps after the optimizer); a resumed run continues from the fraction f0 it saved,
    f = f0 + (1 - f0) x the new window's share, not from 0 (peak / warmup again)."""
    from transformers import TrainerCallback

    from trainers.opd_trainer import CLOCK_STATE

    peak, horizon = 1e-2, 1000.0

    def run(fracs, steps, resume=None):
        tr = make_trainer(tmp_path, tokenizer, curriculum_path, lr_scheduler_type="linear_time", lr_warmup_time=50,
                          learning_rate=peak, debug_max_steps=steps, max_wall_time_seconds=horizon + 10,
                          deadline_reserve_seconds=10)
        t0 = tr.deadline.start_time
        now = [t0]  # training begins at the clock's start: the window is the whole horizon
        tr.deadline.clock = lambda: now[0]
        moves = iter(fracs)

        class Clock(TrainerCallback):  # the clock moves during each step, before the scheduler reads it
            def __init__(self):
                self.lrs = []

            def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kw):
                self.lrs.append(optimizer.param_groups[0]["lr"])

            def on_optimizer_step(self, args, state, control, **kw):
                now[0] = t0 + next(moves) * horizon

        seen = Clock()
        tr.add_callback(seen)
        tr.train(resume_from_checkpoint=resume)
        return tr, seen.lrs

    lin = lambda f: peak * (f / 0.05 if f < 0.05 else 1 - (f - 0.05) / 0.95)  # noqa: E731 - the plain formula
    tr, lrs = run([0.02, 0.5], 2)
    assert lrs == pytest.approx([lin(0.0), lin(0.02)])  # 50 s of warmup = 0.05 of the window
    from trainers.callbacks import find_resume_checkpoint

    ckpt = find_resume_checkpoint(tr.args.resume_dir)
    assert ckpt.endswith("checkpoint-2")
    assert json.loads((Path(ckpt) / CLOCK_STATE).read_text())["time_fraction"] == pytest.approx(0.5)
    tr2, lrs2 = run([0.5], 3, resume=ckpt)  # a new clock: its window share starts at 0 again
    assert tr2.state.global_step == 3
    assert lrs2 == pytest.approx([lin(0.5)])  # f0 = 0.5 restored; a restart would give lin(0) = 0
    assert tr2.time_fraction() == pytest.approx(0.5 + 0.5 * 0.5)


def test_config_accepts_time_schedules_only(tmp_path):
    from tests.test_trainer import make_args

    a = make_args(tmp_path, lr_scheduler_type="cosine_time", lr_warmup_time=0.1)
    assert a.lr_scheduler_type == "cosine_time" and a.lr_warmup_fraction == 0.1
    for bad in (dict(lr_scheduler_type="linear"), dict(lr_scheduler_type="linear_time", lr_warmup_time=20_000),
                dict(lr_scheduler_type="linear_time", lr_final_ratio=2.0)):
        with pytest.raises(ValueError):
            make_args(tmp_path, **bad)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_update_sumsq_is_the_step_torch_adamw_took(amsgrad):
    """optim/update_rms against the parameters' own change: with weight decay 0, AdamW moves each element by
    lr x u, so RMS((theta_before - theta_after) / lr) is what adam_update_sumsq reports. A parameter without a
    gradient this step is left out. The hand-over's case: 300 steps of gradients 20x smaller than the next 10 leave
    second moments that make the next 10 steps several times larger than the same 10 gradients move a fresh AdamW."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(40, generator=g)), torch.nn.Parameter(torch.randn(7, generator=g))
    opt = torch.optim.AdamW([a, b], lr=0.1, weight_decay=0.0, amsgrad=amsgrad)
    assert adam_update_sumsq(opt) == (0.0, 0)  # no step yet
    late = [4.0 * torch.randn(40, generator=g) for _ in range(10)]
    for step, grad in enumerate([0.2 * torch.randn(40, generator=g) for _ in range(300)] + late):
        before = a.detach().clone()
        a.grad = grad.clone()
        b.grad = torch.randn(7, generator=g) if step == 0 else None  # b: only in the first step
        opt.step()
        sq, n = adam_update_sumsq(opt)
        assert n == (47 if step == 0 else 40)
        if step > 0:
            want = ((before - a.detach()) / 0.1).square().mean().sqrt().item()
            assert math.sqrt(sq / n) == pytest.approx(want, rel=1e-4)
    carried = math.sqrt(sq / n)
    fresh_p = torch.nn.Parameter(torch.zeros(40))
    fresh = torch.optim.AdamW([fresh_p], lr=0.1, weight_decay=0.0, amsgrad=amsgrad)
    for grad in late:
        fresh_p.grad = grad.clone()
        fresh.step()
    sq, n = adam_update_sumsq(fresh)
    assert math.sqrt(sq / n) < 1.0 and carried > 2.5 * math.sqrt(sq / n), (carried, math.sqrt(sq / n))


def test_handover_replay_steps_are_adams():
    """bench/handover_replay.py: a constant, fully consistent gradient moves a fresh AdamW by lr in every element
    (m_hat = g, v_hat = g^2), so each step's length is sqrt(dims); the re-warm-up ramps it by (k + 1) / N."""
    from bench.handover_replay import replay

    assert replay([0.5] * 4, 0, 1.0, dims=100) == pytest.approx([10.0] * 4, rel=1e-5)
    assert replay([0.5] * 4, 2, 1.0, start=2, rewarm=4, dims=100) == pytest.approx([2.5, 5.0, 7.5, 10.0], rel=1e-5)
