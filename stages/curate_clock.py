"""Stage one's share of the run's clock: its deadline, the size of each engine call, and the manifest's ``budget``
block.

**The clock** (``StageClock``). Stage one's budget ends at ``time_share`` x (T - R) on the run's clock (T =
``max_wall_time_seconds``, R = ``deadline_reserve_seconds``, which run.sh gives the evaluation reserve too): the
``deadline``. Until the measured problems give a curriculum row, stage one probes on even when the budget is spent
(engine start-up on a loaded machine can eat it), so that a curriculum exists, but never past ``hard_end`` =
max(``time_share``, ``FORCED_SHARE``) x (T - R): training keeps at least half its window (or what
``time_share`` leaves it, when that is less).

**The calls** (``ChunkBudget``). A chunk (``chunk_size`` problems) is what is saved and resumed; it is measured in
engine calls sized from the budget, never from the chunk alone:

- before a rate is measured, a probe of ``probe_size`` problems (default ``chunk_size`` / 8, rounded up); while
  no curriculum row exists yet (the caller's test: the band filter over what is measured), calls may run past the
  deadline until ``hard_end``, and probes go on there when the budget holds no sized call;
- then as many problems as the time left holds at the role's measured seconds a problem (the larger of its last call's
  and its mean, as ``DeadlineCallback`` estimates steps; a role not timed yet borrows the other's, scaled by the
  sample counts), capped by the rest of the chunk. An engine that cannot stop a call in flight is sized on the worst
  case: every sample at ``max_tokens`` (the measured rate times ``max_tokens`` over the mean sample length);
- a call in flight stops at the deadline (``generate(stop_at=...)``, the hf engine's decoder and vLLM's request API):
  its finished samples are kept, the unfinished dropped and counted, and stage one ends there.

Without a clock every chunk is one call.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from data_tools.clock import run_start_time
from stages.curate_config import CurateConfig

#: The share of the training window (T - R) that stage one's first calls (its probes) may reach past a spent budget.
FORCED_SHARE = 0.5
#: The default probe: chunk_size / PROBE_DIVISOR problems, rounded up.
PROBE_DIVISOR = 8


@dataclass(frozen=True)
class StageClock:
    """Stage one's times on the run's clock (Unix seconds): its start, the budget's end (``deadline``) and the end
    its probes may reach (``hard_end``); both None without a clock."""

    clock0: float
    deadline: float | None
    hard_end: float | None


def stage_clock(cfg: CurateConfig, t_start: float, *, announce: bool) -> StageClock:
    """Stage one's clock from its config (``announce``: print the budget line)."""
    clock0 = run_start_time()
    if not cfg.max_wall_time_seconds:
        return StageClock(clock0, None, None)
    window = cfg.max_wall_time_seconds - cfg.deadline_reserve_seconds
    deadline = clock0 + cfg.time_share * window
    hard_end = clock0 + max(cfg.time_share, FORCED_SHARE) * window
    if announce:
        need = "a verified teacher solution" if cfg.filter == "none" else "a curriculum row"
        print(f"[curate] budget: until {deadline - clock0:.0f}s on the run's clock (time_share {cfg.time_share:g} x "
              f"{window:.0f}s), {t_start - clock0:.0f}s of it already used; engine calls sized to it (a probe of "
              f"{probe_size(cfg)} problem(s) first); until {need} exists, probes run past it, never past "
              f"{hard_end - clock0:.0f}s", flush=True)
    return StageClock(clock0, deadline, hard_end)


def probe_size(cfg: CurateConfig) -> int:
    """Problems in the first call of a role, before its rate is measured."""
    return cfg.probe_size or max(1, math.ceil(cfg.chunk_size / PROBE_DIVISOR))


@dataclass(frozen=True)
class Call:
    """One measured engine call of a role: problems, seconds, completion tokens and samples kept."""

    prompts: int
    seconds: float
    tokens: int
    samples: int


class ChunkBudget:
    """Sizes stage one's engine calls so they end by ``deadline`` (Unix time; None = no clock), and totals what they
    generated (the rates evaluation estimates read). See the module docstring for the rule.

    Args:
        deadline: the budget's end.
        samples: samples a problem, per role (``{"teacher": 4, "student": 8}``).
        clock: the time function (tests pass a fake one).
        hard_end: where forced calls (``plan(forced=True)``: no curriculum row yet) must end; default ``deadline``.
        probe: problems in a probe.
        max_tokens: the completion cap (the worst case of an engine that cannot stop a call).
    """

    def __init__(self, deadline: float | None, samples: dict[str, int], clock=None, *, hard_end: float | None = None,
                 probe: int = 1, max_tokens: int | None = None):
        self.deadline, self.samples, self.clock = deadline, samples, clock or time.time
        self.hard_end = deadline if hard_end is None else hard_end
        self.probe, self.max_tokens = max(1, int(probe)), max_tokens
        self.calls: dict[str, list[Call]] = {role: [] for role in samples}
        self.tokens, self.gen_s = 0, 0.0
        self.stop_reason: str | None = None
        self.dropped = 0  # samples of calls stopped in flight

    def measured(self, role: str) -> bool:
        return bool(self.calls[role])

    def per_prompt(self, role: str) -> float:
        """Expected seconds a problem of ``role``'s next call; 0.0 when no role has been timed."""
        c = self.calls[role]
        if c:
            return max(c[-1].seconds / max(c[-1].prompts, 1), sum(x.seconds for x in c) / max(sum(x.prompts for x in c), 1))
        for other, oc in self.calls.items():
            if oc:
                return self.per_prompt(other) * self.samples[role] / self.samples[other]
        return 0.0

    def worst(self, roles: list[str]) -> float:
        """``max_tokens`` over the mean length of the samples measured for ``roles`` (at least 1): how much longer a
        call lasts when every sample runs to the cap."""
        kept = [x for r in roles for x in self.calls[r]]
        tokens, samples = sum(x.tokens for x in kept), sum(x.samples for x in kept)
        if not self.max_tokens or not tokens or not samples:
            return 1.0
        return max(1.0, self.max_tokens / (tokens / samples))

    def plan(self, roles: list[str], rest: int, *, forced: bool = False, interruptible: bool = True,
             deadline: float | None = None, hard_end: float | None = None) -> tuple[int, float | None]:
        """``(problems, stop_at)`` of the next call of each of ``roles`` (one after another, on the same problems), at
        most ``rest``; ``(0, None)``: stage one stops, ``stop_reason`` says why. ``forced``: no curriculum row exists
        yet (the caller knows), so the call may run until ``hard_end``, and when the budget holds no sized call, a
        probe still runs. ``deadline`` / ``hard_end`` default to the budget's (a separate teacher gets its share)."""
        deadline = self.deadline if deadline is None else deadline
        if deadline is None:
            return rest, None
        hard = self.hard_end if hard_end is None else hard_end
        end = hard if forced else deadline
        now = self.clock()
        what = "+".join(roles)
        per = sum(self.per_prompt(r) for r in roles)
        if per > 0 and now < deadline:  # a call sized to the budget's time left
            k = min(rest, int((deadline - now) // (per if interruptible else per * self.worst(roles))))
            if k >= 1:
                return k, end
        if (per <= 0 or forced) and now < end:  # nothing timed yet, or no curriculum yet: a probe
            return min(rest, self.probe), end
        if forced:
            self.stop_reason = (f"no time left for stage one's first {what} calls: the end of its probes (a share "
                                f"{FORCED_SHARE:g} of the training window) has passed")
        elif now >= deadline:
            self.stop_reason = f"budget: spent before the next {what} call"
        else:
            per_s = per if interruptible else per * self.worst(roles)
            self.stop_reason = (f"budget: the next {what} call of one problem needs ~{per_s:.0f}s, "
                                f"{deadline - now:.0f}s left")
        return 0, None

    def record(self, role: str, prompts: int, seconds: float, tokens: int, samples: int) -> None:
        self.calls[role].append(Call(prompts, seconds, tokens, samples))
        self.tokens += tokens
        self.gen_s += seconds

    def cut(self, role: str, where: str, kept: int, dropped: int) -> str:
        """A call stopped in flight at its deadline: the stop reason, and the one line that says it."""
        self.dropped += dropped
        self.stop_reason = (f"deadline: the {role} call of {where} stopped in flight, {kept} finished samples kept, "
                            f"{dropped} unfinished dropped")
        return f"[curate] stage one's deadline stopped the {role} call of {where} in flight: {kept} finished " \
               f"samples kept, {dropped} unfinished dropped"


def budget_record(cfg: CurateConfig, budget, timings: dict, rollouts: pa.Table, manifest_path: Path, *,
                  clock: StageClock, t_start: float, n_chunks: int, measured: int, partial: int,
                  chunks: dict[str, int], problems: tuple[int, int], mean_role: str = "student") -> dict:
    """The manifest's ``budget`` block: the clock stage one had and used, what it measured, and the
    measured rates (completion tokens/s, engine start-up, mean length) that run.sh's evaluation
    estimate reads; a run that generated nothing keeps the rates of the manifest it resumed. The mean length is the
    student's samples' (evaluation samples the student), ``mean_role``'s where the student was not sampled (``filter:
    none``: the teacher's, the nearest measured length; ``mean_completion_tokens_of`` says whose)."""
    student = rollouts.filter(pa.compute.equal(rollouts["role"], mean_role))
    prev = {}
    if manifest_path.exists():
        with contextlib.suppress(ValueError, OSError):
            prev = json.loads(manifest_path.read_text()).get("budget") or {}
    clock0 = clock.clock0
    return {"clock_start": clock0, "time_share": cfg.time_share, "max_wall_time_seconds": cfg.max_wall_time_seconds,
            "deadline_reserve_seconds": cfg.deadline_reserve_seconds,
            "budget_end_s": None if clock.deadline is None else round(clock.deadline - clock0, 1),
            "probe_end_s": None if clock.hard_end is None else round(clock.hard_end - clock0, 1),
            "probe_size": probe_size(cfg),
            "ended_at_s": round(time.time() - clock0, 1), "setup_s": round(t_start - clock0, 1),
            "chunks": n_chunks, "chunks_measured": measured, "chunks_partial": partial,
            "teacher_chunks": chunks["teacher"], "student_chunks": chunks["student"], "problems_measured": problems[0],
            "problems_unmeasured": problems[1] - problems[0],
            "stop_reason": budget.stop_reason or "every problem measured", "dropped_samples": budget.dropped,
            "completion_tokens": budget.tokens, "generation_s": round(budget.gen_s, 1),
            "completion_tokens_per_s": round(budget.tokens / budget.gen_s, 1) if budget.gen_s > 0 else prev.get("completion_tokens_per_s"),
            "engine_startup_s": timings.get("engine_startup_s", prev.get("engine_startup_s")),
            "mean_completion_tokens": round(pa.compute.mean(student["n_tokens"]).as_py() or 0.0, 1) if student.num_rows else None,
            "mean_completion_tokens_of": mean_role}


def budget_line(b: dict, engine_started: bool = True) -> str:
    """One line on this run's clock. ``engine_started`` False (every chunk was on disk, or the budget was spent
    before stage one began: ``stop_reason`` says which): the record's start-up and rate are an earlier run's (kept
    for run.sh's estimate) and are not printed as this run's."""
    end = "no clock" if b["budget_end_s"] is None else f"budget until {b['budget_end_s']:.0f}s"
    tps = b["completion_tokens_per_s"]
    spent = (f"engine start-up {b['engine_startup_s'] or 0:.0f}s, generation {b['generation_s']:.0f}s at "
             f"{tps or 0:.0f} completion tok/s" if engine_started else "no engine started this run")
    partial = f" + {b['chunks_partial']} in part" if b.get("chunks_partial") else ""
    return (f"[curate] clock: {end}, stage one ended at {b['ended_at_s']:.0f}s on the run's clock (set-up {b['setup_s']:.0f}s, "
            f"{spent}); measured {b['chunks_measured']}/{b['chunks']} chunks{partial} = "
            f"{b['problems_measured']} problems ({b['problems_unmeasured']} not measured); {b['stop_reason']}")
