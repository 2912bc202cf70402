"""duckdb SQL over a run's tables.

    python -m data_tools.query "SELECT role, avg(correct::INT) FROM rollouts GROUP BY role"
    make query SQL="..."                       # OUTPUT_DIR picks the run

Views (each present only when its files exist under ``OUTPUT_DIR``):

=================  ==============================================  ==========================
view               file(s)                                          one row per
=================  ==============================================  ==========================
problems           curate/problems.parquet                          loaded input problem
rollouts           curate/rollouts.parquet                          curation sample (teacher / student)
curriculum         curate/curriculum.parquet                        kept problem, in curriculum order
rejects            curate/rejects.parquet                           rejected row, with its reason
train_rollouts     rollouts/step-*.parquet                          training completion
metrics            metrics/train.jsonl                              training step
eval_samples       eval/*/samples.parquet                           evaluation sample
eval_problems      eval/*/problems.parquet                          evaluated problem
eval_summary       eval/*/summary.json                              evaluation run
=================  ==============================================  ==========================

``problem_id`` is the join key across all of them, so one problem can be followed from curation
through training to evaluation.

Read only: a query cannot change a run's tables. The connection is in memory; once the views exist,
duckdb's own settings restrict it to reading the files behind them (``allowed_paths``, with
``enable_external_access`` off, so no other file, extension or network) and are locked
(``lock_configuration``). ``allowed_paths`` lets duckdb write to those files too (a ``COPY ... TO`` one of
them with ``USE_TMP_FILE false`` replaced it, duckdb 2.0.1), so only statements duckdb's parser types as
SELECT run (``SELECT``, ``WITH``, ``FROM``, ``VALUES``, ``DESCRIBE``, ``SUMMARIZE``, ``SHOW``); ``COPY``,
``ATTACH``, ``EXPORT``, ``CREATE``, ``EXPLAIN ANALYZE`` (which executes its statement) and the rest are refused.
"""

from __future__ import annotations

import argparse
import csv
import glob
import sys
from pathlib import Path

try:
    import duckdb
except ImportError:  # optional: bash run.sh never needs it (the formal image has none); make query does
    duckdb = None

from data_tools.runio import default_output_dir

VIEWS = {
    "problems": ("parquet", "curate/problems.parquet"),
    "rollouts": ("parquet", "curate/rollouts.parquet"),
    "curriculum": ("parquet", "curate/curriculum.parquet"),
    "rejects": ("parquet", "curate/rejects.parquet"),
    "train_rollouts": ("parquet", "rollouts/step-*.parquet"),
    "metrics": ("json", "metrics/train.jsonl"),
    "eval_samples": ("parquet", "eval/*/samples.parquet"),
    "eval_problems": ("parquet", "eval/*/problems.parquet"),
    "eval_summary": ("json", "eval/*/summary.json"),
}


class ReadOnlyError(ValueError):
    """A statement that is not a read (COPY, ATTACH, CREATE, SET, ...) was refused."""


def _lit(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def connect(run_dir: str | Path) -> tuple[duckdb.DuckDBPyConnection, list[str]]:
    """An in-memory duckdb connection with a view per table found under ``run_dir``; returns (con, views).

    The connection reads only the files behind its views: ``allowed_paths`` holds exactly them,
    ``enable_external_access`` is off and the configuration is locked, so other files, extensions and
    ``SET`` are refused by duckdb. Run statements through :func:`run_sql`, which also refuses writes to
    those files (see the module docstring).

    Raises:
        RuntimeError: this duckdb cannot restrict file access (no ``allowed_paths`` setting).
    """
    run_dir = Path(run_dir)
    con = duckdb.connect()
    made, files = [], []
    for name, (kind, pattern) in VIEWS.items():
        path = str(run_dir / pattern)
        found = sorted(glob.glob(path))
        if not found:
            continue
        lit = "[" + ", ".join(_lit(f) for f in found) + "]"  # the files of now: the lock below allows only them
        if kind == "parquet":
            src = f"read_parquet({lit}, union_by_name=true, filename=true)"
        else:
            src = f"read_json_auto({lit}, format='auto', union_by_name=true, filename=true)"
        try:
            con.execute(f"CREATE VIEW {name} AS SELECT * FROM {src}")
            con.execute(f"SELECT * FROM {name} LIMIT 0")
        except duckdb.Error as e:  # one unreadable table must not hide the others
            con.execute(f"DROP VIEW IF EXISTS {name}")
            print(f"query: view {name} skipped ({path}): {str(e).splitlines()[0]}", file=sys.stderr)
            continue
        made.append(name)
        files += found
    try:
        con.execute(f"SET allowed_paths = [{', '.join(_lit(f) for f in files)}]")
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
    except duckdb.Error as e:
        con.close()
        raise RuntimeError(f"duckdb {duckdb.__version__} cannot restrict file access ({str(e).splitlines()[0]}): "
                           "make query does not run without it (duckdb >= 2.0 does)") from None
    return con, made


def run_sql(con: duckdb.DuckDBPyConnection, sql: str):
    """Run ``sql`` (one or more statements) if each is a read; the last one's relation (None if it has none).

    Raises:
        ReadOnlyError: a statement duckdb's parser does not type as SELECT; nothing of ``sql`` has run.
        duckdb.Error: a statement that does not parse or fails.
    """
    for st in con.extract_statements(sql):
        if st.type != duckdb.StatementType.SELECT:
            kind = str(st.type).rsplit(".", 1)[-1]
            raise ReadOnlyError(f"{kind} refused: make query only reads a run's tables (SELECT, WITH, FROM, VALUES, "
                                "DESCRIBE, SUMMARIZE, SHOW); copy what you need out of its output instead")
    return con.sql(sql)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data_tools.query", description=__doc__.split("\n\n")[0])
    ap.add_argument("sql", nargs="?", help="SQL to run; without it, list the views and their row counts")
    ap.add_argument("--run", default=None, help="run directory (default: $OUTPUT_DIR or the default run)")
    ap.add_argument("--max-rows", type=int, default=40, help="rows to print")
    ap.add_argument("--csv", action="store_true", help="print CSV instead of a table")
    args = ap.parse_args(argv)
    run = Path(args.run) if args.run else default_output_dir()
    if not run.exists():
        print(f"query: run directory {run} does not exist (set OUTPUT_DIR or --run)", file=sys.stderr)
        return 1
    if duckdb is None:
        print(f"query: duckdb is not installed, and make query needs it (pip install 'duckdb>=2.0,<2.1'); the tables "
              f"themselves are parquet / JSON files under {run}, readable with pyarrow", file=sys.stderr)
        return 1
    try:
        con, views = connect(run)
    except RuntimeError as e:
        print(f"query: {e}", file=sys.stderr)
        return 1
    if not views:
        print(f"query: no tables under {run} yet (run make curate first)", file=sys.stderr)
        return 1
    if not args.sql:
        print(f"run: {run}")
        for v in views:
            print(f"  {v:15s} {con.execute(f'SELECT count(*) FROM {v}').fetchone()[0]:>8} rows")
        return 0
    try:
        rel = run_sql(con, args.sql)
    except ReadOnlyError as e:
        print(f"query: {e}", file=sys.stderr)
        return 1
    except duckdb.Error as e:
        print(f"query: {e}\n(views here: {', '.join(views)})", file=sys.stderr)
        return 1
    if rel is None:
        return 0
    if args.csv:  # written by Python: the locked connection writes no file, /dev/stdout included
        out = csv.writer(sys.stdout, lineterminator="\n")
        out.writerow(rel.columns)
        out.writerows(rel.fetchall())
    else:
        rel.show(max_rows=args.max_rows, max_width=200)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
