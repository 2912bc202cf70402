"""One wall clock for the whole run: where it starts, and how ``run.sh`` splits it between stages.

``run.sh`` records its own start as ``OPD_RUN_START`` (Unix seconds) before set-up, and every stage
counts from it (:func:`run_start_time`), so MAX_WALL_TIME_SECONDS is the run's, not a stage's. A
stage started by hand has no ``OPD_RUN_START`` and counts from its own process start.

The split (README, "The formal run"), all times counted from the run's start, T =
MAX_WALL_TIME_SECONDS, R = DEADLINE_RESERVE_SECONDS, E = the time kept for evaluation (recipes that
reserve it; 0 for recipes that evaluate only if time is left):

    [0, share * (T - R - E)]      set-up and stage one (stage one stops starting chunks at its end)
    [.., T - R - E]               training (stops before a step would cross it)
    [T - R - E, T - E]            the final export (the reserve R pays for it)
    [T - E, T]                    evaluation and report

The CLI is for ``run.sh`` and imports nothing heavy (no torch, no trl), so ``run.sh --plan`` is fast:

    python -m data_tools.clock plan --recipe NAME --curate C.yaml --train T.yaml --protocols "a b" --eval reserve:240
    python -m data_tools.clock shell ...same flags...        # KEY=VALUE lines for run.sh
    python -m data_tools.clock eval-estimate --manifest curate/manifest.json --protocol P --models 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Mapping

import yaml

RUN_START_ENV = "OPD_RUN_START"

#: Stage one's default share of the clock before training (CurateConfig.time_share). Why 0.2 for the
#: formal recipe (bench/results/setup.md has the arithmetic, from estimated H200 rates): it measures
#: ~2,300 problems (~1,150 curriculum rows) and ends after ~1.4 h, leaving ~1,250-1,850 training steps at the
#: reference recipe's 20-30 s a step (~250 at the no-vLLM path's measured 121.5 s, RESULTS.md run 10)
#: that revisit a row about every 36 steps; each further 0.1 costs ~100 steps (7% of training) for
#: ~580 rows, diversity that on-policy steps, which sample afresh at every visit, need less than steps.
DEFAULT_CURATE_SHARE = 0.2
#: The clock's defaults, owned here: ``OPDConfig`` (training) and ``resolve_clock`` (run.sh, when a recipe's
#: train YAML does not set the clock) read these. Seconds.
DEFAULT_MAX_WALL_S = 43200.0
DEFAULT_RESERVE_S = 600.0
#: ``CurateConfig``'s default clock and reserve: none. Stage one without a clock measures every problem and ends on
#: its own; training has no end but its clock, hence its 12 h default. run.sh gives both stages the run's clock.
NO_CLOCK = 0.0
#: Evaluation estimates: safety factor on the measured rates, and the report's allowance (seconds).
EVAL_SAFETY = 1.25
REPORT_S = 15.0

_IMPORT_TIME = time.time()


def run_start_time(env: Mapping[str, str] | None = None) -> float:
    """Unix time the run's clock counts from: ``$OPD_RUN_START`` if set, else this process's start.

    Raises:
        ValueError: ``OPD_RUN_START`` is not a number, or lies in the future.
    """
    env = os.environ if env is None else env
    raw = env.get(RUN_START_ENV, "").strip()
    if raw:
        try:
            t = float(raw)
        except ValueError:
            raise ValueError(f"{RUN_START_ENV}={raw!r} is not a Unix time in seconds") from None
        if not math.isfinite(t) or t > time.time() + 5:
            raise ValueError(f"{RUN_START_ENV}={raw!r} lies in the future")
        return t
    try:
        import psutil  # here: optional for the clock (without it, it counts from this module's import)

        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - psutil missing: fall back to this module's import time
        return _IMPORT_TIME


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A config file's YAML mapping; ``ValueError`` naming the file when it is missing or not a mapping."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise ValueError(f"config file not found: {path}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a YAML mapping")
    return data


def _num(value: Any, what: str) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number of seconds, got {value!r}") from None
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    return x


def resolve_clock(train_cfg: str | Path, env: Mapping[str, str] | None = None) -> tuple[float, float]:
    """``(T, R)``: MAX_WALL_TIME_SECONDS / DEADLINE_RESERVE_SECONDS from the environment, else the
    training recipe's YAML, else OPDConfig's defaults (the same precedence as ``parse_config``)."""
    env = os.environ if env is None else env
    y = read_yaml(train_cfg)
    t = _num(env.get("MAX_WALL_TIME_SECONDS") or y.get("max_wall_time_seconds", DEFAULT_MAX_WALL_S),
             "MAX_WALL_TIME_SECONDS")
    r = _num(env.get("DEADLINE_RESERVE_SECONDS") or y.get("deadline_reserve_seconds", DEFAULT_RESERVE_S),
             "DEADLINE_RESERVE_SECONDS")
    if t <= 0 or r >= t:
        raise ValueError(f"need MAX_WALL_TIME_SECONDS > DEADLINE_RESERVE_SECONDS >= 0, got {t:g} and {r:g}")
    return t, r


def parse_eval_policy(policy: str) -> tuple[str, float]:
    """``"reserve:240"`` -> ("reserve", 240.0): keep 240 s of the clock for evaluation (until stage one
    has measured the machine); ``"if_time"`` -> ("if_time", 0.0): evaluate only with time left over."""
    if policy == "if_time":
        return "if_time", 0.0
    m = re.fullmatch(r"reserve:(\d+(?:\.\d+)?)", policy)
    if not m:
        raise ValueError(f"eval policy must be 'if_time' or 'reserve:<seconds>', got {policy!r}")
    return "reserve", float(m.group(1))


def split(t: float, r: float, e: float, share: float) -> dict[str, float]:
    """The clock's split in seconds from the run start (see the module docstring).

    Raises:
        ValueError: ``share`` outside (0, 1], or R + E leaves no time for stage one and training.
    """
    if not 0.0 < share <= 1.0:
        raise ValueError(f"time_share must lie in (0, 1], got {share}")
    train_end = t - r - e
    if train_end <= 0:
        hint = (f"; set MAX_WALL_TIME_SECONDS above {r + e:g}, or keep no evaluation time with EVAL_PROTOCOLS= "
                f"(empty: no evaluation)" if e else f"; set MAX_WALL_TIME_SECONDS above {r:g} or lower "
                f"DEADLINE_RESERVE_SECONDS")
        raise ValueError(f"MAX_WALL_TIME_SECONDS={t:g} leaves nothing after the reserve {r:g}s and "
                         f"the evaluation reserve {e:g}s{hint}")
    curate_end = share * train_end
    return {"clock_s": t, "reserve_s": r, "eval_reserve_s": e, "curate_end_s": curate_end,
            "train_end_s": train_end, "export_end_s": t - e, "curate_budget_s": curate_end,
            "train_budget_s": train_end - curate_end}


def protocol_size(protocol: str, repo: Path) -> dict[str, Any]:
    """``{n_problems, n_samples, max_tokens}`` of a declared protocol (``configs/eval/<name>.yaml``);
    a ``synth:<split>:<n>`` question set counts n problems."""
    path = Path(protocol) if protocol.endswith((".yaml", ".yml")) else repo / "configs" / "eval" / f"{protocol}.yaml"
    y = read_yaml(path)
    n = y.get("n_problems")
    if n is None:
        m = re.fullmatch(r"synth:\w+:(\d+)", str(y.get("eval_data") or ""))
        n = int(m.group(1)) if m else None
    if n is None:
        raise ValueError(f"protocol {path} states neither n_problems nor a synth:<split>:<n> eval_data")
    return {"n_problems": int(n), "n_samples": int(y["n_samples"]), "max_tokens": int(y["max_tokens"])}


def eval_estimate(manifest: Mapping[str, Any], size: Mapping[str, Any], n_models: int, workers: int = 1) -> float:
    """Seconds to evaluate ``n_models`` models on a protocol of ``size``, from stage one's measured rates.

    Per model: engine start-up + n_problems x n_samples x L / (tokens_per_s x workers) (stage one's rate is one
    engine's: completion tokens over its generation seconds; ``workers`` engines share a protocol), with L = min(max_tokens,
    1.5 x stage one's mean completion length) and the rates from ``manifest["budget"]``; times
    ``EVAL_SAFETY``, plus ``REPORT_S``. An estimate, not a bound: long-tail completions can exceed it.

    Raises:
        ValueError: the manifest has no measured rates (stage one generated nothing this run or before).
    """
    b = manifest.get("budget") or {}
    tps, startup, mean_len = b.get("completion_tokens_per_s"), b.get("engine_startup_s"), b.get("mean_completion_tokens")
    if not tps or mean_len is None or startup is None:
        raise ValueError("stage one's manifest has no measured generation rate")
    length = min(float(size["max_tokens"]), 1.5 * float(mean_len))
    per_model = float(startup) + size["n_problems"] * size["n_samples"] * length / (float(tps) * max(workers, 1))
    return EVAL_SAFETY * n_models * per_model + REPORT_S


def _plan(ns: argparse.Namespace) -> dict[str, Any]:
    kind, e = parse_eval_policy(ns.eval)
    if not ns.protocols.split():
        e = 0.0  # nothing to evaluate: nothing to keep
    t, r = resolve_clock(ns.train)
    curate = read_yaml(ns.curate)
    share = float(curate.get("time_share", DEFAULT_CURATE_SHARE))
    return {"recipe": ns.recipe, "curate_config": ns.curate, "train_config": ns.train, "protocols": ns.protocols.split(),
            "eval_policy": kind, "curate_share": share, "curate_filter": str(curate.get("filter") or "pass_rate"),
            **split(t, r, e, share)}


def _print_plan(p: dict[str, Any]) -> None:
    f = lambda x: f"{x:8.0f} s"  # noqa: E731
    ev = (f"{f(p['eval_reserve_s'])}  reserved (re-estimated from stage one's measured rates)"
          if p["eval_policy"] == "reserve" else "       0 s  reserved: each evaluation runs only if the time left covers its estimate")
    print(f"recipe {p['recipe']}")
    what = {"none": "filter none: the teacher alone samples, every problem a row"}.get(p.get("curate_filter", ""),
                                                                                        "the student's pass-rate filter")
    print(f"  stage one   {p['curate_config']}  ({what})")
    print(f"  training    {p['train_config']}")
    print(f"  evaluation  {' '.join('configs/eval/' + x + '.yaml' for x in p['protocols']) or '(none)'}")
    print(f"clock (from run.sh's start, set-up included): MAX_WALL_TIME_SECONDS = {p['clock_s']:.0f} s, "
          f"DEADLINE_RESERVE_SECONDS = {p['reserve_s']:.0f} s")
    print(f"  set-up + stage one {f(p['curate_budget_s'])}  (share {p['curate_share']:g} of {p['train_end_s']:.0f} s; "
          f"ends at {p['curate_end_s']:.0f} s)")
    print(f"  training           {f(p['train_budget_s'])}  (at least; stops by {p['train_end_s']:.0f} s, "
          f"stage one's unused time included)")
    print(f"  final export       {f(p['reserve_s'])}  (done by {p['export_end_s']:.0f} s)")
    print(f"  evaluation+report  {ev}")


def eval_reserve(all_s: int, final_s: int, left_s: int) -> tuple[int, str]:
    """Seconds of the clock kept after training for evaluation, once stage one has measured the rates, and why.

    ``all_s``: every evaluation the recipe runs after training (the final export and the start model);
    ``final_s``: the final export's alone; ``left_s``: the clock left before the final reserve. The two evaluations
    are the comparison the README promises: they are kept together when training keeps at least half of what is left.
    Otherwise the final export's alone is kept (the start model's runs afterwards if the time left covers it): a
    reserve that leaves training too little for a step makes a run whose export is the start model, and comparing the
    start model with itself tells nothing. A reserve that no evaluation could run in is not kept: when even the final
    export's evaluation needs more than is left, training takes all of it (evaluation still runs afterwards if the
    time left then covers it). A run that then trains no step evaluates the start model alone (its export is it).
    """
    left_s = max(int(left_s), 0)
    if final_s > left_s:
        return 0, (f"the final export's evaluation alone needs ~{final_s}s and {left_s}s are left: no evaluation reserve, "
                   "training takes the time")
    if all_s <= left_s // 2:
        return int(all_s), f"from stage one's measured rates: ~{final_s}s for the final export alone"
    return int(final_s), (f"both evaluations need ~{all_s}s and {left_s}s are left: the final export's alone is kept "
                          f"(~{final_s}s), training gets the other {left_s - int(final_s)}s; the start model's runs if "
                          "time is left")


def main(argv: list[str] | None = None) -> int:
    """CLI for run.sh; errors are one line on stderr with exit code 2."""
    ap = argparse.ArgumentParser(prog="python -m data_tools.clock")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("plan", "shell"):
        s = sub.add_parser(name)
        s.add_argument("--recipe", required=True)
        s.add_argument("--curate", required=True)
        s.add_argument("--train", required=True)
        s.add_argument("--protocols", default="")
        s.add_argument("--eval", default="if_time", help="if_time | reserve:<seconds>")
    s = sub.add_parser("eval-estimate")
    s.add_argument("--manifest", required=True)
    s.add_argument("--protocol", required=True)
    s.add_argument("--models", type=int, default=1)
    s.add_argument("--workers", type=int, default=1, help="engine workers sharing each evaluation (one a GPU)")
    s = sub.add_parser("eval-reserve", help="seconds kept for evaluation after training, then why (two lines)")
    s.add_argument("--all", type=int, required=True, help="seconds of every evaluation after training")
    s.add_argument("--final", type=int, required=True, help="seconds of the final export's evaluation alone")
    s.add_argument("--left", type=int, required=True, help="seconds of the clock left before the final reserve")
    ns = ap.parse_args(argv)
    try:
        if ns.cmd == "eval-reserve":
            print("\n".join(map(str, eval_reserve(ns.all, ns.final, ns.left))))
            return 0
        if ns.cmd == "eval-estimate":
            manifest = json.loads(Path(ns.manifest).read_text())
            size = protocol_size(ns.protocol, Path(__file__).resolve().parents[1])
            print(math.ceil(eval_estimate(manifest, size, ns.models, ns.workers)))
            return 0
        p = _plan(ns)
        if ns.cmd == "plan":
            _print_plan(p)
        else:
            for k in ("clock_s", "reserve_s", "eval_reserve_s", "curate_budget_s", "train_end_s"):
                print(f"{k.upper()}={math.floor(p[k])}")
            print(f"CURATE_SHARE={p['curate_share']:g}")
        return 0
    except (ValueError, OSError, KeyError, json.JSONDecodeError) as e:
        print(f"clock: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
