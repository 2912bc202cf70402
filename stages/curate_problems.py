"""Stage one's problems: loaded and checked, fitted to the context, fingerprinted, and cut into chunks of a seeded
visiting order (``Prepared``), as every process of a curation computes them."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

from data_tools import prompts as P
from data_tools import rehearsal
from data_tools.models import resolve_model
from data_tools.problems import LoadResult, load_problems
from data_tools.runio import write_json, write_parquet
from stages.curate_config import CurateConfig


def _model_fingerprint(path: str) -> dict:
    """Path, sha256 of config.json, and weight file sizes: identifies a model dir without hashing GBs."""
    p = Path(path)
    cfg = p / "config.json"
    weights = {f.name: f.stat().st_size for f in sorted(p.glob("*.safetensors"))}
    return {"path": str(p), "config_sha256": hashlib.sha256(cfg.read_bytes()).hexdigest(), "weights": weights}

def _fingerprint(cfg: CurateConfig, models: dict) -> str:
    """What makes finished chunks reusable: data, models, prompts and sampling (not the band filter's settings, which
    only read the samples). ``filter: none`` samples no student (its chunks are done without student parts, and its
    teacher had the whole budget): another curation, and ``student_samples`` is not part of it."""
    keys = ("train_data", "limit", "teacher_context", "privileged_reference", "prompt_style", "teacher_samples", "student_samples",
            "max_tokens", "temperature", "top_p", "seed", "chunk_size", "max_model_len", "dtype")
    if cfg.filter != "pass_rate":
        keys = tuple(k for k in keys if k != "student_samples")
    # chunk i holds the i-th slice of the seeded visiting order (curate()), not of the input file
    extra = {"rehearsal": r} if (r := rehearsal.manifest_record()) else {}  # chunks of a rehearsal never serve a real run
    if cfg.grader_profile != "default":  # chunks keep their verdicts: another profile's are not reused (default: as before)
        extra["grader_profile"] = cfg.grader_profile
    if cfg.filter != "pass_rate":  # the default's fingerprint stays as before (its chunks resume)
        extra["filter"] = cfg.filter
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


@dataclass
class Prepared:
    """Stage one's problems and chunks, as every process of a run computes them (the same for the same config).

    Chunk ``i`` holds problems ``visit[i * chunk_size : (i + 1) * chunk_size]``; a role's samples of it are saved
    as ``parts/<role>-<i>.parquet`` once the chunk is measured whole, or as ``parts/<role>-<i>.partial.parquet``
    when stage one's clock ended inside it (a re-run measures that chunk again and replaces the partial part).
    """

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
    chunk_size: int
    roles: tuple[str, ...] = ("teacher", "student")  # the roles this curation samples (``CurateConfig.roles``)

    def part(self, role: str, i: int, *, partial: bool = False) -> Path:
        return self.parts / f"{role}-{i:05d}{'.partial' if partial else ''}.parquet"

    def have(self, role: str, i: int) -> bool:
        """``role``'s samples of chunk ``i`` are on disk, the whole chunk."""
        return self.part(role, i).exists()

    def done(self, i: int) -> bool:
        """Chunk ``i`` is on disk whole for every role this curation samples (``roles``)."""
        return all(self.have(role, i) for role in self.roles)

    def any_have(self, role: str) -> bool:
        return any(self.have(role, i) for i in range(self.n_chunks))

    def measured_part(self, role: str, i: int) -> Path | None:
        """The part holding ``role``'s samples of chunk ``i``: the whole chunk's, else a partial one, else None."""
        return next((p for p in (self.part(role, i), self.part(role, i, partial=True)) if p.exists()), None)

    def chunk_rows(self, i: int) -> list[dict]:
        return self.visit[i * self.chunk_size : (i + 1) * self.chunk_size]


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
            reason = str(rej["reason"])
            where = "" if reason.startswith(f"row {rej['row_index']}:") else f"row {rej['row_index']} (0-based): "
            print(f"  rejected problem_id {rej['problem_id']}: {where}{reason}", flush=True)
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
    # chunk i is the i-th slice of the visiting order of these problems: the same file read otherwise (rows added to
    # a folder, ids read another way) would map the chunks on disk to other problems, so the ids are part of the state
    ids_sha = hashlib.sha256("\n".join(r["problem_id"] for r in rows).encode()).hexdigest()[:16]
    state = out / "state.json"
    if parent:
        # refuse before writing anything: a refused curation leaves another curation's tables as they were
        old = json.loads(state.read_text()) if state.exists() else {}
        if old and parts.exists() and any(parts.iterdir()):
            if old.get("fingerprint") != fp:
                raise ValueError(f"{out} holds chunks of a different curation (data, models, sampling or filter "
                                 f"changed); use another OUTPUT_DIR or delete {parts}")
            if old.get("problems_sha", ids_sha) != ids_sha:  # a state from before it was recorded: cannot tell
                raise ValueError(f"{out} holds chunks of other problems: {cfg.train_data} now reads {len(rows)} usable "
                                 "problems whose ids differ from those its chunks were measured on (rows added or "
                                 f"changed); use another OUTPUT_DIR or delete {parts}")
        write_parquet(rows, out / "problems.parquet")
        write_json({"fingerprint": fp, "problems_sha": ids_sha}, state)
        parts.mkdir(parents=True, exist_ok=True)
    elif not state.exists() or json.loads(state.read_text()).get("fingerprint") != fp or not parts.is_dir():
        raise ValueError(f"{out}/state.json is not this worker's curation (fingerprint {fp}): start stage one "
                         "without --shard, it starts its workers itself")
    # Chunks are visited in a seeded random order of the problems, so the problems measured before
    # the budget ends are a uniform sample, whatever the input file's order (MATH train is by subject).
    visit = list(rows)
    random.Random(cfg.seed).shuffle(visit)
    n_chunks = (len(visit) + cfg.chunk_size - 1) // cfg.chunk_size
    return Prepared(out, parts, loaded, rows, context_rejects, student, teacher, models, fp, visit, n_chunks,
                    cfg.chunk_size, cfg.roles)
