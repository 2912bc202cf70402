"""One optimizer step's bookkeeping for ``OPDTrainer``: the sums its micro-batches add, the seconds of its phases,
its memory, the non-finite guard, and at its end the step's metrics (reduced across processes).

The trainer adds to ``acc`` (summed across processes), ``acc_max`` (maxima: rollout IS statistics) and ``timers``
(seconds of generation, reward, teacher) during a step; ``StepHooks`` routes transformers' step events here:
``begin`` at the step's start, ``guard_nonfinite`` before the optimizer step, ``finish`` at its end.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict

import torch
from transformers import TrainerCallback

from trainers.model_utils import StepMemory

log = logging.getLogger(__name__)

#: The step's sums, in the order they are reduced.
SUM_KEYS = ("loss_kl", "loss_reward", "k1_sum", "tokens", "clipped", "ratio_sum", "kl_full_sum", "k1_clamped",
            "is_tokens", "is_diff_sum", "is_w_sum", "is_capped", "upd_sumsq", "upd_count", "sft_loss", "sft_tokens")
MAX_KEYS = ("is_diff_max", "is_w_max", "is_w_neg_min")


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


class StepLog:
    """The running step's sums, timers, memory and non-finite state (see the module docstring)."""

    def __init__(self, accelerator, max_consecutive_nonfinite: int, memory: StepMemory | None = None):
        self.accelerator = accelerator
        self.max_consecutive_nonfinite = max_consecutive_nonfinite
        self.acc: dict[str, float] = defaultdict(float)
        self.acc_max: dict[str, float] = {}
        self.timers: dict[str, float] = defaultdict(float)
        self.memory = memory or StepMemory()
        self.t0 = time.perf_counter()
        self.gen_tokens = 0  # tokens the step generated (or, an SFT step, trained on): throughput/tokens_per_s
        self.bad_loss = False  # a micro-batch's loss was non-finite (set by the trainer's training_step)
        self.skipped = 0
        self.streak = 0

    def begin(self) -> None:
        self.memory.begin()
        self.t0 = time.perf_counter()

    def guard_nonfinite(self, model, step: int, metrics) -> None:
        """Before ``optimizer.step``: drop the update if the loss or any gradient was NaN/inf.

        Gradients set to None make AdamW skip those parameters, so the weights and optimizer moments stay as they
        were. After ``max_consecutive_nonfinite`` such steps in a row: ``NonFiniteError``. ``step``: the step being
        taken (1-based), for the messages.
        """
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        finite = bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()) if grads else True
        bad = self.bad_loss or not finite
        self.bad_loss = False
        metrics["nonfinite/skipped"].append(float(bad))
        if not bad:
            self.streak = 0
            return
        for p in model.parameters():
            p.grad = None
        self.skipped += 1
        self.streak += 1
        log.warning("non-finite %s at step %d: update skipped (%d in a row, limit %d)",
                    "loss" if not finite else "gradient", step, self.streak, self.max_consecutive_nonfinite)
        if self.streak >= self.max_consecutive_nonfinite:
            raise NonFiniteError(f"{self.streak} optimizer steps in a row had a non-finite loss or gradient (last at "
                                 f"step {step}); stopping. Lower the learning rate, check the data, or set "
                                 "teacher_logprob_min.")

    def finish(self, metrics, *, off_policy: bool, kl_mode: str, rollout_is: bool) -> tuple[dict[str, float], float]:
        """At the step's end: reduce the sums across processes into ``metrics`` (TRL's ``_metrics["train"]``) and
        clear them; returns the reduced sums and the step's seconds.

        An off-policy SFT step samples nothing: its on-policy terms are not 0 but absent (NaN, which TRL's log turns
        into null), so queries and plots do not read a KL of 0 for the SFT phase."""
        vec = torch.tensor([self.acc.get(k, 0.0) for k in SUM_KEYS], dtype=torch.float64,
                           device=self.accelerator.device)
        tot = dict(zip(SUM_KEYS, self.accelerator.reduce(vec, reduction="sum").tolist()))
        self.acc.clear()
        m = metrics
        n = max(tot["tokens"], 1.0)
        # TRL divides num_items_in_batch by the process count (DDP averages gradients), so each process's
        # terms are P times its share of the global loss: the sum over processes is P x the loss.
        world = self.accelerator.num_processes
        put = lambda key, value: m[key].append(float("nan") if off_policy else value)  # noqa: E731
        put("loss/kl", tot["loss_kl"] / world)
        put("loss/reward", tot["loss_reward"] / world)
        put("kl/sampled_mean", tot["k1_sum"] / n)
        if kl_mode == "full":
            put("kl/full_mean", tot["kl_full_sum"] / n)
        else:
            put("ppo/clip_frac", tot["clipped"] / n)
            put("ppo/ratio_mean", tot["ratio_sum"] / n)
            put("kl/clamped_frac", tot["k1_clamped"] / n)
        if tot["upd_count"] > 0:  # RMS of Adam's per-element step over the learning rate (0 on a skipped step)
            m["optim/update_rms"].append(math.sqrt(tot["upd_sumsq"] / tot["upd_count"]))
        if rollout_is:
            self._rollout_is_metrics(m, tot)
        step_s = time.perf_counter() - self.t0
        gen, rew, teach = (self.timers.get(k, 0.0) for k in ("time/generation", "time/reward", "time/teacher"))
        self.timers.clear()
        m["time/step"].append(step_s)
        m["time/generation"].append(gen)
        m["time/reward"].append(rew)
        m["time/teacher"].append(teach)
        m["time/update"].append(max(step_s - gen - rew - teach, 0.0))
        m["throughput/tokens_per_s"].append(self.gen_tokens / step_s if step_s > 0 else 0.0)
        self.gen_tokens = 0  # a later mini-batch of the same rollout batch (steps_per_generation) generated nothing
        for k, v in self.memory.end().items():
            m[k].append(v)
        m["nonfinite/total_skipped"].append(float(self.skipped))
        return tot, step_s

    def add_rollout_is(self, old: torch.Tensor, samp: torch.Tensor, w: torch.Tensor, cap: float) -> None:
        """A micro-batch's rollout-vs-trainer mismatch, for the step's ``sampling/*`` metrics: ``old`` the trainer's
        log-probs of the valid tokens, ``samp`` the rollout engine's (NaN: not known), ``w`` their IS weights,
        truncated at ``cap``."""
        known = ~torch.isnan(samp)
        diff = (old.float() - samp.float()).abs()[known]
        acc, mx = self.acc, self.acc_max
        acc["is_tokens"] += float(known.sum())
        acc["is_diff_sum"] += float(diff.sum())
        acc["is_w_sum"] += float(w[known].sum())
        acc["is_capped"] += float((w[known] >= cap).sum())
        if diff.numel():
            mx["is_diff_max"] = max(mx.get("is_diff_max", 0.0), float(diff.max()))
            mx["is_w_max"] = max(mx.get("is_w_max", 0.0), float(w[known].max()))
            mx["is_w_neg_min"] = max(mx.get("is_w_neg_min", -math.inf), -float(w[known].min()))

    def _rollout_is_metrics(self, m, tot: dict[str, float]) -> None:
        """Rollout-vs-trainer mismatch of this step (TRL GRPO's ``sampling/*`` names, plus the capped share)."""
        vec = torch.tensor([self.acc_max.get(k, -math.inf) for k in MAX_KEYS], dtype=torch.float64,
                           device=self.accelerator.device)
        mx = dict(zip(MAX_KEYS, self.accelerator.reduce(vec, reduction="max").tolist()))
        self.acc_max.clear()
        k = tot["is_tokens"]
        if k == 0:
            return
        m["sampling/sampling_logp_difference/mean"].append(tot["is_diff_sum"] / k)
        m["sampling/sampling_logp_difference/max"].append(mx["is_diff_max"])
        m["sampling/importance_sampling_ratio/mean"].append(tot["is_w_sum"] / k)
        m["sampling/importance_sampling_ratio/min"].append(-mx["is_w_neg_min"])
        m["sampling/importance_sampling_ratio/max"].append(mx["is_w_max"])
        m["sampling/importance_sampling_ratio/capped_frac"].append(tot["is_capped"] / k)


class StepHooks(TrainerCallback):
    """Routes transformers' step events to the trainer's ``StepLog`` (``trainer.steps``) and its step end."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_begin(self, args, state, control, **kwargs):
        self.trainer.steps.begin()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        tr = self.trainer
        tr.steps.guard_nonfinite(tr.model, state.global_step + 1, tr._metrics["train"])

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._finish_step()


__all__ = ["StepLog", "StepHooks", "NonFiniteError", "SUM_KEYS"]
