"""Saving and resuming ``OPDTrainer``: its resume state and its Hugging Face exports (a mixin of ``OPDTrainer``).

- Resume state: transformers' own ``checkpoint-<step>/`` (weights, optimizer, scheduler, RNG, trainer_state.json)
  under ``<output_dir>/resume``, plus ``CLOCK_STATE`` (the training window's used share, the off-policy stream, the
  number of processes and the recipe's batch) so the clock schedules, the save hedges and the SFT phase resume where
  the save left them, and a resume on another number of processes says what changes.
- Exports: every save also writes a loadable HF directory ``ckpt_dir/checkpoint-<step>/`` (the run contract's
  scored exports), keeps the ``ckpt_keep`` newest and records it in ``metrics/exports.jsonl``.

The methods read the trainer's ``cadence``, ``offpolicy``, ``time_fraction``, ``start_time`` and ``engine``, set in
``OPDTrainer.__init__``, and set its ``_fraction0`` on resume; apart from it the mixin has no use.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from transformers import Trainer

from data_tools.runio import write_json
from trainers.callbacks import export_checkpoint, share_file_modes
from trainers.opd_config import DTYPES, TIME_SCHEDULES

log = logging.getLogger(__name__)

#: In each resume checkpoint: the training window's used share at the save, so clock schedules resume there.
CLOCK_STATE = "opd_clock.json"


class SaveAndResume:
    """``OPDTrainer``'s overrides of ``transformers.Trainer``'s saving and loading (see the module docstring)."""

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and (Path(checkpoint) / CLOCK_STATE).exists():
            state = json.loads((Path(checkpoint) / CLOCK_STATE).read_text())
            self._fraction0 = float(state["time_fraction"])
            self.cadence.resume_at(self._fraction0)  # hedges passed before the save are not due again
            self.offpolicy.load_state_dict(state)
            self._check_resumed_processes(state, checkpoint)
        # The optimizer state brings back the learning rate of the save; the schedule is the clock's now.
        if checkpoint is not None and self.lr_scheduler is not None and self.args.lr_scheduler_type in TIME_SCHEDULES:
            sched = self.lr_scheduler
            lrs = [base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
            for group, lr in zip(sched.optimizer.param_groups, lrs):
                group["lr"] = lr
            sched._last_lr = lrs

    def _check_resumed_processes(self, state: dict, checkpoint) -> None:
        """A state saved by another number of processes resumes: every rank reads the full weights and optimizer
        state (DDP keeps them whole on each) and a missing per-rank RNG file only changes the sampling seed. What
        changes is said in one line: the data order from here, and the step's batch unless it is split over the
        processes (``split_batch_over_processes``)."""
        saved, now = int(state.get("processes", 1)), self.accelerator.num_processes
        if saved == now:
            return
        a = self.args
        same = a.split_batch_over_processes and list(state.get("recipe_batch") or []) in ([], list(a.recipe_batch))
        batch = ("each step keeps the recipe's batch of "
                 f"{a.recipe_batch[0] * a.recipe_batch[1]} completions" if same else
                 f"a step now trains on {a.per_device_train_batch_size * a.gradient_accumulation_steps * now} completions")
        if self.accelerator.is_main_process:
            log.warning("resuming %s, saved by %d process(es), on %d: %s; the data order and sampling seeds from here "
                        "differ from an uninterrupted run's", checkpoint, saved, now, batch)

    def _get_output_dir(self, trial=None) -> str:
        # transformers writes its resumable checkpoint-<step>/ (weights, optimizer, scheduler, RNG,
        # trainer_state.json) here; the HF exports of the run contract go to ckpt_dir instead.
        return str(self.args.resume_dir)

    def _save_checkpoint(self, model, trial):
        # The clock's fraction first: trainer_state.json, written last by transformers, marks the state complete.
        if self.args.should_save:
            write_json({"time_fraction": self.time_fraction(), "processes": self.accelerator.num_processes,
                        "recipe_batch": list(getattr(self.args, "recipe_batch", ())), **self.offpolicy.state_dict()},
                       Path(self._get_output_dir(trial)) / f"checkpoint-{self.state.global_step}" / CLOCK_STATE)
        # Resume state via transformers' own machinery (skipping TRL's model card, which would land in output_dir).
        t0 = time.perf_counter()
        Trainer._save_checkpoint(self, model, trial)
        if self.args.should_save:
            share_file_modes(Path(self._get_output_dir(trial)) / f"checkpoint-{self.state.global_step}")
        self.export_checkpoint(resume_state_s=time.perf_counter() - t0)

    def export_checkpoint(self, resume_state_s: float | None = None) -> Path | None:
        """Write ``ckpt_dir/checkpoint-<global_step>/`` (complete HF export) and keep the ``ckpt_keep`` newest.

        Each save is also a line of ``<output_dir>/metrics/exports.jsonl``: step, run-clock second, the export's
        seconds and, when a resume state was written with it, that state's seconds (the reserve must cover both);
        ``hedges``, the hedge fractions this save is the export of, and ``hedges_crossed``, all those a finished step
        has crossed so far (the rehearsal's report checks each crossed hedge has its save)."""
        a = self.args
        hedges, crossed = self.cadence.take_covered(), self.cadence.crossed
        distributed = self.is_fsdp_enabled or self.is_deepspeed_enabled
        state_dict = self.accelerator.get_state_dict(self.model) if distributed else None
        dest = None
        if self.accelerator.is_main_process:
            dtype = None if a.export_dtype == "auto" else DTYPES[a.export_dtype]
            unwrapped = self.accelerator.unwrap_model(self.model)
            t0 = time.perf_counter()
            dest = export_checkpoint(unwrapped, self.processing_class, Path(a.ckpt_dir), self.state.global_step,
                                     state_dict=state_dict, dtype=dtype, keep=a.ckpt_keep, owner=a.export_owner,
                                     extra={"experiment_name": a.experiment_name, "student_model": a.student_model,
                                            "teacher_model": a.teacher_model, "kl_mode": a.kl_mode,
                                            "teacher_context": a.teacher_context, "engine": self.rollouts.name})
            took = time.perf_counter() - t0
            log.info("exported %s in %.1fs", dest, took)
            row = {"step": self.state.global_step, "wall_s": round(time.time() - self.start_time, 3),
                   "export_s": round(took, 3), "resume_state_s": None if resume_state_s is None else round(resume_state_s, 3),
                   "hedges": hedges, "hedges_crossed": crossed, "path": str(dest)}
            a.metrics_path.parent.mkdir(parents=True, exist_ok=True)
            with open(a.metrics_path.parent / "exports.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
        self.accelerator.wait_for_everyone()
        return dest


__all__ = ["SaveAndResume", "CLOCK_STATE"]
