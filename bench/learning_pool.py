"""Pool the arm runs of one learning experiment run over several leases (``--stage pool --pool_from DIR``).

A GPU lease rarely holds every run an experiment needs, so a later lease repeats the setup on a fresh machine and
runs the rest in a directory of its own. The setup is built by step count and reproduces exactly (LEARNING.md: the
start's and the teacher's evaluation completions matched, 1,200 of 1,200, on four machines), so the runs can be read
together, but only after checking that. This module copies a source directory's arm runs (``evals/<run>.parquet``
and ``arms/<run>/``) into the destination after checking that

- the two directories' settings agree on everything that defines an arm run (:data:`SETTINGS_FREE` lists what
  may differ: paths, the command's arm list, its deadline);
- the start's and the teacher's evaluations are the same completions on the same problems and samples (the
  evidence that both are the same models; a setup rebuilt with other data or steps fails here);
- no run name is in both with different results (a name already pooled, with equal bytes, is skipped), and no
  run to copy has an unfinished ``arms/<run>/`` in the destination (it is never deleted).

Every copy is atomic (a temporary name, then a rename), and ``pooled.json`` in the destination records each pool:
its source, the runs copied and skipped, and when. Across leases a seconds-based run differs by its machine as it
does by a seed (LEARNING.md, "Fresh machines"): the report's paired standard errors do not include that.
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import time
from pathlib import Path

# Settings that may differ between the directories pooled: where things live, what one command ran, its clock.
SETTINGS_FREE = frozenset({
    "out", "arms", "seeds", "runs", "deadline_s", "arm_overhead_s", "keep_final", "preset", "report_filter",
    "late_marks", "student_path", "start_path", "start_model", "teacher_model", "student_model", "gsm8k_dir",
    "fast_generation", "fast_generation_used",
})
SHARED_EVALS = ("student", "teacher")  # the setup's evaluations: compared, never copied


def _settings(d: Path) -> dict:
    p = d / "settings.json"
    if not p.exists():
        raise FileNotFoundError(f"{p} not found: {d} is not a bench.learning run directory")
    return json.loads(p.read_text())


def _completions(path: Path) -> dict[tuple[str, int], str]:
    import pyarrow.parquet as pq

    t = pq.read_table(path, columns=["problem_id", "sample_index", "completion"]).to_pylist()
    return {(r["problem_id"], int(r["sample_index"])): r["completion"] for r in t}


def check_same_setup(dest: Path, src: Path) -> list[str]:
    """Raise unless ``src``'s arm runs can be read beside ``dest``'s; return the setup evaluations compared.

    Raises:
        FileNotFoundError: either directory lacks ``settings.json`` or ``evals/student.parquet``.
        ValueError: a setting outside :data:`SETTINGS_FREE` differs (each named with both values), or the start's or
            the teacher's evaluation differs (rows missing on one side, or different completions: counted).
    """
    a, b = _settings(dest), _settings(src)
    differ = {k: (a.get(k), b.get(k)) for k in sorted((set(a) | set(b)) - SETTINGS_FREE) if a.get(k) != b.get(k)}
    if differ:
        raise ValueError(f"cannot pool {src} into {dest}: settings differ: "
                         + "; ".join(f"{k} {va!r} vs {vb!r}" for k, (va, vb) in differ.items()))
    compared = []
    for name in SHARED_EVALS:
        pa_, pb = dest / "evals" / f"{name}.parquet", src / "evals" / f"{name}.parquet"
        if name == "student" or pa_.exists() or pb.exists():
            for p in (pa_, pb):
                if not p.exists():
                    raise FileNotFoundError(f"{p} not found: the {name}'s evaluation is what shows the two setups agree")
            ca, cb = _completions(pa_), _completions(pb)
            if ca.keys() != cb.keys():
                raise ValueError(f"cannot pool {src} into {dest}: the {name}'s evaluations cover different problems or "
                                 f"samples ({len(ca.keys() - cb.keys())} rows only in {dest}, "
                                 f"{len(cb.keys() - ca.keys())} only in {src})")
            n_diff = sum(ca[k] != cb[k] for k in ca)
            if n_diff:
                raise ValueError(f"cannot pool {src} into {dest}: the {name}'s evaluations differ in {n_diff} of "
                                 f"{len(ca)} completions, so the two setups did not build the same {name}")
            compared.append(f"{name} ({len(ca)} completions equal)")
    return compared


def _copy_atomic(src: Path, dest: Path) -> None:
    tmp = dest.with_name(f".{dest.name}.tmp{os.getpid()}")
    if src.is_dir():
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp)
    else:
        shutil.copy2(src, tmp)
    os.replace(tmp, dest)


def pool(dest: Path, src: Path) -> dict:
    """Copy ``src``'s arm runs into ``dest`` after :func:`check_same_setup`; return the record added to
    ``dest/pooled.json`` (``{"from", "checked", "copied", "skipped", "at"}``).

    Raises:
        FileNotFoundError / ValueError: from :func:`check_same_setup`; ValueError also when a run is in both
            directories with different ``evals/<run>.parquet`` (nothing is copied then), or ``src`` is ``dest``.
    """
    dest, src = Path(dest), Path(src)
    if dest.resolve() == src.resolve():
        raise ValueError(f"--pool_from {src} is the --out directory itself")
    checked = check_same_setup(dest, src)
    runs = sorted(p.stem for p in (src / "evals").glob("*.parquet") if p.stem not in SHARED_EVALS)
    copied, skipped, clash = [], [], []
    for run in runs:
        have = dest / "evals" / f"{run}.parquet"
        if have.exists():
            (skipped if filecmp.cmp(have, src / "evals" / f"{run}.parquet", shallow=False) else clash).append(run)
        else:
            copied.append(run)
    if clash:
        raise ValueError(f"cannot pool {src} into {dest}: {', '.join(clash)} in both with different results; "
                         "a run name is one run (rename or remove one side's evals/<run>.parquet and arms/<run>/)")
    unfinished = [r for r in copied if (src / "arms" / r).is_dir() and (dest / "arms" / r).exists()]
    if unfinished:  # never delete what a run left here, even an unfinished one
        raise ValueError(f"cannot pool {src} into {dest}: arms/{', arms/'.join(unfinished)} already in {dest} without "
                         "evals/ (a run that did not finish there): move it away first")
    for run in copied:  # arms/ first: a run whose evals/ exists is a pooled run, whole
        if (src / "arms" / run).is_dir():
            (dest / "arms").mkdir(parents=True, exist_ok=True)
            _copy_atomic(src / "arms" / run, dest / "arms" / run)
        _copy_atomic(src / "evals" / f"{run}.parquet", dest / "evals" / f"{run}.parquet")
    record = {"from": str(src.resolve()), "checked": checked, "copied": copied, "skipped": skipped,
              "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    log = dest / "pooled.json"
    from data_tools.runio import write_json

    write_json((json.loads(log.read_text()) if log.exists() else []) + [record], log)
    return record
