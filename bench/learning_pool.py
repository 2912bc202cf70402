"""Pool the arm runs of one learning experiment run over several leases (``--stage pool --pool_from DIR``).

A GPU lease rarely holds every run an experiment needs, so a later lease repeats the setup on a fresh machine and
runs the rest in a directory of its own. The setup is built by step count and reproduces exactly (LEARNING.md: the
start's and the teacher's evaluation completions matched, 1,200 of 1,200, on four machines), so the runs can be read
together, but only after checking that. :func:`plan` checks every source before anything is copied:

- the directories' settings agree on everything that defines an arm run (:data:`SETTINGS_FREE` lists what may
  differ: paths, the command's arm list, its deadline);
- the start's and the teacher's evaluations hold the same completions for the same problems and samples, each key
  once, graded alike where both store grades (the evidence that both are the same models under the same grader; a
  setup rebuilt with other data or steps fails here);
- each run to copy has a readable ``evals/<run>.parquet`` with every column the report reads, one name, each key
  once, graded columns true or false, finite numbers, every one of the experiment's marks and no other (a
  sequential run's hand-over aside), and at each mark exactly the (problem, sample) pairs the start was evaluated on;
- each run name is one the report reads, and no run is in two places (here, or two sources) with different results
  (a run already here with the same rows is skipped), and no run to copy has an unfinished ``arms/<run>/`` here
  (it is never deleted).

:func:`apply` then copies each run (``evals/<run>.parquet``, then ``arms/<run>/``, each under a temporary name and
renamed), removes a run's copied ``evals/`` again if its ``arms/`` copy fails or is interrupted (a process killed
between the two leaves a run without ``arms/``, which pooling the same source again completes), and
records each source that added something in ``pooled.json`` as it goes (with the source's own ``pooled.json``
records, so a run's origin is kept; the run being copied is named there before its copy starts).
Across leases a seconds-based run differs by its machine as it does by a seed (LEARNING.md, "Fresh machines"): the
report's paired standard errors do not include that.
"""

from __future__ import annotations

import filecmp
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.learning_config import parse_marks, upgrade_settings

# Settings that may differ between the directories pooled: where things live, what one command ran, its clock.
SETTINGS_FREE = frozenset({
    "out", "arms", "seeds", "runs", "deadline_s", "arm_overhead_s", "keep_final", "preset", "report_filter",
    "late_marks", "student_path", "start_path", "start_model", "teacher_model", "student_model", "gsm8k_dir",
    "fast_generation", "fast_generation_used", "contrasts", "gate_lead", "train_data", "test_data",
})
# Defaults of settings that older settings.json files lack (bench.learning.main reads them the same way).
SETTINGS_DEFAULTS = {"answer_filter": "math"}
SHARED_EVALS = ("student", "teacher")  # the setup's evaluations: compared, never copied
SETUP_COLUMNS = ("name", "mark_s", "problem_id", "sample_index", "completion")
# what bench.learning_report reads of an arm run's rows (a table lacking one would break every later report)
RUN_COLUMNS = SETUP_COLUMNS + ("train_s", "step", "n_tokens", "finish_reason", "correct_numeric", "correct_math")


@dataclass
class Plan:
    """What pooling ``src`` into ``dest`` will do (:func:`plan`)."""

    src: Path
    checked: list[str]
    copy: list[str] = field(default_factory=list)  # runs whose evals/ and arms/ are copied
    arms_only: list[str] = field(default_factory=list)  # runs already here whose arms/ is missing here
    skip: list[str] = field(default_factory=list)  # runs already here, whole
    source_log: list = field(default_factory=list)  # the source's own pooled.json: where its runs came from


def _json(path: Path, what: str):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found: {what}") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read as JSON ({e})") from None


def _settings(d: Path, defaults: dict | None = None) -> dict:
    """``d/settings.json`` under today's names (``upgrade_settings``), with what an older file lacks filled in:
    ``defaults`` (the config's), then :data:`SETTINGS_DEFAULTS` (what such files meant)."""
    s = _json(d / "settings.json", f"{d} is not a bench.learning run directory")
    if not isinstance(s, dict):
        raise ValueError(f"{d / 'settings.json'} is not a JSON object")
    return {**(defaults or {}), **SETTINGS_DEFAULTS, **upgrade_settings(s, d / "settings.json")}


def _table(path: Path, columns=SETUP_COLUMNS) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        t = pq.read_table(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found") from None
    except Exception as e:  # pyarrow raises its own types for a truncated or foreign file
        raise ValueError(f"{path} cannot be read as parquet ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    missing = [c for c in columns if c not in t.column_names]
    if missing:
        raise ValueError(f"{path} lacks the evaluation column(s) {', '.join(missing)}"
                         + (" (graded before both answer filters were stored: run --stage regrade on its directory)"
                            if {"correct_numeric", "correct_math"} & set(missing) else ""))
    return t.select(list(columns)).to_pylist()


def _keyed(path: Path, rows: list[dict], mark: bool = False) -> dict[tuple, dict]:
    """``rows`` by (mark_s if ``mark``, problem_id, sample_index). Raises ValueError naming ``path`` for a null key
    or a key twice."""
    out: dict[tuple, dict] = {}
    for r in rows:
        key = ((r["mark_s"],) if mark else ()) + (r["problem_id"], r["sample_index"])
        if any(k is None for k in key):
            raise ValueError(f"{path} has a row with a null mark_s, problem_id or sample_index")
        if key in out:
            raise ValueError(f"{path} holds problem {key[-2]!r} sample {key[-1]}"
                             + (f" at mark {key[0]:g}" if mark else "") + " twice")
        out[key] = r
    return out


GRADES = ("correct_numeric", "correct_math")


def _setup_rows(path: Path) -> dict[tuple, dict]:
    """A setup evaluation's rows by (problem_id, sample_index): the completion, and the grades where stored."""
    import pyarrow.parquet as pq

    cols = SETUP_COLUMNS + tuple(c for c in GRADES if c in pq.read_schema(path).names)
    return _keyed(path, _table(path, cols))


def _setting(key: str, value):
    """A setting as compared: ``marks`` by value ("10" and "10.0" are one mark list)."""
    if key == "marks" and isinstance(value, str):
        try:
            return tuple(parse_marks(value))
        except ValueError:
            return value
    return value


def check_run_rows(path: Path, rows: list[dict], run: str, keys: set[tuple], marks: set[float] | None,
                   optional: set[float] = frozenset()) -> None:
    """Raise ValueError naming ``path`` unless its rows are one run the report reads right: every row named ``run``,
    each (mark, problem, sample) once, graded columns true or false (never null or text), finite numbers where the
    report adds them up, a text ``finish_reason`` (the clip rate counts it), every one of ``marks`` present (when
    given) and no mark outside ``marks`` and ``optional`` (a sequential run's hand-over), and at each mark exactly
    the (problem, sample) ``keys`` the start was evaluated on: none missing, none extra (the report pairs runs over
    them and averages every row)."""
    names = {r["name"] for r in rows}
    if names != {run}:
        raise ValueError(f"{path}: its rows name {sorted(map(str, names))}, not its run {run!r}")
    for c in ("correct_numeric", "correct_math"):
        bad = sum(not isinstance(r[c], bool) for r in rows)
        if bad:
            raise ValueError(f"{path}: {bad} row(s) with {c} not true/false (null or another type)")
    for c in ("mark_s", "train_s", "step", "n_tokens"):
        bad = sum(isinstance(r[c], bool) or not isinstance(r[c], (int, float)) or not math.isfinite(r[c])
                  for r in rows)
        if bad:
            raise ValueError(f"{path}: {bad} row(s) with {c} not a finite number (null, NaN, infinite or text)")
    bad = sum(not isinstance(r["finish_reason"], str) for r in rows)
    if bad:
        raise ValueError(f"{path}: {bad} row(s) with finish_reason not text (null or another type)")
    keyed = _keyed(path, rows, mark=True)
    problems = {k[0] for k in keys}
    extra = {r["problem_id"] for r in rows} - problems
    if extra:
        raise ValueError(f"{path}: {len(extra)} problem(s) the start was not evaluated on (e.g. {sorted(extra)[0]!r})")
    by_mark: dict[float, set] = {}
    for m, pid, i in keyed:
        by_mark.setdefault(float(m), set()).add((pid, i))
    if marks is not None:
        fmt = lambda ms: ", ".join(f"{m:g}" for m in sorted(ms))  # noqa: E731
        off = set(by_mark) - set(marks) - set(optional)
        if off:
            raise ValueError(f"{path}: mark(s) {fmt(off)} s are not the experiment's marks ({fmt(marks)})"
                             + (f" or this run's hand-over ({fmt(optional)})" if optional else ""))
        lacking = set(marks) - set(by_mark)
        if lacking:
            raise ValueError(f"{path}: no evaluation at mark(s) {fmt(lacking)} s of the experiment's {fmt(marks)}: "
                             "an unfinished run, or one of another experiment")
    for m, have in sorted(by_mark.items()):
        missing, more = keys - have, have - keys
        if missing or more:
            pid, i = sorted(missing or more, key=str)[0]
            raise ValueError(f"{path}: at mark {m:g} s it " + (
                f"lacks {len(missing)} of the start's {len(keys)} (problem, sample) evaluations (e.g. problem {pid!r} "
                f"sample {i}): an unfinished or filtered evaluation" if missing else
                f"holds {len(more)} (problem, sample) evaluation(s) the start has not (e.g. problem {pid!r} sample "
                f"{i}): another number of samples than the start's {len(keys)}"))


def same_results(a: Path, b: Path) -> bool:
    """Whether two ``evals/<run>.parquet`` hold the same rows (equal bytes, or equal contents written otherwise)."""
    if filecmp.cmp(a, b, shallow=False):
        return True
    import pyarrow.parquet as pq

    ta, tb = pq.read_table(a), pq.read_table(b)
    if sorted(ta.column_names) != sorted(tb.column_names):
        return False
    key = lambda r: tuple(str(r[c]) for c in sorted(r))  # noqa: E731 - a row's total order, any column types
    return sorted(ta.to_pylist(), key=key) == sorted(tb.select(ta.column_names).to_pylist(), key=key)


def check_same_setup(dest: Path, src: Path, defaults: dict | None = None) -> tuple[list[str], set[tuple]]:
    """Raise unless ``src``'s arm runs can be read beside ``dest``'s; return the setup evaluations compared and the
    start's (problem_id, sample_index) keys.

    Raises:
        FileNotFoundError: either directory lacks ``settings.json`` or ``evals/student.parquet``, or one side has the
            teacher's evaluation and the other not.
        ValueError: a setting outside :data:`SETTINGS_FREE` differs (each named with both values); a file cannot be
            read; or the start's or the teacher's evaluation differs (rows on one side only, a key twice, or
            different completions: counted).
    """
    a, b = _settings(dest, defaults), _settings(src, defaults)
    differ = {k: (a.get(k), b.get(k)) for k in sorted((set(a) | set(b)) - SETTINGS_FREE)
              if _setting(k, a.get(k)) != _setting(k, b.get(k))}
    if differ:
        raise ValueError(f"cannot pool {src} into {dest}: settings differ: "
                         + "; ".join(f"{k} {va!r} vs {vb!r}" for k, (va, vb) in differ.items()))
    compared, keys = [], set()
    for name in SHARED_EVALS:
        pa_, pb = dest / "evals" / f"{name}.parquet", src / "evals" / f"{name}.parquet"
        if name == "student" or pa_.exists() or pb.exists():
            for p in (pa_, pb):
                if not p.exists():
                    raise FileNotFoundError(f"{p} not found: pooling compares the {name}'s evaluations of both "
                                            "directories to check that they ran the same setup")
            ra, rb = _setup_rows(pa_), _setup_rows(pb)
            ca, cb = ({k: r["completion"] for k, r in rows.items()} for rows in (ra, rb))
            if ca.keys() != cb.keys():
                raise ValueError(f"cannot pool {src} into {dest}: the {name}'s evaluations cover different problems or "
                                 f"samples ({len(ca.keys() - cb.keys())} rows only in {dest}, "
                                 f"{len(cb.keys() - ca.keys())} only in {src})")
            n_diff = sum(ca[k] != cb[k] for k in ca)
            if n_diff:
                raise ValueError(f"cannot pool {src} into {dest}: the {name}'s evaluations differ in {n_diff} of "
                                 f"{len(ca)} completions, so the two setups did not build the same {name}")
            graded = [c for c in GRADES if c in next(iter(ra.values()), {}) and c in next(iter(rb.values()), {})]
            cols = [c for c in graded if any(ra[k][c] != rb[k][c] for k in ra)]
            if cols:
                n_grade = sum(any(ra[k][c] != rb[k][c] for c in cols) for k in ra)
                raise ValueError(f"cannot pool {src} into {dest}: the {name}'s completions are equal but graded "
                                 f"differently in {n_grade} of {len(ca)} ({', '.join(cols)}): another grader "
                                 "version on one side (run --stage regrade on both directories)")
            compared.append(f"{name} ({len(ca)} completions equal" + (", graded alike" if graded else "") + ")")
            if name == "student":
                keys = set(ca)
    return compared, keys


def plan(dest: Path, src: Path, *, valid_name=None, defaults: dict | None = None, earlier: list[Plan] = (),
         marks: set[float] | None = None, optional_marks=None) -> Plan:
    """Check ``src`` against ``dest`` (module docstring) and say what pooling it would copy; writes nothing.

    ``valid_name(run)`` raises ValueError for a run name the report cannot read or that is not the run's canonical
    name; ``marks``: the experiment's marks, each of which a run must hold; ``optional_marks(run)``: the marks it may
    hold besides (a sequential run's hand-over);
    ``defaults`` fill settings an older ``settings.json`` lacks; ``earlier`` are the plans of sources listed before
    this one, whose runs count as already here (equal results: skipped; different: a clash).

    Raises:
        FileNotFoundError / ValueError: from :func:`check_same_setup`; ValueError also when ``src`` is ``dest`` or an
            earlier source, a run name is not valid, a run's ``evals/<run>.parquet`` cannot be read, lacks a column,
            names another run, holds a key twice or a problem the start was not evaluated on, a run is in two places
            with different results, or a run to copy has an ``arms/<run>/`` here without its ``evals/`` (an
            unfinished run, never deleted).
    """
    dest, src = Path(dest), Path(src)
    if not src.is_dir():
        raise FileNotFoundError(f"--pool_from {src}: no such directory")
    if dest.resolve() == src.resolve():
        raise ValueError(f"--pool_from {src} is the --out directory itself")
    if any(e.src.resolve() == src.resolve() for e in earlier):
        raise ValueError(f"--pool_from lists {src} twice")
    checked, keys = check_same_setup(dest, src, defaults)
    p = Plan(src=src, checked=checked, source_log=_pool_log(src))
    planned = {run: e.src for e in earlier for run in e.copy}  # runs an earlier source will copy here
    clash = []
    for f in sorted((src / "evals").glob("*.parquet")):
        run = f.stem
        if run in SHARED_EVALS:
            continue
        if valid_name is not None:
            valid_name(run)
        check_run_rows(f, _table(f, RUN_COLUMNS), run, keys, marks,
                       optional_marks(run) if optional_marks is not None else frozenset())
        have = dest / "evals" / f.name
        if run in planned:
            if not same_results(planned[run] / "evals" / f.name, f):
                clash.append(run)
            elif (src / "arms" / run).is_dir() and not (planned[run] / "arms" / run).is_dir() \
                    and not (dest / "arms" / run).exists() and not any(run in e.arms_only for e in earlier):
                p.arms_only.append(run)  # the earlier source brings its evals/, this one its arms/
            else:
                p.skip.append(run)
        elif have.exists():
            if not same_results(have, f):
                clash.append(run)
            elif (src / "arms" / run).is_dir() and not (dest / "arms" / run).exists() \
                    and not any(run in e.arms_only for e in earlier):
                p.arms_only.append(run)
            else:
                p.skip.append(run)
        else:
            p.copy.append(run)
    if clash:
        raise ValueError(f"cannot pool {src} into {dest}: {', '.join(clash)} in two places with different results "
                         "(here or an earlier --pool_from source), and a run name is one run; nothing was copied. "
                         "A lease's own reference run clashes so when it reused the name: run it under another seed "
                         "(--seeds N), or rename one side's run (its evals/<run>.parquet, the table's name column and "
                         "arms/<run>/) or move it away")
    unfinished = [r for r in p.copy if (dest / "arms" / r).exists()]
    if unfinished:  # never delete what a run left here, even an unfinished one
        raise ValueError(f"cannot pool {src} into {dest}: arms/{', arms/'.join(unfinished)} already in {dest} without "
                         "evals/ (a run that did not finish there): move it away first")
    return p


def _copy_atomic(src: Path, dest: Path) -> None:
    for stale in dest.parent.glob(f".{dest.name}.tmp*"):  # left by a pool killed mid-copy (pools hold the run lock)
        shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp{os.getpid()}")
    try:
        if src.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(src, tmp)
        else:
            shutil.copy2(src, tmp)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        raise


def _pool_log(dest: Path) -> list:
    log = dest / "pooled.json"
    if not log.exists():
        return []
    records = _json(log, "")
    if not isinstance(records, list):
        raise ValueError(f"{log} is not a JSON list of pool records")
    return records


def apply(dest: Path, plans: list[Plan]) -> list[dict]:
    """Copy what ``plans`` (from :func:`plan`, all made before any copy) say; return the records added to
    ``dest/pooled.json`` (``{"from", "checked", "copied", "skipped", "at", "source_pooled"}``, one per source that
    added a run). A source's record is written before its first run is copied and rewritten around each run: while
    a run is copied it is named under ``"copying"``, so even a pool killed outright (SIGKILL) leaves a record of where
    the run it was copying came from (its ``evals/`` may then be here without ``arms/``; pooling the same source
    again completes it).

    Raises:
        OSError: a copy failed (a full disk, a file gone); the run being copied is removed again, those copied before
            it stay (and are recorded), and the message names the run. Also when ``pooled.json`` cannot be written:
            the message names the runs already in place.
    """
    dest = Path(dest)
    from data_tools.runio import write_json

    log = _pool_log(dest)  # read (and checked) before anything is copied
    settle = [r for r in log if isinstance(r, dict) and "copying" in r]  # left by a pool killed mid-copy
    for r in settle:  # its run is here (then it came from that source) or was taken away: the record says which
        run = r.pop("copying")
        if (dest / "evals" / f"{run}.parquet").exists() and run not in r.setdefault("copied", []):
            r["copied"].append(run)
    if settle:
        log[:] = [r for r in log if r.get("copied") or not any(r is x for x in settle)]  # nothing of it landed
        write_json(log, dest / "pooled.json")
    for stale in dest.glob(".pooled.json.*.tmp"):  # a pooled.json write killed before its rename (pools hold the
        stale.unlink(missing_ok=True)             # run lock, and only pools write pooled.json)

    existed = (dest / "pooled.json").exists()

    def record(rec: dict) -> None:
        if not rec["copied"] and "copying" not in rec:
            log[:] = [r for r in log if r is not rec]  # nothing of this source landed: no record
        try:
            if not log and not existed:
                (dest / "pooled.json").unlink(missing_ok=True)
                return
            write_json(log, dest / "pooled.json")
        except OSError as e:
            raise OSError(f"{', '.join(rec['copied']) or 'no run'} pooled into {dest} from {rec['from']}, but "
                          f"{dest / 'pooled.json'} could not be written to record it: {e}") from e

    added = []
    for p in plans:
        runs = p.copy + p.arms_only
        if not runs:
            continue
        rec = {"from": str(p.src.resolve()), "checked": p.checked, "copied": [], "skipped": p.skip,
               "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        if p.source_log:
            rec["source_pooled"] = p.source_log
        log.append(rec)
        for run in runs:
            # evals/ first: a process killed before arms/ is in place leaves a run here without arms/,
            # which the next pool of the same source completes (a run here with arms/ and no evals/ is
            # someone's unfinished run, and is never touched)
            arms, ev = dest / "arms" / run, dest / "evals" / f"{run}.parquet"
            copied_ev = placed = False
            want_arms, arms_before = (p.src / "arms" / run).is_dir(), arms.exists()  # plan: never there for these
            rec["copying"] = run
            record(rec)
            try:
                if run in p.copy:
                    _copy_atomic(p.src / "evals" / f"{run}.parquet", ev)
                    copied_ev = True
                if want_arms:
                    arms.parent.mkdir(parents=True, exist_ok=True)
                    _copy_atomic(p.src / "arms" / run, arms)
                placed = True
            except BaseException as e:  # a full disk, or an interrupt: not half a run
                # an interrupt that came after arms/ was renamed into place leaves the run whole: keep and record it
                placed = want_arms and not arms_before and arms.is_dir() and (copied_ev or run not in p.copy)
                if copied_ev and not placed:
                    ev.unlink(missing_ok=True)
                if placed or not isinstance(e, OSError):
                    raise
                why = (f"{len(e.args[0])} file(s) failed, first: {e.args[0][0][2]}"
                       if isinstance(e, shutil.Error) and e.args and e.args[0] else str(e))
                raise OSError(f"pooling {run} from {p.src} failed, nothing of it kept: {why}") from e
            finally:
                del rec["copying"]
                if placed:  # whole here (even if interrupted just after): recorded at once
                    rec["copied"].append(run)
                record(rec)
        if rec["copied"]:
            added.append(rec)
    return added


def pool(dest: Path, src: Path, **kw) -> dict:
    """Pool one source: :func:`plan` (``kw``: its options), then :func:`apply`. Returns ``{"from", "checked",
    "copied", "skipped"}``."""
    p = plan(dest, src, **kw)
    apply(dest, [p])
    return {"from": str(Path(src).resolve()), "checked": p.checked, "copied": p.copy + p.arms_only, "skipped": p.skip}
