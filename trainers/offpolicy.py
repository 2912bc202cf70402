"""OPDTrainer's off-policy signal: cross-entropy on stage one's verified teacher solutions, mixed over the clock.

Stage one (``stages.curate``) writes the shortest verified teacher solution of each kept problem to the
curriculum's ``teacher_solution`` column; ``build_train_dataset`` carries it to stage two. It enters the
objective two ways (run 2 of bench/LEARNING.md):

- ``w_sft``: in an on-policy step, the cross-entropy of the teacher's solution of each prompt in the
  batch (once per prompt, not per sample), sum over its tokens / the global count of such tokens:
  loss = on-policy terms + w_sft * CE. Rows without a verified solution add nothing.
- off-policy steps: a share s(f) of the *training time* goes to steps that are cross-entropy only
  (TRL ``SFTTrainer``'s completion-only loss on ``sft_batch_size`` teacher solutions; no generation, no
  teacher forward), so the cheap signal gets the clock early and the on-policy one late. s(f) runs
  linearly from ``sft_share_start`` to ``sft_share_end`` over ``OPDTrainer.time_fraction()`` f; the step
  type is chosen by error diffusion on measured step seconds (``TimeShare``), so the share holds even
  though an off-policy step is ~10x cheaper than an on-policy one.

``OffPolicySchedule`` keeps this state (step kinds, the solution stream, the hand-over, the rate scale, the resume
state); the trainer owns one and passes it what it needs, and computes the loss itself (``OPDTrainer._sft_loss``).

GKD (Agarwal et al. 2024, arXiv:2306.13649) mixes teacher-written and student-written sequences by a
per-step coin with probability lambda; here the mix is over seconds rather than steps because the
arms of bench/learning.py are compared at equal training seconds.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import torch

from data_tools.prompts import prompt_ids
from trainers.trl_compat import pad

log = logging.getLogger(__name__)

# OPDConfig fields that decide each step's kind (off-policy or on-policy) and its loss; a resume compares them
OBJECTIVE_SETTINGS = ("w_kl", "w_reward", "w_sft", "sft_share_start", "sft_share_end", "sft_max_epochs",
                      "sft_learning_rate", "sft_batch_size")


def sft_share(fraction: float, start: float, end: float) -> float:
    """Share of training time given to off-policy steps at time fraction ``fraction`` (clamped to [0, 1]).

    Linear from ``start`` (f = 0) to ``end`` (f = 1); both in [0, 1].
    """
    f = min(1.0, max(0.0, float(fraction)))
    return start + (end - start) * f


class TimeShare:
    """Chooses each optimizer step's kind so that off-policy steps take a share ``s`` of the measured seconds.

    Error diffusion: ``credit`` accumulates ``(s - [step was off-policy]) * seconds`` after every step;
    the next step is off-policy while the credit is >= 0 and ``s > 0``. With a constant s the
    off-policy share of seconds stays within one step's duration of s; s = 1 gives only off-policy
    steps, s = 0 none.
    """

    def __init__(self) -> None:
        self.credit = 0.0

    def choose(self, share: float) -> bool:
        return share >= 1.0 or (share > 0.0 and self.credit >= 0.0)

    def record(self, share: float, off_policy: bool, seconds: float) -> None:
        self.credit += (share - (1.0 if off_policy else 0.0)) * max(seconds, 0.0)


def solution_batch(tokenizer, prompts: list[str], solutions: list[str | None], *, device) -> dict[str, torch.Tensor]:
    """Tokenise (prompt, teacher solution) pairs in the trainer's layout: left-padded prompts, right-padded completions.

    The prompt (chat-rendered text) is tokenised as the on-policy rollouts' prompts are
    (``data_tools.prompts.prompt_ids``: no special tokens added again, so a template that writes BOS, as
    DeepSeek-R1-Distill-Qwen's does, gives one BOS, not two); the solution without special tokens and
    followed by EOS (the end of an assistant turn, as in the student's own
    rollouts; TRL ``SFTTrainer`` appends EOS the same way). A row whose solution is None or empty
    gets an all-zero completion mask: it contributes no token.

    Returns:
        ``sft_prompt_ids``/``sft_prompt_mask`` ``(n, P)``, ``sft_completion_ids``/``sft_completion_mask``
        ``(n, K)``, int64, on ``device``.
    """
    eos = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    p_ids = [torch.tensor(x) for x in prompt_ids(tokenizer, list(prompts))]
    c_ids, c_mask = [], []
    for s in solutions:
        ids = tokenizer(s, add_special_tokens=False)["input_ids"] + [eos] if s else [pad_id]
        c_ids.append(torch.tensor(ids))
        c_mask.append(torch.full((len(ids),), 1 if s else 0))
    return {
        "sft_prompt_ids": pad(p_ids, padding_value=pad_id, padding_side="left").to(device),
        "sft_prompt_mask": pad([torch.ones_like(t) for t in p_ids], padding_value=0, padding_side="left").to(device),
        "sft_completion_ids": pad(c_ids, padding_value=pad_id, padding_side="right").to(device),
        "sft_completion_mask": pad(c_mask, padding_value=0, padding_side="right").to(device),
    }


class OffPolicySchedule:
    """The off-policy signal's state across optimizer steps, kept apart from the trainer: which kind each step is,
    which teacher solutions an off-policy step trains on, the rate scale of each step, and what a checkpoint keeps.

    ``OPDTrainer`` owns one (``trainer.offpolicy``) and is its only caller; everything it needs comes in as
    parameters. The trainer does the rest: the forward and the cross-entropy (``OPDTrainer._sft_loss``), the
    tokenised batches (``solution_batch``), the processes' agreement and the metrics.

    Args:
        args: ``OPDConfig``; read: w_kl, w_reward, w_sft, sft_share_start, sft_share_end, sft_batch_size,
            sft_max_epochs, sft_learning_rate, sft_handover_reset, learning_rate, gradient_accumulation_steps, seed.
        solutions: the train dataset's ``teacher_solution`` column (None: the dataset has no such column).
        world_size: the number of training processes.

    Raises:
        ValueError: the off-policy terms are on but there is no solution to train on, or ``sft_batch_size`` is not a
            multiple of world size x gradient_accumulation_steps.
    """

    def __init__(self, args, solutions: list[str | None] | None, world_size: int) -> None:
        self.args = args
        self.time_share = TimeShare()
        self.off_policy = False  # the current step's kind, as every process agreed (``choose``)
        self.share = 0.0  # the off-policy share in force this step
        self.pool: list[int] = []  # dataset rows with a verified solution
        self.pos = 0  # solutions taken so far (over every process), across epochs of the pool
        # global_step when the hand-over was decided: the last off-policy step (the first on-policy step is the next)
        self.handover_step: int | None = None
        self.handover_now = False  # ``choose`` decided the hand-over this step
        self.lr_applied = 1.0  # the rate scale the step hook applied this step (sft/lr_scale)
        self._epoch: tuple[int, list[int]] = (-1, [])
        a = args
        if not a.trains_on_teacher_solutions:
            return
        if solutions is None:  # build_train_dataset always adds the column
            raise ValueError("w_sft / sft_share_* train on stage one's verified teacher solutions, but the train "
                             "dataset has no 'teacher_solution' column (build it with build_train_dataset)")
        self.pool = [i for i, s in enumerate(solutions) if s]
        # "sft_max_epochs passes, then on-policy" over no solution is an empty first phase (warned below); every
        # other use of the solutions (a share for the whole clock, the w_sft term) has nothing to train on
        if not self.pool and a.needs_teacher_solutions:
            raise ValueError("w_sft / sft_share_* train on stage one's verified teacher solutions, but the curriculum's "
                             f"'teacher_solution' column is empty in all {len(solutions)} rows of {a.curriculum_path} (no teacher "
                             "sample verified: stage one's teacher solved none of the problems it measured "
                             "(curate/manifest.json, counts.teacher_solutions) or had teacher_samples 0; or turn "
                             "the off-policy terms off: "
                             "--w_sft 0 --sft_share_start 0 --sft_share_end 0 --sft_learning_rate 0 --sft_max_epochs 0)")
        unit = world_size * a.gradient_accumulation_steps
        if a.sft_batch_size % unit:
            lo, hi = max(unit, a.sft_batch_size // unit * unit), (a.sft_batch_size // unit + 1) * unit
            raise ValueError(f"sft_batch_size ({a.sft_batch_size}) must be a multiple of world size x "
                             f"gradient_accumulation_steps ({world_size} x {a.gradient_accumulation_steps} = {unit}): "
                             f"e.g. {lo} or {hi}")
        if a.sft_max_epochs and a.sft_batch_size > a.sft_max_epochs * len(self.pool):
            # printed, not only logged: a recipe whose first phase is SFT runs without it (e.g. a stage one under
            # filter none whose teacher verified nothing), which the run's console must say
            if int(os.environ.get("RANK", "0")) == 0:  # once, from the first process
                print(f"[train] sft_max_epochs={a.sft_max_epochs:g} over {len(self.pool)} verified teacher solutions (of "
                      f"{len(solutions)} rows in {a.curriculum_path}) is less than one batch of {a.sft_batch_size}: no "
                      "off-policy step will run, every step is on-policy", flush=True)

    def choose(self, fraction: float, step: int, agree: Callable[[bool], bool] | None = None) -> bool:
        """The kind of the optimizer step after ``step`` at time fraction ``fraction``: off-policy (teacher solutions
        only) by ``TimeShare``, or on-policy; on-policy whenever one more batch would take the solution stream past
        ``sft_max_epochs`` passes (the first such step sets ``handover_step`` and ``handover_now``). ``agree``: the
        processes' vote (True if any process chose off-policy); None for one process. Kept as ``off_policy``."""
        a = self.args
        self.share = sft_share(fraction, a.sft_share_start, a.sft_share_end)
        self.handover_now = False
        if self.phase_done():
            self.share = 0.0  # recorded as the share in force: TimeShare then counts these seconds as on-policy
            if self.handover_step is None:  # the hand-over (a resume past it restores the step, and no reset)
                self.handover_step, self.handover_now = int(step), True
        off = self.time_share.choose(self.share)
        self.off_policy = agree(off) if agree is not None else off
        return self.off_policy

    def phase_done(self) -> bool:
        """True once the solution stream has no batch left under ``sft_max_epochs`` passes, so every later step
        is on-policy; always False without a cap (``sft_max_epochs = 0``)."""
        a = self.args
        return bool(a.sft_max_epochs) and self.pos + a.sft_batch_size > a.sft_max_epochs * len(self.pool)

    def next_rows(self, process_index: int, num_processes: int) -> list[int]:
        """The dataset rows of this process's share of the next ``sft_batch_size`` solutions (each epoch of the pool
        in an order seeded by ``seed`` + epoch); advances the stream by the whole batch."""
        n, pool = self.args.sft_batch_size, self.pool
        idx = []
        for j in range(self.pos, self.pos + n):
            epoch = j // len(pool)
            if self._epoch[0] != epoch:
                g = torch.Generator().manual_seed(self.args.seed + epoch)
                self._epoch = (epoch, torch.randperm(len(pool), generator=g).tolist())
            idx.append(pool[self._epoch[1][j % len(pool)]])
        self.pos += n
        return idx[process_index::num_processes]

    def rate_scale(self, step: int) -> float:
        """The factor the step hook applies to the scheduled rate of the optimizer step after ``step``:
        ``sft_learning_rate / learning_rate`` on an off-policy step; ``min(1, (k + 1) / sft_handover_reset)`` on the
        k-th on-policy step after a reset hand-over (k = 0 first); else 1."""
        a = self.args
        if self.off_policy:
            return a.sft_learning_rate / a.learning_rate if a.sft_learning_rate else 1.0
        if a.sft_handover_reset and self.handover_step is not None:
            return min(1.0, (step - self.handover_step + 1) / a.sft_handover_reset)
        return 1.0

    def install_rate_hooks(self, optimizer, step: Callable[[], int]) -> None:
        """``sft_learning_rate > 0`` or ``sft_handover_reset > 0``: torch optimizer step hooks scale every group's
        rate by ``rate_scale(step())`` (``step``: the trainer's global step) and restore it after, so the schedule
        (warm-up, decay over the clock) applies to both kinds of step and checkpoints hold the plain rate."""
        a = self.args
        optimizer = getattr(optimizer, "optimizer", optimizer)  # the torch optimizer inside accelerate's wrapper
        if ((not a.sft_learning_rate or a.sft_learning_rate == a.learning_rate) and not a.sft_handover_reset
                or getattr(optimizer, "_opd_sft_lr_hooks", False)):  # once per optimizer: twice would compound
            return
        optimizer._opd_sft_lr_hooks = True

        def pre(opt, args, kwargs):
            scale = self.rate_scale(step())
            if scale != 1.0:
                for g in opt.param_groups:
                    g["opd_scheduled_lr"] = g["lr"]
                    g["lr"] = g["lr"] * scale
                self.lr_applied = scale  # set only when the hook fires: sft/lr_scale shows it was applied

        def post(opt, args, kwargs):
            for g in opt.param_groups:
                if "opd_scheduled_lr" in g:
                    g["lr"] = g.pop("opd_scheduled_lr")

        optimizer.register_step_pre_hook(pre)
        optimizer.register_step_post_hook(post)

    def objective(self) -> dict[str, float]:
        """The settings that decide each step's kind and loss, saved so that a resume can say when they changed."""
        return {k: float(getattr(self.args, k)) for k in OBJECTIVE_SETTINGS}

    def state_dict(self) -> dict:
        """What a resumed run needs to continue the mix where it stopped (saved beside the clock's fraction):
        the position in the solution stream (its epochs, hence ``sft_max_epochs``), the time-share credit, the
        hand-over step and the objective's settings."""
        return {"sft_pos": self.pos, "sft_credit": self.time_share.credit, "handover_step": self.handover_step,
                "objective": self.objective()}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()`` (a checkpoint written before it existed restarts the stream at 0). A resume
        under other objective settings than the save's goes on under the new ones, with a warning naming them (a
        run begun on-policy and resumed under a config with SFT first runs SFT steps from here)."""
        saved = state.get("objective")
        if saved is not None:
            now = self.objective()
            changed = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
            if changed:
                log.warning("resuming under other objective settings than the checkpoint's (saved -> now): %s",
                            ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items()))
        elif self.args.trains_on_teacher_solutions:  # saved by a trainer that did not record them yet
            log.warning("resuming from a checkpoint that does not record its objective settings: this run's "
                        "off-policy settings (%s) apply from here, whatever the checkpoint's steps were",
                        ", ".join(f"{k} {v:g}" for k, v in self.objective().items() if k.startswith(("w_sft", "sft_"))))
        self.pos = int(state.get("sft_pos", 0))
        self.time_share.credit = float(state.get("sft_credit", 0.0))
        h = state.get("handover_step")
        # a hand-over the new settings undo (more passes than the save's) happens again, at its new step
        self.handover_step = None if h is None or not self.phase_done() else int(h)

    def finish_step(self, seconds: float, loss_sum: float, tokens: float) -> dict[str, float]:
        """The step's metrics of the off-policy signal (empty when no off-policy term is on), given its seconds and
        its cross-entropy sum and solution-token count over every process; feeds the seconds to ``TimeShare``."""
        a = self.args
        if not a.trains_on_teacher_solutions:
            return {}
        self.time_share.record(self.share, self.off_policy, seconds)
        out = {"loss/sft": loss_sum,  # mean CE per solution token (the term before its weight)
               "sft/tokens": tokens, "sft/share": self.share, "sft/off_policy_step": float(self.off_policy),
               "sft/epoch": self.pos / max(1, len(self.pool)),  # passes over the pool (0 when it is empty)
               "sft/weight": 1.0 if self.off_policy else a.w_sft,
               "sft/lr_scale": self.lr_applied}  # set by the rate hook of this step, if any
        self.lr_applied = 1.0
        return out


def clear_optimizer_moments(optimizer) -> None:
    """Forget every parameter's optimizer state (Adam's step count and moments), so the next steps' statistics
    start fresh, with bias correction, as in a new run (``sft_handover_reset``). Raises RuntimeError for an
    optimizer that is not a torch one (DeepSpeed keeps its state elsewhere)."""
    opt = getattr(optimizer, "optimizer", optimizer)  # the torch optimizer inside accelerate's wrapper
    if not isinstance(opt, torch.optim.Optimizer):
        raise RuntimeError(f"sft_handover_reset needs a torch optimizer, got {type(opt).__name__}: set it to 0")
    opt.state.clear()
