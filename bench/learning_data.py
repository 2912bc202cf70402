"""The problems of bench/learning.py: which problems the start, the teacher and the arms train on, and the held-out
set every mark is scored on (``data/*.parquet`` of a run directory); the run directory's start model and the YAML
recipes the stages read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.learning_config import LearningConfig


def build_data(cfg: LearningConfig) -> dict[str, Path]:
    """Write ``data/train.parquet``, ``data/test.parquet`` and the trainer's ``data/curriculum.parquet``.

    Ladder: ``data_tools.synth`` hard ladder, train/test split by problem hash. GSM8K: the first rows of
    ``gsm8k_train.jsonl`` (as many as the start, the teacher and the arms train on) and the first ``n_test`` of
    ``gsm8k_test.jsonl`` (a fixed subset), reference solutions with the calculator annotations removed. ``train_data``: that file's
    problems in order, the held-out set ``test_data``'s first ``n_test`` or else the file's last ``n_test``; a
    reference solution without a ``\\boxed`` answer gets the answer stated in one (``data_tools.problems`` reads
    GSM8K's ``#### N``). Which problems the start, the teacher and the arms train on: ``--teacher_n_train``,
    ``--fresh_arm_problems``, ``--unseen_arm_problems``.

    Raises:
        FileNotFoundError: a data file missing.
        ValueError: a file with fewer problems than asked for, or a held-out problem that is also a training one.
    """
    from data_tools.problems import load_problems
    from data_tools.runio import write_parquet

    d = cfg.dir / "data"
    seen_apart = cfg.unseen_arm_problems  # the start's and the teacher's problems, then the arms' after them
    keys = (("train", "test", "curriculum")
            + (("teacher_curriculum",) if cfg.teacher_n_train > cfg.n_train or seen_apart else ())
            + (("start_curriculum",) if cfg.fresh_arm_problems or seen_apart else ()))
    paths = {k: d / f"{k}.parquet" for k in keys}
    if all(p.exists() for p in paths.values()):
        return paths
    n_teacher = max(cfg.n_train, cfg.teacher_n_train)
    n_pool = n_teacher + (cfg.n_train if seen_apart else 0)
    # every loader is prefix-stable: the first n_train of the teacher's problems are the start's training problems,
    # and the arms' too unless fresh_arm_problems / unseen_arm_problems give them the next n_train
    if cfg.train_data:
        loaded = load_problems(cfg.train_data)
        print(f"[learning] {loaded.report()}", flush=True)
        rows = loaded.rows
        if cfg.test_data:
            held = load_problems(cfg.test_data, split="test")
            print(f"[learning] {held.report()}", flush=True)
            pool, test, need = rows[:n_pool], held.rows[:cfg.n_test], {cfg.train_data: n_pool, cfg.test_data: cfg.n_test}
            have = {cfg.train_data: len(rows), cfg.test_data: len(held.rows)}
        else:  # the file's last n_test problems are held out: disjoint from the first n_pool by position
            pool, test = rows[:n_pool], rows[len(rows) - cfg.n_test:] if cfg.n_test <= len(rows) else []
            need, have = {cfg.train_data: n_pool + cfg.n_test}, {cfg.train_data: len(rows)}
        short = [f"{f} has {have[f]} usable problems, {need[f]} needed" for f in need if have[f] < need[f]]
        if short:
            raise ValueError("; ".join(short) + f" (n_train {cfg.n_train}, teacher_n_train {cfg.teacher_n_train}, "
                             f"n_test {cfg.n_test}{', unseen_arm_problems' if seen_apart else ''})")
        for r in pool + test:  # the answer stated where the grader looks for it, as the GSM8K task does
            if r.get("solution") and "\\boxed" not in r["solution"]:
                r["solution"] = f"{r['solution']}\nThe answer is \\boxed{{{r['answer']}}}."
        check_disjoint(pool, test, cfg.train_data, cfg.test_data or cfg.train_data)
    elif cfg.task == "ladder":
        pool = load_problems(f"synth-hard:train:{n_pool}", seed=cfg.seed).rows
        test = load_problems(f"synth-hard:test:{cfg.n_test}", seed=cfg.seed).rows
    else:
        g = Path(cfg.gsm8k_dir)
        pool = load_problems(g / "gsm8k_train.jsonl", limit=n_pool).rows
        test = load_problems(g / "gsm8k_test.jsonl", limit=cfg.n_test).rows
        for r in pool + test:  # GSM8K rationale, then the answer the grader looks for
            r["solution"] = f"{r['solution']}\nThe answer is \\boxed{{{r['answer']}}}."
        if len(pool) < n_pool:
            raise ValueError(f"{g / 'gsm8k_train.jsonl'} has {len(pool)} problems; n_train / teacher_n_train ask "
                             f"for {n_pool}")
    if seen_apart:
        train = pool[n_teacher:n_teacher + cfg.n_train]  # after every problem the start or the teacher trains on
    else:
        first = 1 if cfg.fresh_arm_problems else 0
        train = pool[first * cfg.n_train:(first + 1) * cfg.n_train]  # the arms' problems (stage one's too)
    write_parquet(train, paths["train"])
    write_parquet(test, paths["test"])

    source = Path(cfg.train_data).stem if cfg.train_data else cfg.task

    def curriculum(rows: list[dict]) -> list[dict]:  # stage one's schema (trainers.data.load_curriculum)
        return [dict(problem_id=r["problem_id"], problem=r["problem"], answer=r["answer"], reference=r["solution"],
                     bucket=int(r.get("level") or 0) if str(r.get("level") or "").isdigit() else 0,
                     curriculum_index=i, prompt_style=cfg.prompt_style, source=r.get("source") or source)
                for i, r in enumerate(rows)]

    write_parquet(curriculum(train), paths["curriculum"])  # shuffled by the trainer
    if "teacher_curriculum" in paths:
        write_parquet(curriculum(pool[:n_teacher]), paths["teacher_curriculum"])
    if "start_curriculum" in paths:  # the start's SFT: problems no arm trains on (unseen: the teacher's too)
        write_parquet(curriculum(pool[:n_teacher] if seen_apart else pool[:cfg.n_train]), paths["start_curriculum"])
    return paths


def check_disjoint(train: list[dict], test: list[dict], train_src: str, test_src: str) -> None:
    """Raise ValueError naming the first held-out problem (id and file) whose text, whitespace and case folded, is
    also a training problem's."""
    def key(r: dict) -> str:
        return " ".join(str(r["problem"]).split()).lower()

    seen = {key(r): r["problem_id"] for r in train}
    for r in test:
        if key(r) in seen:
            raise ValueError(f"held-out problem {r['problem_id']!r} of {test_src} is also training problem "
                             f"{seen[key(r)]!r} of {train_src}: the held-out set must be disjoint")


def read_rows(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def _yaml(recipe: dict, dest: Path) -> Path:
    """Write a recipe (a stage's config as a dict) as the YAML file the stage parses (``data_tools.config``)."""
    import yaml

    from data_tools.runio import write_text

    return write_text(yaml.safe_dump(recipe, sort_keys=False), dest)


def start_path(cfg: LearningConfig) -> str:
    """The arms' start model recorded in ``settings.json``: the given student, or ``<out>/start``, which follows
    the run directory when it was moved (tables copied back from a GPU machine keep their settings)."""
    settings = json.loads((cfg.dir / "settings.json").read_text())
    path = settings["start_path"]
    # out is recorded resolved since 2026-12-03; an older relative one is resolved from here, as it was typed
    if settings.get("out") and Path(path) == Path(settings["out"]).expanduser().resolve() / "start":
        return str(cfg.dir / "start")
    return path
