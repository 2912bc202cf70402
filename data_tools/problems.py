"""Loading math problems: jsonl, parquet, a ``datasets`` directory, or the synthetic generator.

Accepts the usual column names (design.md section 3) and reports which ones it used. Every row
that cannot be used goes to ``rejects`` with its reason, never silently dropped: no problem text,
no answer, an answer the grader cannot parse, or a duplicate of an earlier problem.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from data_tools.grader import extract_gsm8k_answer, parse_gold
from data_tools.synth import generate

#: Accepted column names per role, in order of preference.
PROBLEM_COLUMNS = ("problem", "question", "prompt", "query", "input")
ANSWER_COLUMNS = ("answer", "final_answer", "gold", "target", "expected_answer")
SOLUTION_COLUMNS = ("solution", "reference_solution", "rationale")
ID_COLUMNS = ("problem_id", "unique_id", "id", "idx")
SOURCE_COLUMNS = ("source", "data_source", "subject", "type")
LEVEL_COLUMNS = ("level", "difficulty")

_GSM8K = re.compile(r"####\s*(.+?)\s*$", re.S)
_CALC = re.compile(r"<<[^>]*>>")  # GSM8K calculator annotations: "<<48/2=24>>"


@dataclass
class LoadResult:
    """Problems read from one source.

    ``rows``: dicts with problem_id, problem, answer, solution (str|None), source, level (str|None).
    ``rejects``: dicts with row_index, problem_id, reason, raw (the row as JSON, for the record).
    ``columns``: role -> column name used (e.g. ``{"problem": "question", "answer": "answer (#### N)"}``).
    ``duplicates``: rows that repeat an earlier problem text with the same answer (rejected as duplicates).
    ``conflicts``: rows that repeat an earlier problem text with a different answer (rejected as conflicts).
    Each repeated row is counted once, in one of the two: ``duplicates + conflicts`` rows repeated a problem.
    """

    source: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    rejects: list[dict[str, Any]] = field(default_factory=list)
    columns: dict[str, str] = field(default_factory=dict)
    duplicates: int = 0
    conflicts: int = 0
    n_read: int = 0

    def report(self) -> str:
        """One line for the log: counts and the columns used."""
        cols = ", ".join(f"{k}<-{v}" for k, v in self.columns.items())
        return (f"{self.source}: read {self.n_read} rows, kept {len(self.rows)}, rejected {len(self.rejects)} "
                f"({self.duplicates} duplicates, {self.conflicts} duplicates with a conflicting answer); columns: {cols}")


def _read_records(path: Path) -> list[dict[str, Any]]:
    if path.is_dir():
        from datasets import load_from_disk  # heavy (seconds), for a datasets directory only

        ds = load_from_disk(str(path))
        if hasattr(ds, "keys"):  # a DatasetDict: take "train" or the only split
            splits = list(ds.keys())
            ds = ds["train"] if "train" in ds else ds[splits[0]]
        return [dict(r) for r in ds]
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        with open(path, "rb") as f:
            data = f.read()
        if suffix == ".json" and data.lstrip()[:1] == b"[":  # one JSON array of objects
            try:
                items = json.loads(data.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}: not a valid JSON array: {e}") from None
            return [rec if isinstance(rec, dict) else {"__error__": f"item {i} is not a JSON object",
                                                       "__raw__": str(rec)[:500]} for i, rec in enumerate(items)]
        records = []
        for i, raw in enumerate(data.splitlines(), 1):
            if not raw.strip():
                continue
            try:  # decoded per line, so one bad byte rejects its line, not the file
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                records.append({"__error__": f"line {i} is not UTF-8 ({e.reason} at byte {e.start})",
                                "__raw__": raw[:500].decode("utf-8", "replace")})
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                records.append({"__error__": f"line {i} is not valid JSON: {e.msg}", "__raw__": line[:500]})
                continue
            records.append(rec if isinstance(rec, dict) else {"__error__": f"line {i} is not a JSON object"})
        return records
    if suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    raise ValueError(f"{path}: unsupported data file (use .jsonl, .parquet or a datasets directory)")


def _pick(columns: set[str], candidates: tuple[str, ...]) -> str | None:
    return next((c for c in candidates if c in columns), None)


def _text(v: Any) -> str:
    return "" if v is None else str(v).strip()


def load_problems(source: str | Path, *, limit: int | None = None, seed: int = 0) -> LoadResult:
    """Read problems from ``source``: a file / ``datasets`` dir, or ``synth:<split>:<n>`` (e.g. ``synth:train:200``;
    ``synth-hard:<split>:<n>`` for the hard ladder, ``data_tools.synth``).

    ``limit`` keeps the first N input rows (before rejects). Answers are validated with the grader's
    :func:`data_tools.grader.parse_gold`; GSM8K answers (rationale then ``#### N``) are split into
    the number (answer) and the rationale without calculator annotations (solution).

    Raises:
        FileNotFoundError: no such file.
        ValueError: unsupported file type, an empty file, or no problem / answer column (the message
            lists the columns found and the names accepted).
    """
    src = str(source)
    if src.startswith(("synth:", "synth-hard:")):
        parts = src.split(":")
        if len(parts) != 3 or not parts[2].isdigit():
            raise ValueError(f"synthetic source must look like {parts[0]}:<train|test>:<n>, got {src!r}")
        n = int(parts[2]) if limit is None else min(int(parts[2]), limit)
        rows = generate(parts[1], n, seed=seed, ladder="hard" if parts[0] == "synth-hard" else "easy")
        return LoadResult(src, rows=rows, n_read=len(rows),
                          columns={"problem": "synth", "answer": "synth", "solution": "synth"})

    path = Path(src).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"data source {src} does not exist")
    records = _read_records(path)
    if not records:
        raise ValueError(f"{src}: no rows (the file is empty)")
    if limit is not None:
        records = records[:limit]
    res = LoadResult(src, n_read=len(records))
    cols = set().union(*(r.keys() for r in records)) - {"__error__", "__raw__"}
    pc, ac = _pick(cols, PROBLEM_COLUMNS), _pick(cols, ANSWER_COLUMNS)
    if (pc is None or ac is None) and any("__error__" not in r for r in records):
        raise ValueError(f"{src}: need a problem column (one of {PROBLEM_COLUMNS}) and an answer column "
                         f"(one of {ANSWER_COLUMNS}); found columns {sorted(cols)}")
    sc, ic = _pick(cols, SOLUTION_COLUMNS), _pick(cols, ID_COLUMNS)
    src_c, lc = _pick(cols, SOURCE_COLUMNS), _pick(cols, LEVEL_COLUMNS)
    res.columns = {k: v for k, v in dict(problem=pc, answer=ac, solution=sc, id=ic, source=src_c, level=lc).items() if v}
    stem = path.stem if path.is_file() else path.name
    seen: dict[str, tuple[str, str]] = {}  # normalised problem text -> (problem_id, answer)
    ids: set[str] = set()
    gsm8k_rows = 0
    for i, rec in enumerate(records):
        pid = _text(rec.get(ic)) if ic else ""
        pid = pid or f"{stem}-{i}"

        def reject(reason: str) -> None:
            res.rejects.append({"row_index": i, "problem_id": pid, "reason": reason,
                                "raw": json.dumps(rec, default=str)[:2000]})

        if "__error__" in rec:
            reject(rec["__error__"])
            continue
        problem, answer_raw = _text(rec.get(pc)), _text(rec.get(ac))
        solution = _text(rec.get(sc)) if sc else ""
        if not problem:
            reject(f"empty problem (column {pc!r})")
            continue
        if not answer_raw:
            reject(f"no answer (column {ac!r})")
            continue
        answer = answer_raw
        if "####" in answer_raw:  # GSM8K: rationale, then "#### N"
            gsm8k_rows += 1
            answer = extract_gsm8k_answer(answer_raw) or ""
            solution = solution or _CALC.sub("", _GSM8K.sub("", answer_raw)).strip()
            if not answer:
                reject(f"GSM8K answer without a number after ####: {answer_raw[-80:]!r}")
                continue
        gold = parse_gold(answer)
        if gold is None:
            reject(f"answer does not parse: {answer[:200]!r}")
            continue
        key = " ".join(problem.split()).lower()
        if key in seen:  # counted once: a conflict (another answer) or a duplicate (the same answer)
            first_id, first_answer = seen[key]
            if first_answer != gold:
                res.conflicts += 1
                reject(f"conflict: duplicate problem with a different answer ({gold!r} here, {first_answer!r} in {first_id})")
            else:
                res.duplicates += 1
                reject(f"duplicate problem (first seen as {first_id})")
            continue
        if pid in ids:
            reject(f"duplicate problem_id {pid!r} (column {ic!r}) for a different problem")
            continue
        seen[key] = (pid, gold)
        ids.add(pid)
        res.rows.append({"problem_id": pid, "problem": problem, "answer": gold, "solution": solution or None,
                         "source": _text(rec.get(src_c)) or None if src_c else None,
                         "level": _text(rec.get(lc)) or None if lc else None})
    if gsm8k_rows:
        res.columns["answer"] = f"{ac} (GSM8K '#### N' in {gsm8k_rows} rows)"
    return res
