"""The rehearsal of a recipe: the recipe as configured, on a compressed clock, with every phase forced to happen;
then a table of what each phase took and a projection of the real run.

    bash run.sh --rehearse [RECIPE]     # REHEARSAL_SECONDS (default 1200) on the clock, under ${OUTPUT_DIR}.rehearsal

``run.sh --rehearse`` runs the same stages with the same models, data, lengths, batch, dtypes, engines and compile
settings as the real run, and changes only what makes every phase fit a short clock (``plan``): stage one measures
one chunk a role per engine worker (its first call, which runs past the tiny budget but never past half the training
window), sized so that the SFT phase gets at least two steps; the clock is ``REHEARSAL_SECONDS`` with a reserve of a
tenth of it; no evaluation (the exports are loaded back here instead).
Random-weight models (``data_tools.formal_models``) verify nothing, so stage one counts a stated share of samples as
verified (``REHEARSAL_VERIFIED``, default 0.5: ``data_tools.rehearsal``; empty = the grader alone). Its formal models
are the formal pair's shapes: student and teacher both of the 1.5B shape (the formal teacher, JustRL-DeepSeek-1.5B,
is the student after RL); ``--which teacher-7b`` writes a Qwen2.5-7B-shaped teacher, a stress option for time and
memory.

The formal machine is one GPU (a B300), so one GPU is the formal layout: the projection holds for the layout the
rehearsal ran on and says which, and a rehearsal for the formal run runs on one GPU (``CUDA_VISIBLE_DEVICES=0`` on a
machine with more; run.sh uses every visible GPU, for users who have them).

    python -m stages.rehearse plan --curate C.yaml --train T.yaml --seconds S --workers W   # KEY=VALUE for run.sh
    python -m stages.rehearse clean --run DIR                                              # empty a rehearsal dir
    python -m stages.rehearse report --run DIR --curate C.yaml --train T.yaml --real-clock T --real-reserve R \
        [--real-eval-reserve E]

``report`` reads the run's own records (curation manifest and rollouts, ``metrics/train.jsonl``,
``metrics/exports.jsonl``, ``train_summary.json``, ``run_stages.jsonl``, and ``gpu_memory.csv`` where run.sh sampled
``nvidia-smi``), loads every export back (transformers, and vLLM where it imports) and generates a few tokens,
prints one row a phase (seconds, peak memory and headroom against the device, tokens/s, PASS / FAIL) and the
projection for the real clock on the rehearsal's layout, writes ``rehearsal.json`` / ``rehearsal.md`` in the run
directory, and exits 1 when any phase failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from data_tools.clock import DEFAULT_CURATE_SHARE, DEFAULT_MAX_WALL_S, DEFAULT_RESERVE_S
from data_tools.clock import read_yaml as _yaml

DEFAULT_SECONDS = 1200
DEFAULT_VERIFIED = "0.5"
#: Of the problems stage one measures in a rehearsal, the share expected to end in the curriculum with a solution
#: (data_tools.rehearsal's fractions: 94% teacher-solved x ~90% inside the band; under ``filter: none`` the
#: teacher-solved 94% alone), with a margin.
KEPT_WITH_SOLUTION = 0.75


# ------------------------------------------------------------------------------------------------------ plan

def plan(curate_cfg: str | Path, train_cfg: str | Path, seconds: float, workers: int = 1,
         real: tuple[float, float, float] | None = None) -> dict[str, Any]:
    """What ``run.sh --rehearse`` changes: stage one's chunk size and time share, the clock's reserve, and a warm-up
    given in seconds as its share of the real training window (``real`` = the real clock, reserve and evaluation
    reserve), so the learning-rate schedule has the real run's shape on the short clock.

    One chunk a role per worker is measured: run.sh makes each worker's first call of a role (its probe, which stage one
    runs even past its budget, never past half the training window: ``stages.curate_clock``) a whole chunk, and the
    tiny share admits no second. The chunks hold enough problems for two SFT steps at ``sft_max_epochs`` passes, or 8
    a worker.
    """
    c, t = _yaml(curate_cfg), _yaml(train_cfg)
    sft = _sft_phase(t)
    batch, passes = int(_train_setting(t, "sft_batch_size")), float(_train_setting(t, "sft_max_epochs") or 0)
    rows = math.ceil(2 * batch / passes / KEPT_WITH_SOLUTION) if sft and passes else 8
    chunk = max(8, math.ceil(rows / max(workers, 1)))
    reserve = min(float(t.get("deadline_reserve_seconds", DEFAULT_RESERVE_S)), max(60.0, round(0.1 * seconds)))
    warmup = float(_train_setting(t, "lr_warmup_time") or 0)
    if warmup >= 1:  # seconds: the same share of the real run's training window
        rt, rr, re = real or (float(t.get("max_wall_time_seconds", DEFAULT_MAX_WALL_S)),
                              float(t.get("deadline_reserve_seconds", DEFAULT_RESERVE_S)), 0.0)
        window = (1 - float(c.get("time_share", DEFAULT_CURATE_SHARE))) * (rt - rr - re)
        warmup = min(warmup / max(window, 1.0), 0.5)
    return {"R_CHUNK": chunk, "R_SHARE": 0.001, "R_RESERVE": int(reserve), "R_WARMUP": round(warmup, 6),
            "R_NOTE": f"stage one: one chunk of {chunk} problems a role per worker ({workers}); clock {seconds:g}s, "
                      f"reserve {reserve:g}s; no evaluation"}


def _sft_phase(t: dict) -> bool:
    """The recipe starts with off-policy SFT steps capped by ``sft_max_epochs`` (then a hand-over)."""
    share = max(float(_train_setting(t, "sft_share_start") or 0), float(_train_setting(t, "sft_share_end") or 0))
    return share > 0 and float(_train_setting(t, "sft_max_epochs") or 0) > 0


def _train_setting(t: dict, key: str) -> Any:
    """The training recipe's ``key``, else the trainer's default for it: ``OPDConfig``'s field, its one owner (read
    only for a recipe that leaves the key out, since it imports torch and TRL; the formal recipe sets them all)."""
    if key in t:
        return t[key]
    from trainers.opd_config import OPDConfig

    f = OPDConfig.__dataclass_fields__[key]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def clean(run: Path) -> None:
    """Remove a rehearsal directory's contents (its lock file stays: the caller holds it)."""
    run = Path(run)
    for p in run.iterdir() if run.is_dir() else []:
        if p.name == ".opd.lock":
            continue
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


# ---------------------------------------------------------------------------------------------------- report

@dataclass
class Phase:
    name: str
    seconds: float | None = None
    peak_gib: float | None = None     # device memory in use (nvidia-smi), else the trainer's allocator peak
    tokens_per_s: float | None = None
    ok: bool = True
    detail: str = ""
    start: float | None = None        # Unix times bounding the phase (for the GPU memory samples)
    end: float | None = None


@dataclass
class Report:
    phases: list[Phase] = field(default_factory=list)
    projection: list[tuple[str, str]] = field(default_factory=list)
    projection_for: str = ""          # the layout the projection holds for (projection_layout)
    device_gib: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.phases)


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def gpu_samples(path: Path) -> list[tuple[float, float, float]]:
    """``(unix time, used GiB, total GiB)`` per line of ``nvidia-smi --query-gpu=timestamp,index,memory.used,
    memory.total --format=csv,noheader,nounits`` (the most used GPU of each instant)."""
    by_t: dict[float, tuple[float, float]] = {}
    if not path.exists():
        return []
    for line in path.read_text().splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) < 4:
            continue
        try:
            t = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            used, total = float(parts[2]) / 1024, float(parts[3]) / 1024
        except ValueError:
            continue
        prev = by_t.get(t)
        if prev is None or used > prev[0]:
            by_t[t] = (used, total)
    return sorted((t, u, tot) for t, (u, tot) in by_t.items())


def _peak(samples, start, end) -> float | None:
    vals = [u for t, u, _ in samples if start is not None and end is not None and start - 1 <= t <= end + 1]
    return max(vals) if vals else None


def _unix(stamp: str | None) -> float | None:
    if not stamp:
        return None
    return time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S"))


def stage_one_phases(run: Path) -> tuple[list[Phase], dict]:
    """Teacher and student phases of stage one from its rollouts (chunk times) and manifest; the teacher's alone under
    ``filter: none`` (no student samples). ``rates``: seconds a problem per role, and the counts the projection scales:
    problems measured, curriculum rows, rows with a verified teacher solution, usable problems."""
    import pyarrow.parquet as pq  # report only: run.sh calls plan and clean at its start, which import no pyarrow

    man = json.loads((run / "curate" / "manifest.json").read_text())
    roll = pq.read_table(run / "curate" / "rollouts.parquet",
                         columns=["problem_id", "role", "n_tokens", "chunk", "started_at", "finished_at"]).to_pylist()
    out, rates = [], {"filter": (man.get("config") or {}).get("filter", "pass_rate")}
    for role in ("teacher",) if rates["filter"] == "none" else ("teacher", "student"):
        rows = [r for r in roll if r["role"] == role]
        chunks = sorted({r["chunk"] for r in rows})
        if not rows:
            out.append(Phase(f"stage one: {role}", ok=False, detail="no chunk measured"))
            continue
        start = min(_unix(r["started_at"]) for r in rows)
        end = max(_unix(r["finished_at"]) for r in rows)
        span = max(end - start, 1.0)
        problems = len({r["problem_id"] for r in rows})
        tokens = sum(r["n_tokens"] for r in rows)
        rates[role] = span / problems  # seconds a problem, all workers together
        out.append(Phase(f"stage one: {role}", seconds=span, tokens_per_s=tokens / span, start=start, end=end,
                         detail=f"{len(chunks)} chunk(s), {problems} problems, {len(rows)} samples, mean "
                                f"{tokens / len(rows):.0f} tokens"))
    rates["startup_s"] = float((man.get("timings") or {}).get("engine_startup_s") or 0.0)
    rates["workers"] = int((man.get("workers") or {}).get("shards") or 1)  # engine workers, all nodes: one a GPU
    rates["problems"] = int(man["counts"].get("problems_measured", 0))
    rates["rows"] = int(man["counts"].get("curriculum", 0))
    # every row the band filter keeps has a solution (a manifest from before the count was recorded: its rows)
    rates["solutions"] = int(man["counts"].get("teacher_solutions", rates["rows"]))
    rates["all_problems"] = int(man["counts"].get("problems", 0))
    rates["rehearsal"] = man.get("rehearsal")
    rates["fallback"] = bool(man["counts"].get("filter_fallback"))  # the band kept none: every problem instead
    return out, rates


def training_phases(run: Path, sft_expected: bool, summ: dict) -> tuple[list[Phase], dict]:
    """SFT steps, the hand-over and on-policy steps, from the trainer's metrics and ``train_summary.json`` (``summ``)."""
    m = [r for r in _jsonl(run / "metrics" / "train.jsonl") if "loss" in r]
    sft = [r for r in m if r.get("sft/off_policy_step") == 1.0]
    onp = [r for r in m if r.get("sft/off_policy_step") != 1.0]
    out = []
    why = ""  # a phase without steps: what stopped training, and how long it had (a step longer than the window)
    if not m and summ.get("stop_reason"):
        why = f": training stopped with '{summ['stop_reason']}'"
        if summ.get("began_at_s") is not None and summ.get("horizon_s") is not None:
            why += (f" after a {summ['horizon_s'] - summ['began_at_s']:.0f} s window, inside the first step: raise "
                    "REHEARSAL_SECONDS")

    def steps_phase(name, rows, need, tokens_key):
        if not rows:
            return Phase(name, ok=need == 0, detail=f"0 steps (need >= {need}){why}")
        secs = [r["time/step"] for r in rows if r.get("time/step")]
        peak = max((r.get("memory/step_peak_gib") or r.get("memory/peak_gib") or 0.0) for r in rows)
        tps = [r[tokens_key] / r["time/step"] for r in rows if r.get(tokens_key) and r.get("time/step")]
        ends = [r["time"] for r in rows]
        return Phase(name, seconds=sum(secs), peak_gib=peak or None,
                     tokens_per_s=statistics.median(tps) if tps else None, ok=len(rows) >= need,
                     start=min(ends) - (secs[0] if secs else 0), end=max(ends),
                     detail=f"{len(rows)} steps (need >= {need}), median {statistics.median(secs):.1f} s a step")

    if sft_expected:
        out.append(steps_phase("SFT steps", sft, 2, "sft/tokens"))
        first_onp = next((r["step"] for r in m if r.get("sft/off_policy_step") != 1.0), None)
        last_sft = max((r["step"] for r in sft), default=None)
        ok = first_onp is not None and last_sft is not None and first_onp == last_sft + 1
        out.append(Phase("hand-over", ok=ok, detail=(f"on-policy from step {first_onp} after {len(sft)} SFT steps"
                                                     if ok else "no on-policy step followed the SFT steps")))
    for r in onp:  # generated tokens a step, for tokens/s
        r["_gen_tokens"] = (r.get("throughput/tokens_per_s") or 0) * (r.get("time/step") or 0)
    out.append(steps_phase("on-policy steps", onp, 2, "_gen_tokens"))
    med = {"sft_step_s": statistics.median([r["time/step"] for r in sft]) if sft else None,
           "onpolicy_step_s": per_update_seconds(onp)}
    gens = sum(r.get("reward/mean") is not None for r in onp)
    if onp and 0 < gens < len(onp) and med["onpolicy_step_s"]:  # several updates a rollout batch
        out[-1].detail += (f"; {gens} rollout batches, {med['onpolicy_step_s']:.1f} s an update over its batch "
                           "(the projection's)")
    return out, med


def per_update_seconds(onp: list[dict]) -> float | None:
    """Seconds an on-policy update costs, from the metrics' rows in step order: the median over rollout batches of
    the batch's seconds per update. A batch begins with the update that generated (the one row with
    ``reward/mean``); with ``steps_per_generation`` > 1 its later updates are cheap, so a median over steps would
    price every update as a later one. Only whole batches count (a run stopped mid-batch leaves its last short)."""
    rows = [r for r in onp if r.get("time/step")]
    batches: list[list[float]] = []
    for r in rows:
        if r.get("reward/mean") is not None or not batches:
            batches.append([])
        batches[-1].append(r["time/step"])
    if not batches:
        return None
    n = max(len(b) for b in batches)
    whole = [b for b in batches if len(b) == n]
    return statistics.median(sum(b) / len(b) for b in whole)


def export_phase(run: Path, clock_s: float, hedges: list[float], summ: dict) -> tuple[Phase, dict]:
    """The saves: one for each hedge fraction of the training window a finished step crossed (a step crossing two
    hedges saves once for both, as in a real run), one at the final step, and the final one done inside the clock
    (its reserve). Which save was which hedge's, and which hedges were crossed, the trainer writes into
    ``exports.jsonl`` as it decides them (``hedges``, ``hedges_crossed``)."""
    ex = _jsonl(run / "metrics" / "exports.jsonl")
    final_step = summ.get("global_step")
    steps = [e["step"] for e in ex]
    saved = {h: e["step"] for e in ex for h in e.get("hedges") or []}
    crossed = list(ex[-1].get("hedges_crossed") or []) if ex else []
    unrecorded = bool(ex) and "hedges_crossed" not in ex[-1]  # written before the trainer recorded its hedges
    missed = [f"{h:g}" for h in crossed if h not in saved]
    done = summ.get("wall_s") or math.inf
    # a short clock may end inside the step that would cross a later hedge (a real window's hedges are an hour apart):
    # what must hold is a save at every hedge a finished step crossed, at least one of them, and the final one
    ok = (bool(ex) and not unrecorded and final_step in steps and not missed and (bool(crossed) or not hedges)
          and done <= clock_s)
    cost = [e["export_s"] + (e.get("resume_state_s") or 0.0) for e in ex]
    full = [c for c, e in zip(cost, ex) if e.get("resume_state_s") is not None]  # export + resume state
    med = {"export_s": statistics.median([e["export_s"] for e in ex]) if ex else None,
           "save_s": statistics.median(full or cost) if cost else None,
           "final_save_s": max(cost[-1], statistics.median(full)) if full else (cost[-1] if cost else None)}
    resume = statistics.median([e.get("resume_state_s") or 0 for e in ex]) if ex else 0.0
    if unrecorded:
        hedge_note = (f"{run / 'metrics' / 'exports.jsonl'} has no hedge records (a trainer that did not "
                      "record hedges wrote it): which save was which hedge's is unknown, rehearse again")
    else:
        hedge_note = (f"hedges {hedges} crossed by a finished step {len(crossed)}/{len(hedges)}"
                      + (f", no save at {', '.join(missed)}" if missed else
                         ", each saved" + "".join(f" ({h:g} at step {saved[h]})" for h in crossed)))
    detail = (f"{len(ex)} saves at steps {steps}: {hedge_note}; final at step {final_step}; "
              f"export {med['export_s'] or 0:.1f} s + resume state {resume:.1f} s a save; training and its final save "
              f"done at {done:.0f} s of the {clock_s:.0f} s clock")
    return Phase("exports", seconds=sum(cost) if cost else None, ok=ok, detail=detail), med


def load_back(ckpt_dir: Path, vllm_on: bool = True) -> list[Phase]:
    """Every export in ``ckpt_dir`` loads and generates: transformers, then vLLM where it imports."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy, report only (as pyarrow, see above)

    out = []
    exports = sorted((p for p in Path(ckpt_dir).glob("checkpoint-*") if p.is_dir()),
                     key=lambda p: int(p.name.split("-")[1]))
    if not exports:
        return [Phase("load exports (transformers)", ok=False, detail=f"no export in {ckpt_dir}")]
    for p in exports:
        t0 = time.time()
        try:
            tok = AutoTokenizer.from_pretrained(p)
            model = AutoModelForCausalLM.from_pretrained(p)
            ids = tok("What is 2 + 3?", return_tensors="pt").input_ids
            new = model.generate(ids, max_new_tokens=8, do_sample=False).shape[1] - ids.shape[1]
            ok, detail = new > 0, f"{p.name}: generated {new} tokens"
            del model
        except Exception as e:  # noqa: BLE001 - the table says what failed
            ok, detail = False, f"{p.name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        out.append(Phase(f"load {p.name} (transformers)", seconds=time.time() - t0, ok=ok, detail=detail))
    if not vllm_on or importlib.util.find_spec("vllm") is None:
        out.append(Phase("load exports (vLLM)", ok=True, detail="skipped: " + (
            "vLLM is not installed here" if vllm_on else "--no-vllm")))
        return out
    from data_tools.generation.engines import make_engine  # report only (as pyarrow, see above)

    for p in exports:
        t0 = time.time()
        try:
            eng = make_engine("vllm", str(p), max_model_len=512, gpu_memory_utilization=0.3)
            try:
                (batch,) = list(eng.generate(["What is 2 + 3?"], n=1, max_tokens=8, temperature=1.0, top_p=1.0,
                                             chunk_size=1, desc=f"load-back {p.name}"))
                ok, detail = bool(batch), f"{p.name}: generated {sum(s.n_tokens for s in batch)} tokens"
            finally:
                eng.close()
        except Exception as e:  # noqa: BLE001
            ok, detail = False, f"{p.name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        out.append(Phase(f"load {p.name} (vLLM)", seconds=time.time() - t0, ok=ok, detail=detail))
    return out


def projection_layout(workers: int) -> str:
    """What the projection holds for: the rehearsal's rates are those of its own layout (``workers`` engine workers,
    one a GPU). The formal machine is one GPU, so that is the formal layout."""
    if workers <= 1:
        return "on one engine worker, the formal machine's layout (one GPU)"
    return (f"on {workers} engine workers (one a GPU), this rehearsal's layout, not the formal machine's one GPU "
            "(rehearse with CUDA_VISIBLE_DEVICES=0 for the formal run's projection)")


def project(rates: dict, med: dict, ex: dict, curate: dict, train: dict, real_t: float, real_r: float,
            real_e: float, setup_s: float) -> list[tuple[str, str]]:
    """The real clock's counts from the rehearsal's measured rates (each row says what it assumes)."""
    share = float(curate.get("time_share", DEFAULT_CURATE_SHARE))
    budget = share * (real_t - real_r - real_e)
    per_problem = (rates.get("teacher") or 0.0) + (rates.get("student") or 0.0)
    startup = rates.get("startup_s") or 0.0
    problems = max(0, int((budget - setup_s - startup) / per_problem)) if per_problem else 0
    unfiltered = rates.get("filter") == "none" or bool(rates.get("fallback"))
    if unfiltered:  # every usable problem is a row; solutions where the teacher verified one, of the problems measured
        problems = min(problems, rates.get("all_problems") or problems)
    n_sols = rates.get("solutions", rates["rows"])  # the band filter's rows all have a solution
    share_of = lambda n: problems * n / rates["problems"] if rates.get("problems") else 0  # noqa: E731
    sols = int(share_of(n_sols))
    rows = rates.get("all_problems", 0) if unfiltered else int(share_of(rates["rows"]))
    window = real_t - real_r - real_e - budget
    who = "the teacher alone (filter none)" if rates.get("filter") == "none" else "teacher + student"
    rows_out = [("stage one budget", f"{budget:.0f} s (time_share {share:g} of {real_t - real_r - real_e:.0f} s)"),
                ("stage one problems measured",
                 f"~{problems:,} ({per_problem:.2f} s a problem, {who}, all workers; set-up {setup_s:.0f} s, "
                 f"engine start-up {startup:.0f} s)")]
    if unfiltered:
        why = "filter none" if rates.get("filter") == "none" else "the band kept none"
        rows_out += [("curriculum rows", f"{rows:,} ({why}: every usable problem)"),
                     ("verified teacher solutions", f"~{sols:,} (the rehearsal's share {n_sols}/"
                                                    f"{rates['problems']} of the problems measured: forced by its "
                                                    "verified share, a real teacher's differs)")]
    else:
        rows_out.append(("curriculum rows", f"~{rows:,} (the rehearsal's kept share {rates['rows']}/{rates['problems']}: "
                                            "forced by its verified share, a real teacher's differs)"))
    sft_s = 0.0
    if _sft_phase(train) and med.get("sft_step_s"):
        passes, batch = float(_train_setting(train, "sft_max_epochs")), int(_train_setting(train, "sft_batch_size"))
        steps = int(passes * sols / batch)
        sft_s = steps * med["sft_step_s"]
        over = (f"; LONGER THAN THE TRAINING WINDOW: the hand-over to on-policy steps never comes (fewer "
                f"sft_max_epochs, or a smaller time_share)" if sft_s > real_t - real_r - real_e - budget else "")
        rows_out.append(("SFT steps", f"~{steps:,} x {med['sft_step_s']:.1f} s = {sft_s:.0f} s ({passes:g} "
                                      f"passes over ~{sols:,} solutions, {batch} a step){over}"))
    every = float(_train_setting(train, "ckpt_every_minutes") or 0) * 60
    hedges = list(_train_setting(train, "ckpt_hedge_fractions") or [])
    first = hedges[0] if hedges else 1.0
    saves = (int(first * window / every) if every else 0) + len(hedges) + 1
    save_s = ex.get("save_s") or 0.0
    rows_out.append(("training window", f"{window:.0f} s (stage one's unused time adds to it)"))
    rows_out.append(("saves", f"{saves} x {save_s:.1f} s (export + resume state) = {saves * save_s:.0f} s"))
    if med.get("onpolicy_step_s"):
        left = window - sft_s - saves * save_s
        rows_out.append(("on-policy steps", f"~{max(0, int(left / med['onpolicy_step_s'])):,} x "
                                            f"{med['onpolicy_step_s']:.1f} s (the rest of the window)"))
    final = ex.get("final_save_s")
    if final is not None:
        rows_out.append(("final save vs the reserve", f"{final:.1f} s of {real_r:.0f} s "
                                                      f"({'fits' if final <= real_r else 'DOES NOT FIT'})"))
    return rows_out


def build_report(run: Path, curate_cfg: str, train_cfg: str, real_t: float, real_r: float, real_e: float = 0.0,
                 vllm_on: bool = True) -> Report:
    run = Path(run)
    train, curate = _yaml(train_cfg), _yaml(curate_cfg)
    rep = Report()
    stages = _jsonl(run / "run_stages.jsonl")
    clock = next((s for s in stages if s.get("stage") == "clock"), {})
    t0, clock_s = clock.get("start"), float(clock.get("clock_s") or math.inf)
    cur = next((s for s in stages if s.get("stage") == "curate"), {})
    setup_s = (cur.get("start") - t0) if cur.get("start") and t0 else 0.0
    rep.phases.append(Phase("set-up", seconds=setup_s, start=t0, end=cur.get("start")))
    if (run / "curate" / "manifest.json").exists():
        s1, rates = stage_one_phases(run)
    else:
        s1, rates = [Phase("stage one", ok=False, detail="no curate/manifest.json")], {}
    rep.phases += s1
    if rates:
        # the SFT phase trains on the verified teacher solutions (the band filter's rows all have one)
        need = rates["solutions"] if _sft_phase(train) else rates["rows"]
        what = (f"{rates['rows']} rows (filter none: every problem), {rates['solutions']} with a verified teacher "
                f"solution from {rates['problems']} problems measured" if rates["filter"] == "none"
                else f"the pass-rate band kept none of {rates['problems']} problems measured: {rates['rows']} rows, every "
                f"problem instead ({rates['solutions']} with a verified teacher solution)" if rates.get("fallback")
                else f"{rates['rows']} rows from {rates['problems']} problems")
        # a band that kept nothing fails the rehearsal: the run would go on (unfiltered), not as the recipe says
        rep.phases.append(Phase("curriculum", ok=need > 0 and not rates.get("fallback"), detail=what
                                + (f"; rehearsal verified share {rates['rehearsal'].get('value')}"
                                   if rates.get("rehearsal") else "")))
    summ = json.loads((run / "train_summary.json").read_text()) if (run / "train_summary.json").exists() else {}
    tp, med = training_phases(run, _sft_phase(train), summ)
    rep.phases += tp
    xp, ex = export_phase(run, clock_s, sorted(_train_setting(train, "ckpt_hedge_fractions") or []), summ)
    rep.phases.append(xp)
    rep.phases += load_back(run / "checkpoints", vllm_on=vllm_on)
    samples = gpu_samples(run / "gpu_memory.csv")
    if samples:
        rep.device_gib = max(tot for _, _, tot in samples)
        for p in rep.phases:
            dev = _peak(samples, p.start, p.end)
            if dev is not None:
                p.peak_gib = dev
    elif not rep.notes:
        rep.notes.append("no GPU memory samples (no nvidia-smi): training's peak is the process's resident memory")
    if rates:
        rep.projection = project(rates, med, ex, curate, train, real_t, real_r, real_e, setup_s)
        rep.projection_for = projection_layout(rates["workers"])
    return rep


def format_report(rep: Report) -> str:
    dev = f" of {rep.device_gib:.0f} GiB" if rep.device_gib else ""
    lines = [f"| phase | seconds | peak memory (GiB{dev}) | headroom (GiB) | tokens/s | result | detail |",
             "|---|---|---|---|---|---|---|"]
    for p in rep.phases:
        head = f"{rep.device_gib - p.peak_gib:.1f}" if rep.device_gib and p.peak_gib is not None else ""
        lines.append(f"| {p.name} | {'' if p.seconds is None else f'{p.seconds:.1f}'} | "
                     f"{'' if p.peak_gib is None else f'{p.peak_gib:.1f}'} | {head} | "
                     f"{'' if p.tokens_per_s is None else f'{p.tokens_per_s:,.0f}'} | {'PASS' if p.ok else 'FAIL'} | "
                     f"{p.detail} |")
    if rep.projection:
        title = " ".join(x for x in ("projected for the real clock", rep.projection_for) if x)
        lines += ["", f"| {title} | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in rep.projection]
    lines += [f"({n})" for n in rep.notes]
    lines.append(f"\nrehearsal: {'PASS' if rep.ok else 'FAIL'} "
                 f"({sum(p.ok for p in rep.phases)}/{len(rep.phases)} phases passed)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stages.rehearse", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--curate", required=True)
    p.add_argument("--train", required=True)
    p.add_argument("--seconds", type=float, default=DEFAULT_SECONDS)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--real-clock", type=float, default=None)
    p.add_argument("--real-reserve", type=float, default=0.0)
    p.add_argument("--real-eval-reserve", type=float, default=0.0)
    c = sub.add_parser("clean")
    c.add_argument("--run", type=Path, required=True)
    r = sub.add_parser("report")
    r.add_argument("--run", type=Path, required=True)
    r.add_argument("--curate", required=True)
    r.add_argument("--train", required=True)
    r.add_argument("--real-clock", type=float, required=True)
    r.add_argument("--real-reserve", type=float, required=True)
    r.add_argument("--real-eval-reserve", type=float, default=0.0)
    r.add_argument("--no-vllm", action="store_true", help="load the exports back with transformers only")
    a = ap.parse_args(argv)
    if a.cmd == "plan":
        if a.seconds < 120:
            print(f"rehearse: REHEARSAL_SECONDS={a.seconds:g} is too short for any phase (>= 120)", file=sys.stderr)
            return 2
        real = (a.real_clock, a.real_reserve, a.real_eval_reserve) if a.real_clock else None
        for k, v in plan(a.curate, a.train, a.seconds, a.workers, real).items():
            print(f"{k}={json.dumps(v) if isinstance(v, str) else v}")
        return 0
    if a.cmd == "clean":
        clean(a.run)
        return 0
    rep = build_report(a.run, a.curate, a.train, a.real_clock, a.real_reserve, a.real_eval_reserve,
                       vllm_on=not a.no_vllm)
    text = format_report(rep)
    print(text, flush=True)
    (a.run / "rehearsal.md").write_text(text + "\n")
    (a.run / "rehearsal.json").write_text(json.dumps(
        {"ok": rep.ok, "device_gib": rep.device_gib, "phases": [p.__dict__ for p in rep.phases],
         "projection": dict(rep.projection), "projection_for": rep.projection_for, "notes": rep.notes}, indent=2,
        default=str) + "\n")
    return 0 if rep.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
