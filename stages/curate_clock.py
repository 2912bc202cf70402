"""Stage one's share of the run's clock: its deadline, which chunks it admits, and the manifest's ``budget`` block."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import pyarrow as pa

from data_tools.clock import run_start_time
from stages.curate_config import CurateConfig


class ChunkBudget:
    """Admits stage one's chunks while their expected end stays before ``deadline`` (Unix time; None = no clock).

    The expected time of a role's next chunk is the larger of its last and its mean measured chunk
    time (as ``DeadlineCallback`` estimates steps); a role not timed yet borrows another role's mean
    scaled by the sample counts, else it is unknown (0). ``forced`` admits regardless: the first
    chunk of each role always runs, so a curriculum exists even when engine start-up ate the budget.
    Also totals the measured generation (tokens, seconds) that evaluation estimates read.
    """

    def __init__(self, deadline: float | None, samples: dict[str, int], clock=None):
        self.deadline, self.samples, self.clock = deadline, samples, clock or time.time
        self.durations: dict[str, list[float]] = {role: [] for role in samples}
        self.tokens, self.gen_s = 0, 0.0
        self.stop_reason: str | None = None

    def expected(self, role: str) -> float:
        d = self.durations[role]
        if d:
            return max(d[-1], sum(d) / len(d))
        for other, od in self.durations.items():
            if od:
                return sum(od) / len(od) * self.samples[role] / self.samples[other]
        return 0.0

    def admits(self, roles: list[str], *, forced: bool = False, deadline: float | None = None) -> bool:
        deadline = self.deadline if deadline is None else deadline
        if deadline is None or forced:
            return True
        need = sum(self.expected(r) for r in roles)
        if self.clock() + need <= deadline:
            return True
        self.stop_reason = (f"budget: next {'+'.join(roles)} chunk needs ~{need:.0f}s, "
                            f"{max(deadline - self.clock(), 0):.0f}s left")
        return False

    def record(self, role: str, seconds: float, tokens: int) -> None:
        self.durations[role].append(seconds)
        self.tokens += tokens
        self.gen_s += seconds

def _budget_record(cfg: CurateConfig, budget: ChunkBudget, timings: dict, rollouts: pa.Table, manifest_path: Path, *,
                   clock0: float, t_start: float, deadline: float | None, n_chunks: int, measured: int,
                   chunks: dict[str, int], problems: tuple[int, int]) -> dict:
    """The manifest's ``budget`` block: the clock stage one had and used, what it measured, and the
    measured rates (completion tokens/s, engine start-up, mean length) that run.sh's evaluation
    estimate reads; a run that generated nothing keeps the rates of the manifest it resumed."""
    student = rollouts.filter(pa.compute.equal(rollouts["role"], "student"))
    prev = {}
    if manifest_path.exists():
        with contextlib.suppress(ValueError, OSError):
            prev = json.loads(manifest_path.read_text()).get("budget") or {}
    return {"clock_start": clock0, "time_share": cfg.time_share, "max_wall_time_seconds": cfg.max_wall_time_seconds,
           "deadline_reserve_seconds": cfg.deadline_reserve_seconds,
           "budget_end_s": None if deadline is None else round(deadline - clock0, 1),
           "ended_at_s": round(time.time() - clock0, 1), "setup_s": round(t_start - clock0, 1),
           "chunks": n_chunks, "chunks_measured": measured, "teacher_chunks": chunks["teacher"],
           "student_chunks": chunks["student"], "problems_measured": problems[0], "problems_unmeasured": problems[1] - problems[0],
           "stop_reason": budget.stop_reason or "every problem measured",
           "completion_tokens": budget.tokens, "generation_s": round(budget.gen_s, 1),
           "completion_tokens_per_s": round(budget.tokens / budget.gen_s, 1) if budget.gen_s > 0 else prev.get("completion_tokens_per_s"),
           "engine_startup_s": timings.get("engine_startup_s", prev.get("engine_startup_s")),
           "mean_completion_tokens": round(pa.compute.mean(student["n_tokens"]).as_py() or 0.0, 1) if student.num_rows else None}


def _budget_line(b: dict, engine_started: bool = True) -> str:
    """One line on this run's clock. ``engine_started`` False (every chunk was on disk, or the budget was spent
    before stage one began: ``stop_reason`` says which): the record's start-up and rate are an earlier run's (kept
    for run.sh's estimate) and are not printed as this run's."""
    end = "no clock" if b["budget_end_s"] is None else f"budget until {b['budget_end_s']:.0f}s"
    tps = b["completion_tokens_per_s"]
    spent = (f"engine start-up {b['engine_startup_s'] or 0:.0f}s, generation {b['generation_s']:.0f}s at "
             f"{tps or 0:.0f} completion tok/s" if engine_started else "no engine started this run")
    return (f"[curate] clock: {end}, stage one ended at {b['ended_at_s']:.0f}s on the run's clock (set-up {b['setup_s']:.0f}s, "
            f"{spent}); measured {b['chunks_measured']}/{b['chunks']} chunks = "
            f"{b['problems_measured']} problems ({b['problems_unmeasured']} not visited); {b['stop_reason']}")

def _clock(cfg: CurateConfig, t_start: float, *, announce: bool) -> tuple[float, float | None]:
    """The run clock's start and stage one's deadline (None: no clock); ``announce`` prints the budget line."""
    clock0 = run_start_time()
    window = cfg.max_wall_time_seconds - cfg.deadline_reserve_seconds
    deadline = clock0 + cfg.time_share * window if cfg.max_wall_time_seconds else None
    if announce and deadline is not None:
        print(f"[curate] budget: until {deadline - clock0:.0f}s on the run's clock (time_share {cfg.time_share:g} x "
              f"{window:.0f}s), {t_start - clock0:.0f}s of it already used", flush=True)
    return clock0, deadline
