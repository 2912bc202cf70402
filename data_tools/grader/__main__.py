"""CLI: ``python -m data_tools.grader FILE.jsonl``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from . import ANSWER_FILTERS, grade_batch


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m data_tools.grader FILE.jsonl``: add ``correct``, ``extracted``, ``grader_path``.

    Each input line is JSON with ``gold`` and ``pred`` (optional ``truncated``); output lines
    go to stdout in input order. A bad line (not JSON, not an object, missing/non-string field)
    is reported on stderr with its line number, echoed with ``correct: false`` and an ``error``
    field, and makes the exit code 1. ``-`` reads stdin.
    """
    ap = argparse.ArgumentParser(prog="python -m data_tools.grader", description=main.__doc__)
    ap.add_argument("file", help="JSON-lines file with 'gold' and 'pred' fields, or - for stdin")
    ap.add_argument("--timeout", type=float, default=5.0, help="seconds per answer for sympy")
    ap.add_argument("--workers", type=int, default=None, help="grading threads (default: cores)")
    ap.add_argument("--answer_filter", default="math", choices=ANSWER_FILTERS,
                    help="math: equal as mathematics; numeric: a number gold needs a number literal (module docstring)")
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
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            obj, err = {"line": line}, f"not JSON: {e.msg}"
        if err is None and not isinstance(obj, dict):
            obj, err = {"line": obj}, "not a JSON object"
        if err is None and isinstance(obj.get("gold"), int) and not isinstance(obj["gold"], bool):
            obj["gold"] = str(obj["gold"])  # an integer gold ("gold": 42) is unambiguous
        if err is None:
            missing = [k for k in ("gold", "pred") if not isinstance(obj.get(k), str)]
            if missing:
                err = "missing or non-string field(s): " + ", ".join(missing)
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
