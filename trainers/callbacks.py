"""Run-contract callbacks and checkpoint helpers (docs/design.md section 6).

- ``DeadlineCallback``: the horizon is the wall clock. Training stops before a step that would end
  past ``max_wall_time_seconds - deadline_reserve_seconds`` counted from the *run's start*
  (``run.sh``'s ``OPD_RUN_START``, else this process's start: ``data_tools.clock``), and the stop
  always saves (the reserve pays for that final checkpoint). SIGTERM and a debug step cap stop the
  same way.
- ``SaveCadenceCallback``: checkpoint every N steps and/or every M minutes (transformers'
  ``SaveStrategy`` has no time-based option, transformers#29984) until the first hedge fraction of
  the training window, then once at each hedge fraction, so the exports kept (the highest three)
  are spread over the end of the window instead of sitting in its last minutes.
- ``HardStopCallback``: a step still running when the horizon passes is cut short (SIGALRM), so the
  final export still fits in the reserve when one step is longer than the time left.
- ``MetricsJsonlCallback``: one JSON line per optimizer step in ``metrics/train.jsonl``.
- ``export_checkpoint`` / ``rotate_exports`` / ``find_resume_checkpoint``: HF exports written to a
  temp dir then renamed, the three highest steps kept; resume state found by its completeness marker.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from transformers import TrainerCallback

log = logging.getLogger(__name__)

_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


def process_start_time() -> float:
    """Unix time the run contract's clock counts from: ``$OPD_RUN_START`` (set by run.sh), else this
    process's start (``data_tools.clock.run_start_time``; raises ValueError on a bad value)."""
    from data_tools.clock import run_start_time

    return run_start_time()


def checkpoint_steps(directory: Path) -> list[tuple[int, Path]]:
    """``[(step, path)]`` of ``checkpoint-<step>`` directories in ``directory``, ascending by step."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in directory.iterdir() if p.is_dir() and (m := _CKPT_RE.match(p.name))]
    return sorted(out)


def find_resume_checkpoint(resume_dir: Path) -> str | None:
    """Highest ``checkpoint-<step>`` in ``resume_dir`` that is complete, or None.

    transformers writes ``trainer_state.json`` last in ``Trainer._save_checkpoint`` (after weights,
    optimizer, scheduler and RNG state), so its presence marks a checkpoint that was not cut short
    by a kill; an incomplete newer one is skipped.
    """
    for step, path in reversed(checkpoint_steps(resume_dir)):
        if (path / "trainer_state.json").exists():
            return str(path)
        log.warning("skipping incomplete resume checkpoint %s", path)
    return None


def export_owner(path: Path) -> str | None:
    """The id of the training that wrote export ``path`` (its ``opd_checkpoint.json``'s ``owner``), or None (not
    ours, or written before exports named their training)."""
    try:
        return json.loads((Path(path) / "opd_checkpoint.json").read_text()).get("owner")
    except (OSError, ValueError, AttributeError):
        return None


def foreign_exports(ckpt_dir: Path, owner: str, *, unnamed_are_mine: bool = False) -> list[Path]:
    """The ``checkpoint-*`` exports in ``ckpt_dir`` that another run (or anything else) wrote, ascending by step.
    ``unnamed_are_mine``: exports that name no run count as ``owner``'s (a run resumed from before exports named it)."""
    return [p for _, p in checkpoint_steps(ckpt_dir)
            if (o := export_owner(p)) != owner and not (o is None and unnamed_are_mine)]


def owner_file(output_dir: Path) -> Path:
    """Where a run directory keeps the id its exports name (``OPDConfig.export_owner``)."""
    return Path(output_dir) / "metrics" / "export_owner"


def start_owner(output_dir: Path, *, resuming: bool) -> tuple[str, bool]:
    """The id this training's exports name: the same as before when it resumes, a new one when it starts afresh (so
    the exports a former training in the same directories left are not taken for its own). Returns ``(id, adopted)``:
    ``adopted`` when a resumed run had no id yet (its exports, written before exports named a run, count as its own)."""
    f = owner_file(output_dir)
    if resuming and f.is_file() and f.read_text().strip():
        return f.read_text().strip(), False
    owner = f"{Path(output_dir).resolve()}#{os.urandom(6).hex()}"
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(owner + "\n")
    return owner, resuming


def set_aside(paths: list[Path]) -> list[Path]:
    """Rename each export out of ``checkpoint-*`` to ``stale-checkpoint-<step>`` (a free name), keeping its files:
    whoever scores the highest ``checkpoint-<step>`` of the directory then reads this run's only. Returns the names."""
    moved = []
    for p in paths:
        dest, k = p.with_name(f"stale-{p.name}"), 1
        while dest.exists():
            dest, k = p.with_name(f"stale-{p.name}.{k}"), k + 1
        os.replace(p, dest)
        moved.append(dest)
    return moved


def rotate_exports(ckpt_dir: Path, keep: int, owner: str | None = None) -> list[Path]:
    """Delete all but the ``keep`` highest-step exports in ``ckpt_dir`` (and stale temp dirs); returns the removed.
    ``owner``: only that run's exports count and go (another run's in a shared directory are never deleted)."""
    removed = []
    mine = [(s, p) for s, p in checkpoint_steps(ckpt_dir) if owner is None or export_owner(p) == owner]
    for _, path in mine[:-keep] if keep > 0 else []:
        _remove_export(path)
        removed.append(path)
    for tmp in Path(ckpt_dir).glob(".tmp-checkpoint-*"):
        # left by a process killed while exporting; ours is renamed before we get here
        if tmp.is_dir() and time.time() - tmp.stat().st_mtime > 60:
            shutil.rmtree(tmp, ignore_errors=True)
    return removed


def _remove_export(path: Path) -> None:
    """Delete an export without a reader ever seeing it half deleted: one rename takes it out of ``checkpoint-*``
    (to a ``.tmp-checkpoint-*`` name, which the stale sweep above removes if this process dies first), then it goes."""
    aside = path.with_name(f".tmp-{path.name}-removed-{os.getpid()}")
    try:
        os.replace(path, aside)
    except OSError:
        aside = path  # gone already, or not renamable here: deleted where it is
    shutil.rmtree(aside, ignore_errors=True)


def share_file_modes(directory: Path) -> None:
    """Make a checkpoint readable by others (files 0644, dirs 0755, within the umask).

    safetensors and ``tempfile`` create 0600 files, which would hide the weights from the other
    users of a shared node while the rest of the checkpoint is 0644.
    """
    umask = os.umask(0)
    os.umask(umask)
    for root, dirs, files in os.walk(directory):
        os.chmod(root, 0o755 & ~umask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644 & ~umask)


def export_checkpoint(model, tokenizer, ckpt_dir: Path, step: int, *, state_dict: dict | None = None,
                      dtype: Any = None, keep: int = 3, extra: dict | None = None, owner: str | None = None) -> Path:
    """Write a complete HF export ``ckpt_dir/checkpoint-<step>/`` atomically and rotate to ``keep``.

    Contents: safetensors weights, ``config.json``, ``generation_config.json``, tokenizer files and
    ``opd_checkpoint.json`` (step, time, ``extra``). Written into ``.tmp-checkpoint-<step>-*`` in the
    same directory, then renamed, so a reader (vLLM, evaluation, the formal orchestrator scoring
    ``/out/checkpoints``) never sees a partial export. An existing export of the same step, and the
    exports rotated out, are renamed out of ``checkpoint-*`` before they are deleted.

    Args:
        model: an unwrapped ``PreTrainedModel``.
        state_dict: full state dict to save (pass ``accelerator.get_state_dict(model)`` under FSDP / ZeRO-3).
        dtype: cast floating weights to this torch dtype (e.g. bfloat16 exports of an fp32 run).
        owner: the training's id (``OPDConfig.export_owner``), recorded in ``opd_checkpoint.json``; rotation then
            counts and removes only the exports that name it.
    """
    import torch

    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    dest = ckpt_dir / f"checkpoint-{step}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-checkpoint-{step}-", dir=ckpt_dir))
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would survive the rename and lock out other readers
    try:
        if dtype is not None:
            sd = state_dict if state_dict is not None else model.state_dict()
            state_dict = {k: (v.to(dtype) if torch.is_floating_point(v) else v) for k, v in sd.items()}
        model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        if dtype is not None:
            # save_pretrained records the live parameters' dtype; the file holds ``dtype`` weights, and
            # loaders (vLLM dtype="auto") read config.json to choose theirs
            cfg_path = tmp / "config.json"
            cfg = json.loads(cfg_path.read_text())
            cfg["dtype"] = str(dtype).replace("torch.", "")
            cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        tokenizer.save_pretrained(tmp)
        meta = {"step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **(extra or {}),
                **({"owner": owner} if owner else {})}
        (tmp / "opd_checkpoint.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
        share_file_modes(tmp)
        if dest.exists():  # an export of this step already: renamed aside first (see _remove_export), deleted after
            aside = dest.with_name(f"{tmp.name}-replaced")
            os.replace(dest, aside)
            try:
                os.replace(tmp, dest)
            except BaseException:
                os.replace(aside, dest)
                raise
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    rotate_exports(ckpt_dir, keep, owner)
    return dest


class DeadlineCallback(TrainerCallback):
    """Stop (and save) before the next step would cross the wall-clock horizon.

    Args:
        horizon_s: seconds after ``start_time`` by which training must have stopped
            (``max_wall_time_seconds - deadline_reserve_seconds``).
        start_time: Unix time the clock counts from (process start).
        max_steps: debug cap on ``global_step`` (0 = none); formal runs never stop on steps.
        clock: injectable for tests.

    The next step's duration is estimated as the larger of the last step and the running mean, so
    one fast step does not lure the run past the deadline. ``stop_reason`` says why it stopped.
    """

    def __init__(self, horizon_s: float, start_time: float, *, max_steps: int = 0,
                 clock: Callable[[], float] = time.time, handle_sigterm: bool = True,
                 sync: Callable[[bool], bool] | None = None):
        self.horizon_s, self.start_time, self.max_steps, self.clock = horizon_s, start_time, max_steps, clock
        # ranks read their own clocks; ``sync`` (an any-reduce across processes) makes them stop together,
        # else one rank would leave the loop while the others wait in a collective
        self.sync = sync
        self.stop_reason: str | None = None
        self.train_began: float | None = None
        self._sigterm = ""  # the signal that asked to stop, lower case
        self._signal_at = 0.0
        self._step_began: float | None = None
        self._step: int | None = None  # the optimizer step running now (1-based), None between steps
        self._last_step = 0  # the last step begun
        self._durations: list[float] = []
        if handle_sigterm:
            try:
                signal.signal(signal.SIGTERM, self._on_sigterm)
                # Ctrl-C as SIGTERM (also where a script started us with SIGINT ignored); a second one aborts
                signal.signal(signal.SIGINT, self._on_sigterm)
            except ValueError:  # not the main thread (e.g. some test runners): no handler
                pass

    def _on_sigterm(self, signum, frame):  # noqa: ARG002 - signal handler signature
        name = signal.Signals(signum).name
        if self._sigterm:
            # a Ctrl-C reaches a stage twice under a script (the terminal's, to the process group, and
            # the one the script forwards): only a later one is the user's "abort without saving"
            if signum == signal.SIGINT and time.monotonic() - self._signal_at > 5.0:
                raise KeyboardInterrupt
            return
        if int(os.environ.get("RANK", "0")) == 0:  # under a launcher every rank gets it: one line for the run
            print(f"[train] {name}: {self.stopping_line()}"
                  + (" (Ctrl-C again aborts without saving)" if signum == signal.SIGINT else ""), flush=True)
        self._sigterm, self._signal_at = name.lower(), time.monotonic()

    def step_left_s(self) -> float | None:
        """Seconds left in the running step, estimated as the deadline estimates the next one (the larger of
        the last step and the mean); None before a step has finished or between steps."""
        if self._step is None or self._step_began is None or not self._durations:
            return None
        est = max(self._durations[-1], sum(self._durations) / len(self._durations))
        return max(0.0, est - (self.clock() - self._step_began))

    def stopping_line(self) -> str:
        """What a stop request does, said at once: "stopping after step N (~S s left in it), then its state is saved;
        rerun the same command to resume"."""
        if self._step is None:
            when = f"stopping after step {self._last_step + 1} (training has not started its next step yet)" \
                if self._last_step else "stopping after step 1 (training has not started yet)"
        else:
            left = self.step_left_s()
            when = (f"stopping after step {self._step} (~{left:.0f} s left in it)" if left is not None
                    else f"stopping after step {self._step} (its first: no estimate of the time left in it)")
        return f"{when}, then its state is saved; rerun the same command to resume"

    def interrupted_line(self, step: int) -> str | None:
        """The closing line of a run stopped by SIGINT / SIGTERM, else None."""
        if not self._sigterm:
            return None
        return f"interrupted at step {step}; rerun the same command to resume"

    def elapsed(self) -> float:
        return self.clock() - self.start_time

    def remaining(self) -> float:
        return self.horizon_s - self.elapsed()

    def window_fraction(self) -> float:
        """Share of the training window used, in [0, 1]: 0 at ``on_train_begin`` (this process's), 1 at
        the horizon. The window starts where training starts, not at the run's start: stage one's
        time is not training time."""
        began = self.clock() if self.train_began is None else self.train_began
        span = self.start_time + self.horizon_s - began
        return 1.0 if span <= 0 else min(1.0, max(0.0, (self.clock() - began) / span))

    def on_train_begin(self, args, state, control, **kwargs):
        self.train_began = self.clock()

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_began = self.clock()
        self._step = self._last_step = state.global_step + 1

    def on_step_end(self, args, state, control, **kwargs):
        self._step = None
        if self._step_began is not None:
            self._durations.append(self.clock() - self._step_began)
        est = max(self._durations[-1], sum(self._durations) / len(self._durations)) if self._durations else 0.0
        reason = None
        if self._sigterm:
            reason = self._sigterm
        elif self.max_steps and state.global_step >= self.max_steps:
            reason = f"max_steps={self.max_steps} (the step cap)"
        elif self.elapsed() + est > self.horizon_s:
            reason = f"deadline (elapsed {self.elapsed():.0f}s + next step ~{est:.0f}s > horizon {self.horizon_s:.0f}s)"
        if self.sync is not None and self.sync(reason is not None) and reason is None:
            reason = "another process reached its stop condition"
        if reason:
            self.stop_reason = reason
            control.should_save = True
            control.should_training_stop = True
            log.info("stopping at step %d: %s", state.global_step, reason)
        return control


class HorizonReached(BaseException):
    """Raised in the main thread by ``HardStopCallback`` when the horizon passes during a step.

    A ``BaseException``, like ``KeyboardInterrupt``, so no ``except Exception`` inside a step swallows it."""


class HardStopCallback(TrainerCallback):
    """Cut a step short when the horizon passes mid-step (the deadline's estimate cannot know the first step).

    ``DeadlineCallback`` stops *between* steps; a step longer than the time left (the first one, or any
    on a machine that slowed down) would end past the horizon and push the final export past the
    reserve. This callback arms ``SIGALRM`` for the horizon at ``on_train_begin``; when it fires inside
    a step, :class:`HorizonReached` propagates out of ``trainer.train()`` and the caller exports the
    weights of the last finished optimizer step (``stages.train`` does). The alarm waits while the
    optimizer updates the weights (so an export never holds a half-applied update) and while a save
    runs (it is raised once the save is done, whose export then is the final one). Add it after every
    other callback, so it sees their ``should_save``. Main thread, one process only (a rank leaving a
    collective would hang the others): elsewhere it does nothing.
    """

    def __init__(self, deadline: DeadlineCallback):
        self.deadline = deadline
        self.armed = False
        self._defer = False
        self._pending = False

    def _on_alarm(self, signum, frame):  # noqa: ARG002 - signal handler signature
        if self._defer:
            self._pending = True
            return
        self._raise()

    def _raise(self):
        self.disarm()
        raise HorizonReached(f"horizon {self.deadline.horizon_s:.0f}s reached during a step "
                             f"(elapsed {self.deadline.elapsed():.0f}s)")

    def disarm(self) -> None:
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            self.armed = False

    def _resume(self) -> None:
        self._defer = False
        if self._pending:
            self._pending = False
            self._raise()

    def on_train_begin(self, args, state, control, **kwargs):
        try:
            signal.signal(signal.SIGALRM, self._on_alarm)
        except ValueError:  # not the main thread
            return
        signal.setitimer(signal.ITIMER_REAL, max(self.deadline.remaining(), 1e-3))
        self.armed = True

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._defer = True

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._resume()

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_training_stop:
            self.disarm()  # the stop's final save starts before the horizon and is paid for by the reserve
        elif control.should_save:
            self._defer = True

    def on_save(self, args, state, control, **kwargs):
        self._resume()

    def on_train_end(self, args, state, control, **kwargs):
        self.disarm()


class SaveCadenceCallback(TrainerCallback):
    """Request checkpoints: every ``every_steps`` optimizer steps and/or every ``every_minutes`` (0 = off)
    while the training window's used share is below the first of ``hedge_fractions``, then once as
    the share crosses each hedge fraction; the deadline's own stop adds the final export.

    The orchestrator scores the highest three ``checkpoint-<step>`` exports and keeps the best, so with
    ``hedge_fractions=(0.8, 0.9)`` and three exports kept these are the ones at ~0.8, ~0.9 and 1.0 of
    the window: a late collapse still leaves earlier candidates. ``fraction`` returns that share (the trainer's
    ``time_fraction``: the run's window across resumes; ``resume_at`` marks the hedges a resumed save had passed); an
    empty ``hedge_fractions`` keeps the cadence to the end.
    """

    def __init__(self, every_steps: int = 0, every_minutes: float = 0.0, clock: Callable[[], float] = time.time,
                 sync: Callable[[bool], bool] | None = None, hedge_fractions: tuple[float, ...] = (),
                 fraction: Callable[[], float] | None = None):
        self.every_steps, self.every_minutes, self.clock, self.sync = every_steps, every_minutes, clock, sync
        self.hedges = sorted(hedge_fractions)
        if self.hedges and (fraction is None or not all(0.0 < h < 1.0 for h in self.hedges)):
            raise ValueError(f"hedge_fractions must lie in (0, 1) and need a fraction() clock, got {hedge_fractions}")
        self.fraction = fraction
        self._last_save = clock()
        self._hedges_done = 0
        self._covered: list[float] = []  # hedges crossed since the last save: the next save is theirs

    @property
    def crossed(self) -> list[float]:
        """The hedge fractions a finished step has crossed so far (this process's clock)."""
        return self.hedges[:self._hedges_done]

    def resume_at(self, fraction: float) -> None:
        """A resumed run: the hedges at or below ``fraction`` (the run's share at the resumed save) were crossed
        before it, and their exports are on disk; none is due again."""
        while self._hedges_done < len(self.hedges) and self.hedges[self._hedges_done] <= fraction:
            self._hedges_done += 1
        self._covered = []

    def take_covered(self) -> list[float]:
        """The hedges the save being written covers (crossed since the previous save), and forget them; the
        trainer writes them into ``exports.jsonl`` so a report reads which save was which hedge's."""
        out, self._covered = self._covered, []
        return out

    def on_step_end(self, args, state, control, **kwargs):
        f = self.fraction() if self.fraction is not None else 0.0
        crossed = 0
        while self._hedges_done + crossed < len(self.hedges) and f >= self.hedges[self._hedges_done + crossed]:
            crossed += 1  # a step longer than a hedge gap crosses several: one export covers them
        if self.hedges and f >= self.hedges[0]:
            due = crossed > 0
        else:
            due = bool(self.every_minutes) and self.clock() - self._last_save >= 60.0 * self.every_minutes
            due = due or bool(self.every_steps and state.global_step % self.every_steps == 0)
        if self.sync is not None:
            due = self.sync(due)  # saving has collectives: all ranks must agree (see DeadlineCallback)
        self._covered += self.hedges[self._hedges_done:self._hedges_done + crossed]
        self._hedges_done += crossed
        if due:
            control.should_save = True
        return control

    def on_save(self, args, state, control, **kwargs):
        self._last_save = self.clock()
        return control


#: TRL's own metric names mapped to the names this project documents (both are written).
ALIASES = {"completions/clipped_ratio": "completions/clip_rate", "step_time": "time/step_trl"}


class MetricsJsonlCallback(TrainerCallback):
    """Append one JSON object per logged optimizer step to ``path`` (main process only).

    Keys: everything the trainer logs (``loss``, ``grad_norm``, ``learning_rate``, TRL's and
    OPDTrainer's slash-named metrics), plus ``step``, ``wall_s`` (seconds since ``start_time``),
    ``time`` (Unix) and the static fields in ``static`` (e.g. ``engine``). NaN/inf become null so every line is
    strict JSON. End-of-training summaries (``train_runtime`` ...) are not per-step and are skipped.

    On (re)start the file keeps only rows up to the step training starts from (the resumed state's
    step, 0 for a fresh start), one per step: steps a killed run logged after its last resume state
    are run again, and would otherwise appear twice.
    """

    def __init__(self, path: Path, start_time: float, static: dict[str, Any] | None = None):
        self.path, self.start_time, self.static = Path(path), start_time, dict(static or {})
        self._last_step = -1

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero or not self.path.exists():
            return control
        from data_tools.runio import write_text

        rows: dict[int, str] = {}
        for line in self.path.read_text().splitlines():
            try:
                step = json.loads(line)["step"]
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a line cut short by a kill
            if step <= state.global_step:
                rows[step] = line  # the last record of a step wins
        write_text("".join(rows[k] + "\n" for k in sorted(rows)), self.path)
        self._last_step = state.global_step
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "loss" not in logs:
            return control
        if state.global_step == self._last_step:
            return control
        self._last_step = state.global_step
        row: dict[str, Any] = {"step": state.global_step, "wall_s": round(time.time() - self.start_time, 3),
                               "time": round(time.time(), 3), **self.static}
        for k, v in logs.items():
            if isinstance(v, float) and not math.isfinite(v):
                v = None
            row[k] = v
            if k in ALIASES:
                row[ALIASES[k]] = v
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(row, default=float) + "\n")
        return control
