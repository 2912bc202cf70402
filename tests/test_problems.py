"""Problem loading: column detection, GSM8K answers, rejects with reasons, duplicates, synthetic splits."""

import json
import re
import os
from fractions import Fraction
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_tools.grader import grade_batch
from data_tools.problems import load_problems
from data_tools.synth import generate

SHARED = Path(os.environ.get("OPD_SHARED_DIR", Path(__file__).resolve().parents[2] / "shared"))


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_columns_rejects_and_duplicates(tmp_path):
    f = _jsonl(tmp_path / "d.jsonl", [
        {"question": "What is 2+2?", "final_answer": "4", "id": "a"},
        {"question": "  ", "final_answer": "1", "id": "b"},                 # empty problem
        {"question": "What is 3+3?", "id": "c"},                            # no answer
        {"question": "What is 2+2?", "final_answer": "4", "id": "d"},      # duplicate of a
        "not json at all",
        {"question": "Name it.", "final_answer": "\\frac{", "id": "e"},    # answer that does not parse
        {"question": "What is 5+5?", "final_answer": "10", "id": "a"},     # reused id
    ])
    res = load_problems(f)
    assert res.columns["problem"] == "question" and res.columns["answer"] == "final_answer"
    assert [r["problem_id"] for r in res.rows] == ["a", "a@row6"]  # a reused id: kept under an id of its own
    reasons = {r["problem_id"]: r["reason"] for r in res.rejects}
    assert "empty problem" in reasons["b"]
    assert "no answer" in reasons["c"]
    assert "duplicate problem (first seen as a)" in reasons["d"]
    assert "does not parse" in reasons["e"]
    assert any("line 5 is not valid JSON" in r["reason"] for r in res.rejects)
    assert res.reused_ids == 1 and res.reused_id_rows == ["a@row6"]
    assert res.duplicates == 1 and len(res.rejects) == 5 and res.n_read == 7


def test_a_reused_id_never_takes_an_id_in_use(tmp_path):
    f = _jsonl(tmp_path / "ids.jsonl", [
        {"question": "What is 1+1?", "final_answer": "2", "id": "x"},
        {"question": "What is 1+2?", "final_answer": "3", "id": "x@row2"},
        {"question": "What is 1+3?", "final_answer": "4", "id": "x"},       # x@row2 is taken: x@row2.1
        {"question": "What is 1+4?", "final_answer": "5", "id": "x"},
    ])
    res = load_problems(f)
    assert [r["problem_id"] for r in res.rows] == ["x", "x@row2", "x@row2.1", "x@row3"]
    assert [r["answer"] for r in res.rows] == ["2", "3", "4", "5"] and not res.rejects and res.reused_ids == 2


def test_gsm8k_answers_and_parquet(tmp_path):
    rows = [{"question": "Tom has 3 apples and buys 1,200 more. How many?",
             "answer": "He has 3 + 1200 = <<3+1200=1203>>1203 apples.\n#### 1,203"},
            {"question": "Broken row", "answer": "no number here ####  "}]
    f = tmp_path / "g.parquet"
    pq.write_table(pa.Table.from_pylist(rows), f)
    res = load_problems(f)
    assert len(res.rows) == 1 and res.rows[0]["answer"] == "1203"
    assert "<<" not in res.rows[0]["solution"] and "1203 apples" in res.rows[0]["solution"]
    assert "GSM8K" in res.columns["answer"]
    assert len(res.rejects) == 1


def test_missing_columns_is_a_clear_error(tmp_path):
    f = _jsonl(tmp_path / "x.jsonl", [{"text": "hi", "label": 1}])
    with pytest.raises(ValueError, match="need a problem column"):
        load_problems(f)
    with pytest.raises(FileNotFoundError):
        load_problems(tmp_path / "nope.jsonl")


def test_synthetic_splits_are_disjoint_and_deterministic():
    train, test = generate("train", 300), generate("test", 100)
    assert len(train) == 300 and len(test) == 100
    assert not {r["problem"] for r in train} & {r["problem"] for r in test}
    assert generate("train", 10) == train[:10]
    assert {r["level"] for r in train} == {"1", "2", "3", "4", "5"}
    r = load_problems("synth:test:20")
    assert len(r.rows) == 20 and not r.rejects


def _independent_answer(problem: str) -> Fraction:
    """Recompute a hard-ladder answer from the problem text alone (not from the generator's code)."""
    m = re.fullmatch(r"What is ([\d/ x+\-]+)\?(?: Give the answer.*)?", problem)
    if m:  # arithmetic: evaluate with Python's precedence, '/' as exact division
        expr = re.sub(r"(\d+)/(\d+)", r"Fraction(\1, \2)", m.group(1).replace(" x ", " * "))
        return Fraction(eval(expr, {"Fraction": Fraction}))  # noqa: S307 - generated digits and operators only
    nums = [int(x) for x in re.findall(r"\d+", problem)]
    if "pencils" in problem:
        a, b, c = nums
        return Fraction(a * b - c)
    if "change" in problem:
        a, b, m = nums
        return Fraction(m - a * b)
    if "cookies" in problem:
        n, k, e = nums
        return Fraction(n // k - e)
    if "train" in problem:
        v, t, d = nums
        return Fraction(v * t + d)
    a, b, p = nums
    return Fraction(p * (a + b))


def test_hard_ladder_answers_are_right_and_graded_correct():
    rows = generate("test", 120, ladder="hard")
    assert {r["level"] for r in rows} == {"1", "2", "3", "4", "5", "6"}
    assert all(r["problem_id"].startswith("synth-hard-test-") and r["source"] == "synth-hard" for r in rows)
    for r in rows:
        want = _independent_answer(r["problem"])
        assert want > 0, r
        got = Fraction(*map(int, re.findall(r"-?\d+", r["answer"]))) if "frac" in r["answer"] else Fraction(r["answer"])
        assert got == want, (r["problem"], r["answer"], want)
    # the worked solutions end in the answer, and the grader accepts them (what the teacher is trained on)
    verdicts = grade_batch([r["solution"] for r in rows], [r["answer"] for r in rows])
    assert all(v.correct for v in verdicts)
    wrong = grade_batch(["The answer is \\boxed{7}."] * 5, [r["answer"] for r in rows[:5]])
    assert not any(v.correct for v in wrong)
    # splits are disjoint, the easy ladder's draws are unchanged by the second ladder, loader spec works
    train = generate("train", 600, ladder="hard")
    assert not {r["problem"] for r in train} & {r["problem"] for r in generate("test", 300, ladder="hard")}
    assert load_problems("synth-hard:train:30").rows == train[:30]
    with pytest.raises(ValueError, match="ladder"):
        generate("train", 3, ladder="medium")


@pytest.mark.skipif(not (SHARED / "data" / "gsm8k_train.jsonl").exists(), reason="../shared/data not available")
def test_real_gsm8k_rows():
    res = load_problems(SHARED / "data" / "gsm8k_train.jsonl", limit=200)
    assert res.n_read == 200
    assert len(res.rows) + len(res.rejects) == 200
    assert len(res.rows) >= 198
    assert all(r["answer"].lstrip("-").replace(".", "").isdigit() for r in res.rows)


@pytest.mark.skipif(not (SHARED / "data" / "math500_test.jsonl").exists(), reason="../shared/data not available")
def test_real_math500_rows():
    res = load_problems(SHARED / "data" / "math500_test.jsonl")
    assert len(res.rows) + len(res.rejects) == 500
    assert res.columns["id"] == "unique_id" and res.columns["solution"] == "solution"
    assert len(res.rows) >= 495


MATH_TRAIN = SHARED / "data" / "math_train12k.jsonl"
# Reference answers of math_train12k the loader used to refuse ("answer does not parse"), by unique_id.
MATH_TRAIN_ONCE_REFUSED = {
    "test/counting_and_probability/861.json": "\\frac{12}{5,\\!525}",
    "test/geometry/1107.json": "\\frac \\pi4 + 2 - \\sqrt2",
    "test/prealgebra/1879.json": "90",  # 90\text{ square\nunits}: a plain number comes back canonical
    "train/algebra/719.json": "8.24",  # \approx 8.24 \text{ mph}
    "train/counting_and_probability/251.json": "\\dfrac{1}{29,\\!322,\\!216}",
    "train/intermediate_algebra/1918.json": "a + b + c",
    "train/number_theory/794.json": "\\dfrac{2469}{20,\\!000}",
    "train/number_theory/852.json": "43_5.",
    "train/number_theory/1012.json": "\\text{(E)},",
    "train/prealgebra/281.json": "05\\!:\\!00",
    "train/precalculus/1049.json": "\\begin{pmatrix} 1 & -1 \\\\ 1 & \\phantom -1 \\end{pmatrix}",
    "train/precalculus/1083.json": "2007 + \\frac\\pi 2",
    "train/precalculus/1311.json": "\\sin^2 t",
}


@pytest.mark.skipif(not MATH_TRAIN.exists(), reason="../shared/data not available")
def test_real_math_answers_once_refused_now_load(tmp_path):
    """MATH's own answer TeX (``5,\\!525``, ``\\frac \\pi4``, ``\\phantom``, ``05\\!:\\!00``, ...) loads, as written;
    the rows whose answer is empty (``\\boxed{}`` in the source) are still rejected."""
    rows = [json.loads(x) for x in MATH_TRAIN.read_text().splitlines()]
    picked = [r for r in rows if r["unique_id"] in MATH_TRAIN_ONCE_REFUSED or not r["answer"].strip()]
    res = load_problems(_jsonl(tmp_path / "m.jsonl", picked))
    assert {r["problem_id"]: r["answer"] for r in res.rows} == MATH_TRAIN_ONCE_REFUSED
    assert [r["reason"] for r in res.rejects] == ["no answer (column 'answer')"] * 2


@pytest.mark.slow
@pytest.mark.skipif(not MATH_TRAIN.exists(), reason="../shared/data not available")
def test_real_math_train12k_rejects_only_what_is_not_an_answer():
    """All 12,000 rows (~20 s): 17 were rejected, 4 are (two duplicates, two empty answers)."""
    res = load_problems(MATH_TRAIN)
    assert (res.n_read, len(res.rows), res.duplicates, res.conflicts) == (12000, 11996, 2, 0)
    assert sorted(r["reason"].split(" (")[0] for r in res.rejects) == ["duplicate problem"] * 2 + ["no answer"] * 2


def test_a_folder_of_shards_reads_its_train_split_in_name_order(tmp_path):
    """A hub download's layout (data/train-0000i-of-0000n.parquet beside a test split): the train shards in name
    order, never the test split's rows; the evaluation's split="test" reads the test shard; the header check reads
    the first shard; a folder with no data file is one clear error."""
    from data_tools.problems import data_shards, read_header

    d = tmp_path / "hub" / "data"
    d.mkdir(parents=True)
    for name, rows in {"train-00001-of-00002.parquet": [("What is 3+3?", "6")],
                       "train-00000-of-00002.parquet": [("What is 1+1?", "2"), ("What is 2+2?", "4")],
                       "test-00000-of-00001.parquet": [("What is 9+9?", "18")]}.items():
        pq.write_table(pa.Table.from_pylist([{"problem": p, "answer": a} for p, a in rows]), d / name)
    res = load_problems(tmp_path / "hub")
    assert [r["answer"] for r in res.rows] == ["2", "4", "6"] and res.n_read == 3 and not res.rejects
    assert res.source == (f"{tmp_path / 'hub'} (2 file(s): data/train-00000-of-00002.parquet, "
                          "data/train-00001-of-00002.parquet)")
    assert [r["answer"] for r in load_problems(tmp_path / "hub", split="test").rows] == ["18"]
    assert [p.name for p in data_shards(tmp_path / "hub")] == ["train-00000-of-00002.parquet",
                                                               "train-00001-of-00002.parquet"]
    assert read_header(tmp_path / "hub") == {"problem": None, "answer": None}
    flat = tmp_path / "flat"  # no split in the names: every file
    flat.mkdir()
    _jsonl(flat / "a.jsonl", [{"question": "What is 5+5?", "final_answer": "10"}])
    pq.write_table(pa.Table.from_pylist([{"question": "What is 6+6?", "final_answer": "12"}]), flat / "b.parquet")
    assert [r["answer"] for r in load_problems(flat).rows] == ["10", "12"]
    words = tmp_path / "words"  # a split is a whole word of the name: math_train / math_test
    words.mkdir()
    _jsonl(words / "math_test.jsonl", [{"question": "What is 7+7?", "final_answer": "14"}])
    _jsonl(words / "math_train.jsonl", [{"question": "What is 8+8?", "final_answer": "16"}])
    assert [r["answer"] for r in load_problems(words).rows] == ["16"]
    assert [r["answer"] for r in load_problems(words, split="test").rows] == ["14"]
    assert read_header(words, "test") == {"question": None, "final_answer": None}
    _jsonl(words / "extra.jsonl", [{"question": "What is 9+1?", "final_answer": "10"}])  # names no split: unclear
    with pytest.raises(ValueError, match=r"some files name a split \(math_test.jsonl, math_train.jsonl\) and others "
                                         r"do not \(extra.jsonl\)"):
        load_problems(words)
    (tmp_path / "empty").mkdir()
    for call in (lambda: load_problems(tmp_path / "empty"), lambda: read_header(tmp_path / "empty")):
        with pytest.raises(ValueError, match="a directory with no .parquet or .jsonl file"):
            call()
