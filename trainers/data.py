"""Stage two's data: stage one's curriculum parquet in, the trainer's dataset out, the rollout table's schema."""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path


REQUIRED_COLUMNS = ("problem_id", "problem", "answer", "reference")


def load_curriculum(path: str | os.PathLike):
    """Read stage one's ``curriculum.parquet`` as an Arrow table, checking its columns.

    Required: problem_id, problem, answer, reference. Optional: bucket (default 0),
    curriculum_index (default file order), prompt_style, source, level, pass_rate, teacher_pass_rate.

    Raises:
        FileNotFoundError: no such file (run stage one first, or pass --curriculum_path).
        ValueError: a required column is missing, or the table is empty.
    """
    import pyarrow.parquet as pq

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"curriculum {p} not found: run `make curate` first (same OUTPUT_DIR) or pass --curriculum_path")
    table = pq.read_table(p)
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"{p} lacks column(s) {missing}; expected stage one's curriculum schema")
    if table.num_rows == 0:
        raise ValueError(f"{p} has no rows: nothing to train on")
    return table


def build_train_dataset(table, tokenizer, *, prompt_style: str | None = None):
    """Turn a curriculum table into the ``datasets.Dataset`` the trainer reads.

    Columns: ``prompt`` (the student's chat-rendered prompt string, ``data_tools.prompts.render`` of
    ``student_messages``: the same text stage one and evaluation use), ``teacher_prompt`` (render of
    ``privileged_messages`` with the ``reference`` column), ``answer``, ``problem_id``, ``bucket``,
    ``curriculum_index``, ``prompt_style``, ``teacher_solution`` (stage one's verified teacher solution,
    "" when the row has none or the table lacks the column). Rows are in curriculum order.

    Raises:
        ValueError: unknown prompt style, or a tokenizer without a chat template.
    """
    from datasets import Dataset

    from data_tools.prompts import privileged_messages, render, student_messages

    rows = table.to_pylist()
    for i, r in enumerate(rows):
        r.setdefault("bucket", 0)
        r.setdefault("curriculum_index", i)
    rows.sort(key=lambda r: (int(r["curriculum_index"] or 0)))
    out: dict[str, list] = defaultdict(list)
    for r in rows:
        style = prompt_style or r.get("prompt_style") or "reasoning"
        out["prompt"].append(render(tokenizer, student_messages(r["problem"], style)))
        out["teacher_prompt"].append(render(tokenizer, privileged_messages(r["problem"], r["reference"] or "", style)))
        out["answer"].append(str(r["answer"]))
        out["problem_id"].append(str(r["problem_id"]))
        out["bucket"].append(int(r["bucket"] or 0))
        out["curriculum_index"].append(int(r["curriculum_index"] or 0))
        out["prompt_style"].append(style)
        out["teacher_solution"].append(r.get("teacher_solution") or "")  # stage one's verified solution; "" = none
    return Dataset.from_dict(dict(out))


def _rollout_schema():
    import pyarrow as pa

    return pa.schema([("step", pa.int64()), ("problem_id", pa.string()), ("sample_index", pa.int64()),
                      ("bucket", pa.int64()), ("prompt", pa.string()), ("completion", pa.string()),
                      ("reward", pa.float64()), ("correct", pa.bool_()), ("extracted", pa.string()),
                      ("n_tokens", pa.int64()), ("finish_reason", pa.string()), ("advantage", pa.float64()),
                      ("seq_kl", pa.float64()), ("behaviour_step", pa.int64())])


#: One row per sampled completion (``rollouts/step-XXXXXX.parquet``); ``seq_kl`` = sum over the
#: completion's tokens of k1 = log pi_student - log pi_teacher (sampled reverse-KL estimate, nats);
#: ``step`` = the optimizer step that first trained on it; ``behaviour_step`` = optimizer steps in the weights
#: that sampled it (``step - 1`` on-policy, ``step - 2`` under ``async_generation``'s one-step prefetch).
ROLLOUT_SCHEMA = _rollout_schema()
