"""The training clock of bench/learning.py: an arm's marks, its hand-over export, and its ``stages.train`` run.

Every arm trains for the same *training* seconds: ``MarkClock`` counts wall seconds and pauses while the model is
exported and evaluated at a mark, so evaluation never eats an arm's budget; ``train`` runs the product's stage two on
an arm's recipe under that clock.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bench.learning_config import HANDOVER_MARK

if TYPE_CHECKING:
    from bench.learning_config import LearningConfig


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class MarkClock:
    """Training clock of one arm: evaluates at each mark, pauses itself while evaluating, stops at the last.

    ``check(model, step)`` is called after every optimizer step. The clock counts wall seconds since
    ``start()`` (plus ``offset_s``, e.g. arm d's stage-one sampling done before its trainer exists)
    minus the seconds spent in ``eval_fn``. When it passes a mark, ``eval_fn(model, mark, train_s, step)``
    runs; after the last mark ``check`` returns True (stop training).
    """

    def __init__(self, marks: list[float], eval_fn, clock=time.perf_counter, sync=_sync):
        self.marks, self.eval_fn, self.clock, self.sync = list(marks), eval_fn, clock, sync
        self.next = 0
        self.paused = 0.0
        self.t0: float | None = None
        self.offset_s = 0.0

    def start(self, offset_s: float = 0.0) -> None:
        self.sync()
        self.t0, self.offset_s = self.clock(), offset_s

    def elapsed(self) -> float:
        return self.clock() - self.t0 - self.paused + self.offset_s

    @property
    def done(self) -> bool:
        return self.next >= len(self.marks)

    def check(self, model, step: int) -> bool:
        if self.t0 is None:
            self.start()
        self.sync()
        t = self.elapsed()
        while not self.done and t >= self.marks[self.next]:
            self.paused_call(self.eval_fn, model, self.marks[self.next], t, step)
            self.next += 1
        return self.done

    def paused_call(self, fn, *args) -> None:
        """``fn(*args)`` off the clock: its seconds are not training seconds (an export, an evaluation)."""
        e0 = self.clock()
        fn(*args)
        self.sync()
        self.paused += self.clock() - e0


def clock_fraction(clock: MarkClock, span_s: float, window: bool = False):
    """``time_fraction`` of an arm's trainer: the share of ``span_s`` training seconds its clock has run, in [0, 1].

    ``window``: the share of the arm's training window instead, from its first step (the clock's ``offset_s``: stage
    one's seconds, charged before the trainer starts) to ``span_s``, as the product's ``OPDTrainer.time_fraction``
    counts from training's start: a time schedule then warms up at the first step and decays to 0 at ``span_s``.
    0 before the clock starts (a scheduler reads its factor when it is built). None when ``span_s`` is 0: a run cut by
    a step count alone (the start or the teacher built by ``--start_sft_steps`` / ``--teacher_sft_steps``) has no
    span, and its trainer keeps its own fraction.
    """
    if span_s <= 0:
        return None

    def fraction() -> float:
        if clock.t0 is None:
            return 0.0
        start = clock.offset_s if window else 0.0
        return min(1.0, max(0.0, (clock.elapsed() - start) / max(span_s - start, 1e-9)))

    return fraction


def train(cfg: LearningConfig, recipe: Path, marks: list[float], *, offset_s: float = 0.0, max_steps: int = 0,
          budget_s: float | None = None) -> list[dict]:
    """Run ``stages.train`` on ``recipe`` (YAML, parsed as the CLI parses it) under a ``MarkClock``.

    At each mark the model is exported (``trainers.callbacks.export_checkpoint``) to ``<output_dir>/marks/``
    while the clock is paused; after the last mark (or ``max_steps`` optimizer steps, when > 0: then one
    export at the stop) training stops. The off-policy share follows this clock over ``budget_s``.
    A sequential arm (``sft_max_epochs`` > 0) is also exported once at its hand-over, after its last off-policy
    step, as mark ``HANDOVER_MARK`` (-1), off the clock like the marks, so the on-policy phase's effect is measured
    from the model it started from rather than from the nearest mark.
    Returns one record per mark: ``mark_s``, ``train_s``, ``step``, ``path`` (the export).
    """
    from transformers import TrainerCallback

    from data_tools.config import parse_config
    from stages.train import run as train_stage
    from trainers.callbacks import export_checkpoint
    from trainers.opd_config import OPDConfig

    (args,) = parse_config([OPDConfig], ["--config", str(recipe)], env={})  # env={}: the recipe alone decides
    saved: list[dict] = []
    trainer_ref = []  # the trainer stage.train builds, from its hook: its tokenizer goes with every export

    def on_mark(model, mark, t, step):
        path = Path(args.output_dir) / "marks" / f"checkpoint-{step}"
        if not path.exists():
            export_checkpoint(model, trainer_ref[0].processing_class, path.parent, step, keep=10**6)
        saved.append(dict(mark_s=float(mark), train_s=round(float(t), 2), step=int(step), path=str(path)))

    clock = MarkClock([math.inf] if max_steps else marks, on_mark)

    class MarkCallback(TrainerCallback):
        def on_train_begin(self, a, state, control, model=None, **kw):
            clock.start(offset_s=offset_s)
            control.should_training_stop = clock.check(model, 0)  # stage one may have passed early marks

        def on_step_end(self, a, state, control, model=None, **kw):
            if clock.check(model, state.global_step):
                control.should_training_stop = True
            elif max_steps and state.global_step >= max_steps:
                t = clock.elapsed()
                on_mark(model, t, t, state.global_step)
                control.should_training_stop = True
            # the next step is the first on-policy one: export the model the on-policy phase starts from, once
            elif trainer_ref[0].sft_phase_done() and not any(s["mark_s"] == HANDOVER_MARK for s in saved):
                clock.paused_call(on_mark, model, HANDOVER_MARK, clock.elapsed(), state.global_step)

    def hook(trainer):
        trainer_ref.append(trainer)
        # the mix schedule follows this arm's training clock (evaluations paused), not the process's wall clock
        fraction = clock_fraction(clock, budget_s or max(marks), window=cfg.lr_scheduler_type != "constant")
        if fraction is not None:
            trainer.time_fraction = fraction
        trainer.add_callback(MarkCallback())

    train_stage(args, on_trainer=hook)
    _free()
    return saved


def _free():
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
