"""OPDTrainer's off-policy signal: cross-entropy on stage one's verified teacher solutions, mixed over the clock.

Stage one (``stages.curate``) writes the shortest verified teacher solution of each kept problem to the
curriculum's ``teacher_solution`` column; ``build_train_dataset`` carries it to stage two. It enters the
objective two ways (issue 13, run 2 of bench/LEARNING.md):

- ``w_sft``: in an on-policy step, the cross-entropy of the teacher's solution of each prompt in the
  batch (once per prompt, not per sample), sum over its tokens / the global count of such tokens:
  loss = on-policy terms + w_sft * CE. Rows without a verified solution add nothing.
- off-policy steps: a share s(f) of the *training time* goes to steps that are cross-entropy only
  (TRL ``SFTTrainer``'s completion-only loss on ``sft_batch_size`` teacher solutions; no generation, no
  teacher forward), so the cheap signal gets the clock early and the on-policy one late. s(f) runs
  linearly from ``sft_share_start`` to ``sft_share_end`` over ``OPDTrainer.time_fraction()`` f; the step
  type is chosen by error diffusion on measured step seconds (``TimeShare``), so the share holds even
  though an off-policy step is ~10x cheaper than an on-policy one.

GKD (Agarwal et al. 2024, arXiv:2306.13649) mixes teacher-written and student-written sequences by a
per-step coin with probability lambda; here the mix is over seconds rather than steps because the
arms of bench/learning.py are compared at equal training seconds.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import torch

from trainers import losses

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
    from trl.trainer.utils import pad

    eos = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    from data_tools.prompts import prompt_ids

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


class OffPolicyTerm:
    """``OPDTrainer``'s methods for the off-policy signal (a mixin: it reads the trainer's ``args``
    (``OPDConfig``: w_sft, sft_share_start/end, sft_batch_size, sft_max_epochs, sft_learning_rate, seed), ``accelerator``,
    ``train_dataset``, ``processing_class``, ``_metrics``, ``_heads``, ``_get_last_hidden_state``, ``time_fraction``).

    The trainer calls ``_init_offpolicy`` in ``__init__``, ``_choose_off_policy`` / ``_offpolicy_batch``
    where it would generate, ``_solution_rows`` when it builds an on-policy batch, ``_sft_loss`` in its
    loss, ``_finish_offpolicy`` at each step's end, ``_offpolicy_state`` when it saves a checkpoint and
    ``_load_offpolicy_state`` when it resumes from one.
    """

    def _init_offpolicy(self) -> None:
        a = self.args
        self._time_share = TimeShare()
        self._off_policy_step = False
        self._share_now = 0.0
        self._sft_pool: list[int] = []
        self._sft_pos = 0
        self._sft_lr_applied = 1.0  # the rate scale the step hook applied this step (sft/lr_scale)
        # global_step when the hand-over was decided: the last off-policy step (the first on-policy step is the next)
        self._handover_step: int | None = None
        self._sft_epoch: tuple[int, list[int]] = (-1, [])
        self._acc_sft: dict[str, float] = defaultdict(float)
        if not a.trains_on_teacher_solutions:
            return
        ds = self.train_dataset
        if ds is None or "teacher_solution" not in ds.column_names:  # build_train_dataset always adds it
            raise ValueError("w_sft / sft_share_* train on stage one's verified teacher solutions, but the train "
                             "dataset has no 'teacher_solution' column (build it with build_train_dataset)")
        self._sft_pool = [i for i, s in enumerate(ds["teacher_solution"]) if s]
        # "sft_max_epochs passes, then on-policy" over no solution is an empty first phase (warned below); every
        # other use of the solutions (a share for the whole clock, the w_sft term) has nothing to train on
        if not self._sft_pool and a.needs_teacher_solutions:
            raise ValueError("w_sft / sft_share_* train on stage one's verified teacher solutions, but the curriculum's "
                             f"'teacher_solution' column is empty in all {len(ds)} rows (no teacher sample verified: "
                             "run stage one with teacher_samples >= 1, or turn the off-policy terms off: --w_sft 0 "
                             "--sft_share_start 0 --sft_share_end 0 --sft_learning_rate 0 --sft_max_epochs 0)")
        world = self.accelerator.num_processes
        unit = world * a.gradient_accumulation_steps
        if a.sft_batch_size % unit:
            lo, hi = max(unit, a.sft_batch_size // unit * unit), (a.sft_batch_size // unit + 1) * unit
            raise ValueError(f"sft_batch_size ({a.sft_batch_size}) must be a multiple of world size x "
                             f"gradient_accumulation_steps ({world} x {a.gradient_accumulation_steps} = {unit}): "
                             f"e.g. {lo} or {hi}")
        if a.sft_max_epochs and a.sft_batch_size > a.sft_max_epochs * len(self._sft_pool):
            log.warning("sft_max_epochs=%g over %d verified solutions is less than one batch of %d: no off-policy "
                        "step will run, every step is on-policy", a.sft_max_epochs, len(self._sft_pool), a.sft_batch_size)

    def _choose_off_policy(self) -> bool:
        """This optimizer step's kind: off-policy (teacher solutions only) or on-policy, by ``TimeShare``;
        on-policy whenever one more batch would take the solution stream past ``sft_max_epochs`` passes."""
        a = self.args
        self._share_now = sft_share(self.time_fraction(), a.sft_share_start, a.sft_share_end)
        if self.sft_phase_done():
            self._share_now = 0.0  # recorded as the share in force: TimeShare then counts these seconds as on-policy
            if self._handover_step is None:  # the hand-over (a resume past it restores the step, and no reset)
                self._handover_step = int(self.state.global_step)
                if a.sft_handover_reset:
                    self._reset_optimizer_moments()
        off = self._time_share.choose(self._share_now)
        return self._any_process(off) if self.accelerator.num_processes > 1 else off

    def sft_phase_done(self) -> bool:
        """True once the solution stream has no batch left under ``sft_max_epochs`` passes, so every later step
        is on-policy; always False without a cap (``sft_max_epochs = 0``). Read at a step's end, it says whether
        the next step is past the hand-over (bench/learning.py exports the model there)."""
        a = self.args
        return bool(a.sft_max_epochs) and self._sft_pos + a.sft_batch_size > a.sft_max_epochs * len(self._sft_pool)

    def _offpolicy_batch(self) -> dict[str, Any]:
        """``sft_batch_size`` teacher solutions (this process's share), each epoch of the pool in a seeded order."""
        a = self.args
        n, pool = a.sft_batch_size, self._sft_pool
        idx = []
        for j in range(self._sft_pos, self._sft_pos + n):
            epoch = j // len(pool)
            if self._sft_epoch[0] != epoch:
                g = torch.Generator().manual_seed(a.seed + epoch)
                self._sft_epoch = (epoch, torch.randperm(len(pool), generator=g).tolist())
            idx.append(pool[self._sft_epoch[1][j % len(pool)]])
        self._sft_pos += n
        mine = idx[self.accelerator.process_index :: self.accelerator.num_processes]
        rows = self.train_dataset.select(mine)
        batch = solution_batch(self.processing_class, rows["prompt"], rows["teacher_solution"],
                                         device=self.accelerator.device)
        batch["sft_num_items"] = self.accelerator.gather(batch["sft_completion_mask"].sum()).sum().float()
        batch["off_policy"] = torch.ones(len(mine), device=self.accelerator.device)
        self._last_gen_tokens = int(batch["sft_num_items"].item())
        return batch

    def _solution_rows(self, inputs: list[dict[str, Any]], B: int) -> dict[str, torch.Tensor]:
        """The ``w_sft`` term's data in an on-policy batch: each prompt's teacher solution on its group's first row."""
        G, first = self.args.num_generations, self.accelerator.process_index * B
        sols = [x.get("teacher_solution") if (first + i) % G == 0 else None for i, x in enumerate(inputs)]
        out = solution_batch(self.processing_class, [x["prompt"] for x in inputs], sols,
                                       device=self.accelerator.device)
        out["sft_num_items"] = self.accelerator.gather(out["sft_completion_mask"].sum()).sum().float()
        return out

    def _sft_loss(self, unwrapped_student, inputs, weight: float):
        """``(weight * CE, entropy sum, token count)`` of the micro-batch's teacher solutions.

        CE = -sum_t log pi_theta(y_t | x, y_<t) over solution tokens / the step's global solution-token
        count (per process under DDP averaging, as TRL divides ``num_items_in_batch``), at temperature 1
        (TRL ``SFTTrainer``'s completion-only loss). A micro-batch without solution tokens gives 0.
        """
        from trainers.model_utils import logit_transform

        cids, cmask = inputs["sft_completion_ids"], inputs["sft_completion_mask"]
        rows = cmask.bool().any(dim=1)
        if not bool(rows.any()):
            return cids.new_zeros((), dtype=torch.float32), cids.new_zeros((), dtype=torch.float32), rows.sum()
        cids, cmask = cids[rows], cmask[rows]
        ids = torch.cat([inputs["sft_prompt_ids"][rows], cids], dim=1)
        mask = torch.cat([inputs["sft_prompt_mask"][rows], cmask], dim=1)
        h = self._get_last_hidden_state(unwrapped_student, ids, mask, cids.size(1))
        (w, b), _ = self._heads(unwrapped_student, self.accelerator.unwrap_model(self.teacher_model))
        scale, cap = logit_transform(unwrapped_student.config)
        valid = cmask.bool().to(w.device)
        lp, entropy = losses.token_logprobs(h.to(w.device)[valid], w, b, cids.to(w.device)[valid], logit_scale=scale,
                                            softcap=cap, with_entropy=True)
        N = inputs["sft_num_items"].clamp(min=1.0).to(lp.device) / self.accelerator.num_processes
        ce = -lp.sum() / N
        self._acc_sft["loss"] += float(ce.detach())
        self._acc_sft["tokens"] += float(valid.sum())
        return weight * ce, entropy.detach().sum(), valid.sum()

    def _objective(self) -> dict[str, float]:
        """The settings that decide each step's kind and loss, saved so that a resume can say when they changed."""
        return {k: float(getattr(self.args, k)) for k in OBJECTIVE_SETTINGS}

    def _offpolicy_state(self) -> dict:
        """What a resumed run needs to continue the mix where it stopped (saved beside the clock's fraction):
        the position in the solution stream (its epochs, hence ``sft_max_epochs``), the time-share credit, and
        the objective's settings."""
        return {"sft_pos": self._sft_pos, "sft_credit": self._time_share.credit, "handover_step": self._handover_step,
                "objective": self._objective()}

    def _reset_optimizer_moments(self) -> None:
        """``sft_handover_reset``: forget every parameter's optimizer state (Adam's step count and moments), so the
        on-policy steps' statistics start fresh, with bias correction, as in a new run. Raises RuntimeError for an
        optimizer that is not a torch one (DeepSpeed keeps its state elsewhere)."""
        opt = getattr(self.optimizer, "optimizer", self.optimizer)  # the torch optimizer inside accelerate's wrapper
        if not isinstance(opt, torch.optim.Optimizer):
            raise RuntimeError(f"sft_handover_reset needs a torch optimizer, got {type(opt).__name__}: set it to 0")
        opt.state.clear()
        log.info("hand-over at step %d: optimizer moments cleared, rate warming up over %d steps",
                 self._handover_step, self.args.sft_handover_reset)

    def _rate_scale(self) -> float:
        """The factor the step hook applies to the scheduled rate this step: ``sft_learning_rate / learning_rate``
        on an off-policy step; ``min(1, (k + 1) / sft_handover_reset)`` on the k-th on-policy step after a reset
        hand-over (k = 0 first); else 1."""
        a = self.args
        if self._off_policy_step:
            return a.sft_learning_rate / a.learning_rate if a.sft_learning_rate else 1.0
        if a.sft_handover_reset and self._handover_step is not None:
            return min(1.0, (self.state.global_step - self._handover_step + 1) / a.sft_handover_reset)
        return 1.0

    def _install_rate_hooks(self, optimizer) -> None:
        """``sft_learning_rate > 0`` or ``sft_handover_reset > 0``: torch optimizer step hooks scale every group's
        rate by ``_rate_scale()`` (``sft_learning_rate / learning_rate`` for the step of an off-policy batch, the
        re-warm-up after a reset hand-over) and restore it after, so the schedule (warm-up, decay over the clock)
        applies to both kinds of step and checkpoints hold the plain rate."""
        a = self.args
        optimizer = getattr(optimizer, "optimizer", optimizer)  # the torch optimizer inside accelerate's wrapper
        if ((not a.sft_learning_rate or a.sft_learning_rate == a.learning_rate) and not a.sft_handover_reset
                or getattr(optimizer, "_opd_sft_lr_hooks", False)):  # once per optimizer: twice would compound
            return
        optimizer._opd_sft_lr_hooks = True

        def pre(opt, args, kwargs):
            scale = self._rate_scale()
            if scale != 1.0:
                for g in opt.param_groups:
                    g["opd_scheduled_lr"] = g["lr"]
                    g["lr"] = g["lr"] * scale
                self._sft_lr_applied = scale  # set only when the hook fires: sft/lr_scale shows it was applied

        def post(opt, args, kwargs):
            for g in opt.param_groups:
                if "opd_scheduled_lr" in g:
                    g["lr"] = g.pop("opd_scheduled_lr")

        optimizer.register_step_pre_hook(pre)
        optimizer.register_step_post_hook(post)

    def _load_offpolicy_state(self, state: dict) -> None:
        """Restore ``_offpolicy_state()`` (a checkpoint written before it existed restarts the stream at 0). A resume
        under other objective settings than the save's goes on under the new ones, with a warning naming them (a
        run begun on-policy and resumed under a config with SFT first runs SFT steps from here)."""
        saved = state.get("objective")
        if saved is not None:
            now = self._objective()
            changed = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
            if changed:
                log.warning("resuming under other objective settings than the checkpoint's (saved -> now): %s",
                            ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items()))
        elif self.args.trains_on_teacher_solutions:  # saved before the settings were recorded (2026-12-04)
            log.warning("resuming from a checkpoint that does not record its objective settings: this run's "
                        "off-policy settings (%s) apply from here, whatever the checkpoint's steps were",
                        ", ".join(f"{k} {v:g}" for k, v in self._objective().items() if k.startswith(("w_sft", "sft_"))))
        self._sft_pos = int(state.get("sft_pos", 0))
        self._time_share.credit = float(state.get("sft_credit", 0.0))
        h = state.get("handover_step")
        # a hand-over the new settings undo (more passes than the save's) happens again, at its new step
        self._handover_step = None if h is None or not self.sft_phase_done() else int(h)

    def _finish_offpolicy(self, step_s: float) -> None:
        """Step metrics of the off-policy signal; feeds the step's seconds to the time-share chooser."""
        a = self.args
        if not a.trains_on_teacher_solutions:
            return
        self._time_share.record(self._share_now, self._off_policy_step, step_s)
        vec = torch.tensor([self._acc_sft["loss"], self._acc_sft["tokens"]], dtype=torch.float64,
                           device=self.accelerator.device)
        self._acc_sft.clear()
        loss_sft, tokens = self.accelerator.reduce(vec, reduction="sum").tolist()
        m = self._metrics["train"]
        m["loss/sft"].append(loss_sft)  # mean CE per solution token (the term before its weight)
        m["sft/tokens"].append(tokens)
        m["sft/share"].append(self._share_now)
        m["sft/off_policy_step"].append(float(self._off_policy_step))
        m["sft/epoch"].append(self._sft_pos / max(1, len(self._sft_pool)))  # passes over the pool (0 when it is empty)
        m["sft/weight"].append(1.0 if self._off_policy_step else a.w_sft)
        m["sft/lr_scale"].append(self._sft_lr_applied)  # set by the rate hook of this step, if any
        self._sft_lr_applied = 1.0

