"""Stage two: on-policy distillation with a verifier reward, bounded by a wall clock.

    python -m stages.train --config configs/demo_cpu.yaml [--field value ...]
    python -m stages.train --config CONFIG --check_config     # parse and check it, run nothing (run.sh does, first)

Precedence: OPDConfig defaults < YAML < run-contract environment (STUDENT_MODEL, TEACHER_MODEL,
MAX_WALL_TIME_SECONDS, DEADLINE_RESERVE_SECONDS, OUTPUT_DIR, CKPT_DIR, EXPERIMENT_NAME)
< command-line flags. Writes, under OUTPUT_DIR:

    metrics/train.jsonl              one JSON line per optimizer step
    rollouts/step-XXXXXX.parquet     every sampled completion of that step
    resume/checkpoint-<step>/        transformers' resumable state (newest kept); a restart resumes
    train_summary.json               how and why the run ended
and CKPT_DIR/checkpoint-<step>/ (default OUTPUT_DIR/checkpoints): complete HF exports, 3 newest.

Exit codes: 0 done (deadline reached, or stopped by SIGTERM / Ctrl-C after saving), 75 another
run holds OUTPUT_DIR or CKPT_DIR, 3 too many non-finite steps, 2 bad configuration or data or an
unwritable directory, 74 disk full (the partial checkpoint is removed), 130 a second Ctrl-C (no save).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from pathlib import Path

# No hub at run time (docs/design.md section 8): never try the network for models, datasets or telemetry.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from transformers import TrainerCallback  # noqa: E402 - after the offline switches above

log = logging.getLogger("stages.train")

EXIT_BAD_CONFIG = 2
EXIT_NONFINITE = 3


def run(args, on_trainer=None) -> dict:
    """Train with a parsed ``OPDConfig``; returns the summary written to ``train_summary.json``.

    ``on_trainer``: called with the built ``OPDTrainer`` before training starts (a hook for callers that
    add callbacks or their own clock, e.g. bench/learning.py's evaluation marks); None for the CLI.
    """
    from transformers import PrinterCallback, ProgressCallback

    from data_tools.runio import write_json
    from trainers.callbacks import (HardStopCallback, HorizonReached, find_resume_checkpoint, foreign_exports,
                                    process_start_time, set_aside, start_owner)
    from trainers.data import build_train_dataset, load_curriculum
    from trainers.model_utils import load_models
    from trainers.opd_trainer import OPDTrainer

    start = process_start_time()
    main_process = int(os.environ.get("RANK", "0")) == 0  # under a launcher every rank runs this; rank 0 speaks
    say = (lambda *a: print(*a, flush=True)) if main_process else (lambda *a: None)  # noqa: E731
    if main_process:
        remove_partial_state(args.resume_dir, args.ckpt_dir)
        resuming = bool(args.resume and find_resume_checkpoint(args.resume_dir))
        owner, adopted = start_owner(args.output_dir, resuming=resuming)
        if foreign := foreign_exports(args.ckpt_dir, owner, unnamed_are_mine=adopted):
            # a scorer of the highest checkpoint-<step> exports (the formal run's) would read these as this run's, and
            # an export of the same step would replace one: they leave the checkpoint-* names, their files kept
            moved = set_aside(foreign)
            say(f"[train] WARNING: {args.ckpt_dir} held {len(foreign)} export(s) this training did not write "
                f"({', '.join(p.name for p in foreign[:3])}{', ...' if len(foreign) > 3 else ''}): renamed to "
                f"{', '.join(p.name for p in moved[:3])}{', ...' if len(moved) > 3 else ''}, files kept, so that "
                "whoever scores the highest checkpoint-<step> there reads this training's")
    table = load_curriculum(args.curriculum_path)
    if args.needs_teacher_solutions and "teacher_solution" not in table.column_names:
        # before the models load (minutes at 1.5B): the off-policy terms need stage one's verified solutions (a
        # recipe that only starts with them, sft_max_epochs > 0, goes on-policy from step 1 over none: warned then)
        raise ValueError(f"{args.curriculum_path}: no 'teacher_solution' column (columns: {sorted(table.column_names)}), "
                         "but w_sft / sft_share_* train on it: run make curate (it writes the column), or turn the "
                         "off-policy terms off: --w_sft 0 --sft_share_start 0 --sft_share_end 0 --sft_learning_rate 0 "
                         "--sft_max_epochs 0")
    student, teacher, tok, t_tok = load_models(args)
    _explain_tied_keys(student, say)
    dataset = build_train_dataset(table, tok, prompt_style=args.prompt_style)
    trainer = OPDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=dataset,
                         processing_class=tok, teacher_processing_class=t_tok, start_time=start)
    deadline = trainer.deadline
    trainer.add_callback(_Console())
    # One process only: a step cut short on one rank would leave the others waiting in a collective. Several
    # processes stop between steps, all at once (DeadlineCallback's any-reduce), on the step-time estimate.
    hard_stop = HardStopCallback(deadline) if trainer.accelerator.num_processes == 1 else None
    if hard_stop is not None:
        trainer.add_callback(hard_stop)  # last: it must see the other callbacks' should_save
    for cb in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(cb)  # _Console prints one short line per step instead
    if on_trainer is not None:
        on_trainer(trainer)

    trainer.accelerator.wait_for_everyone()  # rank 0 has cleared partial states before any rank looks for one
    resume = find_resume_checkpoint(args.resume_dir) if args.resume else None
    began = time.time() - start
    world = trainer.accelerator.num_processes
    procs = (f" processes={world} (a step = {world} x {args.per_device_train_batch_size} x "
             f"{args.gradient_accumulation_steps} accumulated)" if world > 1 else "")
    say(f"[train] engine={trainer.rollouts.name} rows={len(dataset)} G={args.num_generations} "
        f"completions/step={trainer.generation_batch_size}{procs} kl_mode={args.kl_mode} "
        f"teacher={'self(frozen initial student)' if teacher is None else args.teacher_model} "
        f"context={args.teacher_context} resume={resume}")
    say(f"[train] clock: training from {began:.0f}s to the horizon at {args.horizon_seconds:.0f}s on the run's clock "
        f"(max_wall_time_seconds {args.max_wall_time_seconds:.0f} - reserve {args.deadline_reserve_seconds:.0f}), "
        f"{max(args.horizon_seconds - began, 0):.0f}s of training; exports at {args.ckpt_hedge_fractions} of that window "
        f"and at its end")
    if resume is None and deadline.remaining() <= 0:
        # one step would end past the horizon: the start model is the only export that fits
        deadline.stop_reason = (f"no training time left at start: training began at {began:.0f}s on the run's clock, "
                                f"past its horizon at {args.horizon_seconds:.0f}s (set-up and stage one took the window)")
        say(f"[train] {deadline.stop_reason}: exporting the start model as checkpoint-0")
        trainer.export_checkpoint()
    else:
        try:
            trainer.train(resume_from_checkpoint=resume)
        except HorizonReached as e:
            deadline.stop_reason = str(e)
            say(f"[train] {e}: exporting step {trainer.state.global_step}")
            if not (Path(args.ckpt_dir) / f"checkpoint-{trainer.state.global_step}").is_dir():
                trainer.export_checkpoint()  # the weights of the last finished optimizer step
    summary = {
        "global_step": trainer.state.global_step,
        "stop_reason": deadline.stop_reason,
        "wall_s": round(time.time() - start, 1),  # on the run's clock: the end of training and its final export
        "began_at_s": round(began, 1),
        "horizon_s": args.horizon_seconds,
        "resumed_from": resume,
        "engine": trainer.rollouts.name,
        "skipped_nonfinite_steps": trainer.steps.skipped,
        "checkpoints": sorted(str(p) for p in _exports(args.ckpt_dir)),
    }
    if summary["global_step"] == 0:  # said, not hidden: the export is the start model, under a checkpoint's name
        summary["start_model_only"] = True
    if trainer.accelerator.is_main_process:
        write_json(summary, os.path.join(args.output_dir, "train_summary.json"))
    say(f"[train] done: {summary}")
    if summary["global_step"] == 0:
        say(f"[train] trained 0 steps ({deadline.stop_reason}): checkpoint-0 is the start model, not a trained one")
    closing = deadline.interrupted_line(trainer.state.global_step)  # Ctrl-C / SIGTERM: the last line says how to go on
    if closing:
        say(f"[train] {closing}")
    return summary


class _TiedKeysFilter(logging.Filter):
    """transformers' Trainer, resuming, warns ``There were missing keys in the checkpoint model loaded:
    ['lm_head.weight']`` for a model whose output head is tied to its input embeddings: the checkpoint stores that
    tensor once, under the embeddings' name, and loading them fills the head too. Not an error: when every missing
    key names a tied tensor, the warning becomes one line that says so; any other missing key is warned as before."""

    def __init__(self, model, say):
        super().__init__()
        self.model, self.say = model, say

    def _tied(self, keys) -> bool:
        names: dict[int, list[str]] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            names.setdefault(p.data_ptr(), []).append(name)
        shared = {n for group in names.values() if len(group) > 1 for n in group}
        return bool(keys) and all(k in shared for k in keys)

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        head = "There were missing keys in the checkpoint model loaded: "
        if not msg.startswith(head):
            return True
        import ast

        try:
            keys = ast.literal_eval(msg[len(head):].rstrip("."))
        except (ValueError, SyntaxError):
            return True
        if not self._tied(keys):
            return True
        self.say(f"[train] resumed: {', '.join(keys)} not in the checkpoint: tied to the input embeddings, stored once "
                 "and loaded with them (not an error)")
        return False


def _explain_tied_keys(model, say) -> None:
    """Install ``_TiedKeysFilter`` on transformers' trainer logger for this run's student."""
    logger = logging.getLogger("transformers.trainer")
    for f in [f for f in logger.filters if isinstance(f, _TiedKeysFilter)]:
        logger.removeFilter(f)  # a second run in this process (tests, bench/learning.py): its own model
    logger.addFilter(_TiedKeysFilter(model, say))


def _exports(ckpt_dir):
    from trainers.callbacks import checkpoint_steps

    return [p for _, p in checkpoint_steps(ckpt_dir)]


def remove_partial_state(resume_dir, ckpt_dir) -> list[str]:
    """Delete resume states without ``trainer_state.json`` (written last: the save was cut short) and
    temporary export dirs; returns what was removed. Run under the directories' lock only."""
    import shutil
    from pathlib import Path

    from trainers.callbacks import checkpoint_steps

    gone = [p for _, p in checkpoint_steps(resume_dir) if not (p / "trainer_state.json").exists()]
    gone += [p for p in Path(ckpt_dir).glob(".tmp-checkpoint-*") if p.is_dir()]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
        print(f"[train] removed partial checkpoint {p}", flush=True)
    return [str(p) for p in gone]


class _Console(TrainerCallback):
    """One short console line per step (the full record is in metrics/train.jsonl), and a heartbeat
    line every 30 s while a long step runs."""

    def __init__(self):
        self._beat = None

    def on_step_begin(self, args, state, control, **kwargs):
        from data_tools.progress import Heartbeat

        if state.is_world_process_zero and self._beat is None:
            step = state.global_step + 1
            self._beat = Heartbeat(lambda s: f"[step {step}] running: {s:.0f}s")

    def on_step_end(self, args, state, control, **kwargs):
        if self._beat is not None:
            self._beat.stop()
            self._beat = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "loss" not in logs:
            return
        g = lambda k: logs.get(k) if logs.get(k) is not None else float("nan")  # noqa: E731
        if logs.get("sft/off_policy_step") == 1.0:  # an off-policy SFT step: no rollouts, no KL, no reward
            self._sft_steps = getattr(self, "_sft_steps", 0) + 1
            print(f"[step {state.global_step}] sft loss={g('loss'):.4f} pass={g('sft/epoch'):.2f} "
                  f"lr_scale={g('sft/lr_scale'):g} step={g('time/step'):.1f}s", flush=True)
            return
        if getattr(self, "_sft_steps", 0) and not getattr(self, "_handed_over", False):
            self._handed_over = True
            k = getattr(args, "sft_handover_reset", 0)
            reset = f"; optimizer moments reset, rate warming up over {k} steps" if k else ""
            print(f"[train] on-policy from step {state.global_step} (after {self._sft_steps} off-policy SFT steps, "
                  f"{g('sft/epoch'):.3g} passes over the curriculum's teacher solutions{reset})", flush=True)
        spg = getattr(args, "steps_per_generation", 1) or 1
        if spg > 1 and logs.get("reward/mean") is None and getattr(self, "_gen_step", None):
            # a later update of a rollout batch: its reward and lengths are the generating step's line
            k = state.global_step - self._gen_step + 1
            print(f"[step {state.global_step}] loss={g('loss'):.4f} kl={g('kl/sampled_mean'):.4f} update {k}/{spg} "
                  f"of step {self._gen_step}'s rollouts step={g('time/step'):.1f}s", flush=True)
            return
        self._gen_step = state.global_step
        print(f"[step {state.global_step}] loss={g('loss'):.4f} kl={g('kl/sampled_mean'):.4f} "
              f"reward={g('reward/mean'):.3f} len={g('completions/mean_length'):.1f} "
              f"step={g('time/step'):.1f}s gen={g('time/generation'):.1f}s", flush=True)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit code (see the module docstring)."""
    # under a launcher the other ranks log errors only: their info and warnings repeat rank 0's
    level = os.environ.get("OPD_LOG_LEVEL", "INFO") if int(os.environ.get("RANK") or 0) == 0 else "ERROR"
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from data_tools.config import parse_config, stage_help
    from data_tools.runio import EXIT_IO, EXIT_LOCKED, LockHeld, check_outside_repo, io_failure, run_lock
    from trainers.opd_config import OPDConfig
    from trainers.opd_trainer import NonFiniteError

    argv = list(sys.argv[1:] if argv is None else argv)
    check_only = "--check_config" in argv  # run.sh: parse and check the config before stage one, run nothing
    if check_only:
        argv.remove("--check_config")
        import torch

        if not torch.cuda.is_available():  # checking a GPU recipe on a CPU machine (run.sh --plan): not its hardware
            argv += ["--use_cpu", "true"]
    try:
        (args,) = parse_config([OPDConfig], argv, **stage_help(__doc__))
        check_outside_repo(args.output_dir, "OUTPUT_DIR")
        check_outside_repo(args.ckpt_dir, "CKPT_DIR")
    except (ValueError, FileNotFoundError) as e:
        print(f"opd train: configuration error: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    if check_only:
        from data_tools.models import check_teacher_tokenizer

        try:  # a teacher the trainer would refuse is refused now, before stage one spends its budget
            check_teacher_tokenizer(args.student_model, args.teacher_model)
        except (ValueError, FileNotFoundError) as e:
            print(f"opd train: configuration error: {e}", file=sys.stderr)
            return EXIT_BAD_CONFIG
        print("opd train: configuration OK")
        return 0
    # Under torchrun / accelerate every rank runs this; rank 0 holds the directories' lock for all.
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE") or 1)
    who = f" (rank {rank} of {world})" if world > 1 else ""
    lock = run_lock(args.output_dir, args.ckpt_dir) if rank == 0 else contextlib.nullcontext()
    try:
        with lock:
            try:
                run(args)
            except (KeyboardInterrupt, OSError, RuntimeError) as e:
                why = None if isinstance(e, KeyboardInterrupt) else io_failure(e, (args.output_dir, args.ckpt_dir))
                if rank == 0:  # still under the lock; after the diagnosis, which reads the free space
                    remove_partial_state(args.resume_dir, args.ckpt_dir)
                if why:
                    print(f"opd train{who}: error: {why}; partial checkpoints removed, the last complete one is kept",
                          file=sys.stderr)
                    return EXIT_IO
                if world > 1 and collective_failure(e):  # a peer is gone: the launcher's line names it
                    print(f"opd train{who}: stopped: a collective failed ({str(e).splitlines()[0][:200]})",
                          file=sys.stderr)
                    return 1
                raise
    except LockHeld as e:
        print(f"opd train: {e}", file=sys.stderr)
        return EXIT_LOCKED
    except NonFiniteError as e:
        print(f"opd train{who}: {e}", file=sys.stderr)
        return EXIT_NONFINITE
    except (FileNotFoundError, ValueError) as e:
        if rank == 0:  # the same configuration or data error on every process: said once
            print(f"opd train: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except KeyboardInterrupt:  # the second Ctrl-C: no save
        print("opd train: interrupted; the last complete checkpoint is kept", file=sys.stderr)
        return 130
    return 0


def collective_failure(e: BaseException) -> bool:
    """True for the error a process gets when a collective's peer is gone (gloo: the connection closed; NCCL: a
    ``DistError``, or the watchdog's timeout once ``ddp_timeout`` passes)."""
    import torch.distributed as dist

    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e)
    return any(k in text for k in ("Connection closed by peer", "Connection reset by peer", "NCCL", "ProcessGroup"))


if __name__ == "__main__":
    raise SystemExit(main())
