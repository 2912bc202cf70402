"""CLI: ``python -m data_tools.grader [--profile formal] FILE.jsonl``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from . import ANSWER_FILTERS, PROFILES, grade_batch


class _JSONFloat(float):
    """A JSON number with a fraction or exponent, remembering its text ("0.10", "1e-7") exactly."""

    text: str

    def __new__(cls, text: str) -> "_JSONFloat":
        obj = super().__new__(cls, text)
        obj.text = text
        return obj


class _JSONInt(int):
    """A JSON integer, remembering its text."""

    text: str

    def __new__(cls, text: str) -> "_JSONInt":
        obj = super().__new__(cls, text)
        obj.text = text
        return obj


class _JSONBigInt(str):
    """A JSON integer past int()'s 4,300-digit limit: kept as its digits."""


def _parse_int(text: str):
    return _JSONInt(text) if len(text) <= 4000 else _JSONBigInt(text)


def _json_type(v) -> str:
    kinds = {dict: "an object", list: "an array", bool: "a boolean", type(None): "null", str: "a string",
             float: "a non-finite number (NaN/Infinity)"}
    return kinds.get(type(v), "a number" if isinstance(v, (int, float, _JSONBigInt)) else type(v).__name__)


def _answer_field(obj: dict, key: str) -> str | None:
    """The field as answer text: a string, or a JSON number as written ("gold": 0.10 -> "0.10"); None
    for anything else. Booleans are not numbers here."""
    v = obj.get(key)
    if isinstance(v, (_JSONFloat, _JSONInt)):
        return v.text
    if isinstance(v, str):
        return str(v)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m data_tools.grader FILE.jsonl``: add ``correct``, ``extracted``, ``grader_path``.

    Each input line is a JSON object with ``gold`` and ``pred``, each a string or a JSON number (an
    integer or a decimal, read as its exact text: ``"gold": 0.10`` is the answer ``0.10``), and an
    optional boolean ``truncated``; output lines go to stdout in input order, a number field echoed
    as its text. A bad line (not JSON, not an object, a field missing or of another type) is
    reported on stderr with its line number and the field, echoed with ``correct: false`` and an
    ``error`` field, and makes the exit code 1. ``-`` reads stdin.
    """
    ap = argparse.ArgumentParser(prog="python -m data_tools.grader", description=main.__doc__)
    ap.add_argument("file", help="JSON-lines file with 'gold' and 'pred' fields, or - for stdin")
    ap.add_argument("--timeout", type=float, default=5.0, help="seconds per answer for sympy")
    ap.add_argument("--workers", type=int, default=None, help="grading threads (default: cores)")
    ap.add_argument("--answer_filter", default="math", choices=ANSWER_FILTERS,
                    help="math: equal as mathematics; numeric: a number gold needs a number literal (module docstring)")
    ap.add_argument("--profile", default="default", choices=PROFILES,
                    help="default: the pipeline above; formal: the formal metric's rule (only the last \\boxed{}, an "
                         "integer gold needs the integer itself; --answer_filter does not apply)")
    args = ap.parse_args(argv)

    try:
        if args.file == "-":
            lines = sys.stdin.read().splitlines()
        else:
            with open(args.file, encoding="utf-8") as f:
                lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        print(f"grader: error: cannot read {args.file}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return 2

    rows: list[dict] = []
    todo: list[int] = []
    bad = 0
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        err = None
        try:
            obj = json.loads(line, parse_float=_JSONFloat, parse_int=_parse_int)
        except (json.JSONDecodeError, ValueError) as e:
            obj, err = {"line": line}, f"not JSON: {getattr(e, 'msg', e)}"
        if err is None and not isinstance(obj, dict):
            obj, err = {"line": obj}, f"not a JSON object (got {_json_type(obj)})"
        if err is None:
            problems = []
            for k in ("gold", "pred"):
                text = _answer_field(obj, k)
                if text is None:
                    problems.append(f"'{k}' missing" if k not in obj else
                                    f"'{k}' must be a string or a number, got {_json_type(obj[k])}")
                else:
                    obj[k] = text
            if "truncated" in obj and not isinstance(obj["truncated"], bool):
                problems.append(f"'truncated' must be true or false, got {_json_type(obj['truncated'])}")
            if problems:
                err = "; ".join(problems)
        if err is not None:
            bad += 1
            print(f"{args.file}:{i}: {err}", file=sys.stderr)
            obj.update(correct=False, extracted=None, grader_path="error", error=err)
        else:
            todo.append(len(rows))
        rows.append(obj)

    verdicts = grade_batch(
        [rows[j]["pred"] for j in todo],
        [rows[j]["gold"] for j in todo],
        truncated=[bool(rows[j].get("truncated", False)) for j in todo],
        timeout_s=args.timeout,
        workers=args.workers,
        answer_filter=args.answer_filter,
        profile=args.profile,
    )
    for j, v in zip(todo, verdicts):
        rows[j].update(correct=v.correct, extracted=v.extracted, grader_path=v.path)
    out = sys.stdout
    for r in rows:
        out.write(json.dumps(r, ensure_ascii=False) + "\n")
    out.flush()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
