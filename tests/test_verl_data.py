"""The formal TRAIN_DATA's format: a verl parquet (DAPO-Math rows) read by the loader and run through stage one.

The parquet is written with the formal file's Arrow types: ``prompt`` list<struct<role, content>>, ``reward_model``
struct<ground_truth, style>, ``extra_info`` struct<index>, the rest strings.
"""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_tools.problems import load_problems

WRAP = ("Solve the following math problem step by step. The last line of your response should be of the form "
        "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
        "Remember to put your answer on its own line after \"Answer:\".")
MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
SCHEMA = pa.schema([("data_source", pa.string()), ("prompt", pa.list_(MESSAGE)), ("ability", pa.string()),
                    ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
                    ("extra_info", pa.struct([("index", pa.int64())]))])
METRIC_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def _row(content, answer, index=None, *, prompt=None):
    return {"data_source": "math_dapo", "prompt": prompt if prompt is not None else [{"role": "user", "content": content}],
            "ability": "MATH", "reward_model": {"ground_truth": answer, "style": "rule"},
            "extra_info": None if index is None else {"index": index}}


def _write(path: Path, rows) -> Path:
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    pq.write_table(table, path)
    return path


def test_verl_parquet_has_the_formal_types_and_loads_problems_answers_ids(tmp_path):
    f = _write(tmp_path / "train.parquet", [
        _row(WRAP.format(problem="What is $6 \\times 7$?"), "42", 1000),
        # whitespace differs from DAPO's (one newline, doubled spaces, a trailing newline): still DAPO's wrapper
        _row(WRAP.format(problem="How many primes are below 20?").replace("\n\n", "\n").replace(" step by", "  step\tby")
             + "\n", "8", 1001),
        _row(WRAP.format(problem="Find $x$ if $x + 3 = 0$."), "-3", None),  # no index: the usual id rule
    ])
    t = pq.read_table(f)
    assert t.schema.field("prompt").type == pa.list_(MESSAGE)
    assert t.schema.field("reward_model").type == pa.struct([("ground_truth", pa.string()), ("style", pa.string())])
    res = load_problems(f)
    assert [(r["problem_id"], r["problem"], r["answer"], r["source"]) for r in res.rows] == [
        ("1000", "What is $6 \\times 7$?", "42", "math_dapo"),
        ("1001", "How many primes are below 20?", "8", "math_dapo"),
        ("train-2", "Find $x$ if $x + 3 = 0$.", "-3", "math_dapo"),
    ]
    assert res.rejects == [] and res.unwrapped == 3 and res.wrapper_unrecognised == 0
    assert res.columns == {
        "problem": "prompt (the user message): DAPO's wrapper removed in 3 rows, not recognised in 0 rows (kept verbatim)",
        "answer": "reward_model.ground_truth", "id": "extra_info.index", "source": "data_source"}


def test_without_extra_info_index_the_usual_id_column_names_the_row(tmp_path):
    schema = SCHEMA.append(pa.field("id", pa.string()))
    rows = [_row(WRAP.format(problem="What is 2 + 5?"), "7", 3) | {"id": "ignored"},
            _row(WRAP.format(problem="What is 2 + 6?"), "8", None) | {"id": "dapo-17"}]
    f = tmp_path / "ids.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), f)
    res = load_problems(f)
    assert [r["problem_id"] for r in res.rows] == ["3", "dapo-17"]
    assert res.columns["id"] == "extra_info.index, else id"


def test_bad_verl_rows_are_rejected_naming_row_and_field(tmp_path):
    f = _write(tmp_path / "bad.parquet", [
        _row(WRAP.format(problem="What is 2 + 2?"), "4", 0),
        _row(None, "5", 1, prompt=[{"role": "system", "content": "Be brief."}]),        # no user message
        _row(WRAP.format(problem="What is 3 + 3?"), None, 2),                            # no ground truth
        _row(WRAP.format(problem=""), "1", 3),                                            # the wrapper around nothing
        _row(WRAP.format(problem="Name the answer."), "\\frac{", 4),                     # an answer that does not parse
        _row(None, "7", 5, prompt=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]),
        _row(WRAP.format(problem="What is 5 + 5?"), "10", 0),                            # index 0 again
    ])
    res = load_problems(f)
    # a different problem under a used index is kept, under an id of its own
    assert [r["problem_id"] for r in res.rows] == ["0", "0@row6"]
    assert res.reused_ids == 1 and "1 rows reused the id of another problem (column 'extra_info.index'), kept under " \
        "ids of their own: 0@row6" in res.report()
    assert {r["row_index"]: r["reason"] for r in res.rejects} == {
        1: "row 1: field 'prompt': expected one message with role 'user', found 0 (roles ['system'])",
        2: "row 2: no answer (column 'reward_model.ground_truth')",
        3: "row 3: empty problem (column 'prompt (the user message)')",
        4: "row 4: answer does not parse (column 'reward_model.ground_truth'): '\\\\frac{'",
        5: "row 5: field 'prompt': expected one message with role 'user', found 2 (roles ['user', 'user'])",
    }
    assert json.loads(res.rejects[0]["raw"])["__row__"]["prompt"] == [{"role": "system", "content": "Be brief."}]


def test_other_wrappers_are_kept_verbatim_and_named_in_the_summary(tmp_path):
    other = "Answer the question below and box it.\n\nWhat is 9 - 4?"
    half = WRAP.format(problem="What is 1 + 1?").split("\n\nRemember")[0]  # DAPO's prefix without its suffix
    f = _write(tmp_path / "mixed.parquet", [
        _row(WRAP.format(problem="What is 6 + 6?"), "12", 10),
        _row(other, "5", 11),
        _row(half, "2", 12),
    ])
    res = load_problems(f)
    assert [r["problem"] for r in res.rows] == ["What is 6 + 6?", other, half]
    assert res.unwrapped == 1 and res.wrapper_unrecognised == 2 and res.unrecognised_rows == [1, 2]
    assert res.columns["problem"] == ("prompt (the user message): DAPO's wrapper removed in 1 rows, not recognised in "
                                      "2 rows (kept verbatim)")
    assert res.report() == (
        f"{f}: read 3 rows, kept 3, rejected 0 (0 duplicates, 0 duplicates with a conflicting answer); columns: "
        "problem<-prompt (the user message): DAPO's wrapper removed in 1 rows, not recognised in 2 rows (kept verbatim), "
        "answer<-reward_model.ground_truth, id<-extra_info.index, source<-data_source; wrapper not recognised in rows 1, 2")


class _FormalEngine:
    """Stage one's engine contract, answering like a reasoning model: per problem, the teacher's even samples box
    the right answer and its odd ones write only DAPO's "Answer: N" line; the student boxes the right answer in
    sample 0, ``\\frac{2N}{2}`` in sample 1 and a wrong integer in the rest."""

    name, dtype, startup_s, model = "fake", "float32", 0.0, "fake"

    def __init__(self, answers: dict[str, str]):
        self.answers, self.prompts = answers, []

    def generate(self, prompts, *, n, max_tokens, temperature, top_p, chunk_size, desc, seeds=None, stop_at=None):
        from data_tools.generation.engines import Sample

        self.prompts += prompts
        out = []
        for p, text in enumerate(prompts):
            ans = next(a for q, a in self.answers.items() if q in text)
            for j in range(n):
                if desc.startswith("teacher"):
                    done = f"</think>\n\nSo \\boxed{{{ans}}}." if j % 2 == 0 else f"</think>\n\nAnswer: {ans}"
                else:
                    done = [f"</think>\n\n\\boxed{{{ans}}}", f"</think>\n\n\\boxed{{\\frac{{{2 * int(ans)}}}{{2}}}}"][j] \
                        if j < 2 else f"</think>\n\n\\boxed{{{int(ans) + 1}}}"
                out.append(Sample(prompt_index=p, sample_index=j, completion="Thinking. " + done, n_tokens=12,
                                  n_prompt_tokens=30, finish_reason="stop"))
        yield out


# DeepSeek-R1-Distill-Qwen's chat template for one user message (its shape: BOS, <|User|>, <|Assistant|><think>).
R1_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<\uff5cUser\uff5c>{{ m['content'] }}{% endfor %}"
               "{% if add_generation_prompt %}<\uff5cAssistant\uff5c><think>\n{% endif %}")


def _model_dir(path: Path) -> str:
    """A model directory stage one accepts (config, a word-level tokenizer with R1's chat template, a weights file
    that is never loaded), written by the transformers that reads it: no model cache, no conversion."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path.mkdir()
    raw = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.chat_template = R1_TEMPLATE
    tok.save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 3}))
    (path / "model.safetensors").write_bytes(b"never loaded")
    return str(path)


def test_stage_one_reads_the_verl_parquet_and_verifies_as_the_metric(tmp_path, monkeypatch):
    """Stage one end to end on the verl parquet with a scripted engine (no model runs): the prompts are the metric's
    user message through the student's chat template, and 'verified' is the formal profile's verdict."""
    from transformers import AutoTokenizer

    import stages.curate as C
    import stages.curate_sampling as S

    problems = {f"What is {a} + {a}?": str(2 * a) for a in range(1, 9)}
    f = _write(tmp_path / "train.parquet", [_row(WRAP.format(problem=q), ans, 100 + i)
                                            for i, (q, ans) in enumerate(problems.items())])
    model = _model_dir(tmp_path / "r1-like")
    tok = AutoTokenizer.from_pretrained(model)
    eng = _FormalEngine(problems)
    eng.tokenizer, eng.close = tok, lambda: None
    monkeypatch.setattr(S, "make_engine", lambda kind, m, **kw: eng)
    monkeypatch.delenv("OPD_REHEARSAL_VERIFIED", raising=False)
    cfg = C.CurateConfig(train_data=str(f), student_model=model, teacher_model=model, teacher_context="teacher",
                         prompt_style="formal", grader_profile="formal", teacher_samples=2, student_samples=4,
                         max_tokens=16, max_model_len=512, chunk_size=4, output_dir=str(tmp_path / "run"))
    manifest = C.curate(cfg)
    assert manifest["counts"]["problems"] == 8
    assert manifest["columns"]["problem"].endswith("DAPO's wrapper removed in 8 rows, not recognised in 0 rows (kept verbatim)")
    want = {f"<s><\uff5cUser\uff5c>{q} {METRIC_INSTRUCTION}<\uff5cAssistant\uff5c><think>\n" for q in problems}
    assert set(eng.prompts) == want and len(eng.prompts) == 16  # each problem once per role, the metric's message
    roll = pq.read_table(tmp_path / "run" / "curate" / "rollouts.parquet").to_pylist()
    assert len(roll) == 8 * 2 + 8 * 4
    verified = {(r["role"], r["sample_index"]): set() for r in roll}
    for r in roll:
        verified[(r["role"], r["sample_index"])].add(r["correct"])
    # the teacher's "Answer: N" samples and the student's \frac{2N}{2} are not verified; boxed integers are
    assert verified == {("teacher", 0): {True}, ("teacher", 1): {False}, ("student", 0): {True},
                        ("student", 1): {False}, ("student", 2): {False}, ("student", 3): {False}}
    assert {r["grader_path"] for r in roll if r["sample_index"] == 1} == {"no_answer", "formal"}
    cur = pq.read_table(tmp_path / "run" / "curate" / "curriculum.parquet").to_pylist()
    assert sorted(r["problem_id"] for r in cur) == [str(100 + i) for i in range(8)]
    assert {r["pass_rate"] for r in cur} == {0.25} and {r["teacher_pass_rate"] for r in cur} == {0.5}
    assert all(r["teacher_solution"].endswith(f"\\boxed{{{r['answer']}}}.") for r in cur)
    assert {r["prompt_style"] for r in cur} == {"formal"}


def test_formal_grader_profile_is_a_validated_setting(tmp_path):
    from stages.curate import CurateConfig

    with pytest.raises(ValueError, match="grader_profile must be one of"):
        CurateConfig(output_dir=str(tmp_path / "o"), grader_profile="strict")
    with pytest.raises(ValueError, match="answer_filter 'numeric' does not apply under grader_profile formal"):
        CurateConfig(output_dir=str(tmp_path / "o"), grader_profile="formal", answer_filter="numeric")
    assert CurateConfig(output_dir=str(tmp_path / "o")).grader_profile == "default"


def test_chunks_graded_under_one_profile_are_not_reused_under_another(tmp_path):
    from stages.curate import CurateConfig, _fingerprint

    models = {"student": {"path": "s"}, "teacher": {"path": "t"}}
    default = _fingerprint(CurateConfig(output_dir=str(tmp_path / "o")), models)
    formal = _fingerprint(CurateConfig(output_dir=str(tmp_path / "o"), grader_profile="formal"), models)
    assert len(default) == len(formal) == 16 and default != formal


def test_an_extra_answer_column_and_other_roles_do_not_hide_the_verl_reading(tmp_path):
    """prompt + reward_model is verl whatever else a row has: a stray ``answer`` column does not make the chat
    messages the problem's text (the answer is reward_model.ground_truth), and a system or assistant message beside
    the user's is dropped and counted in the summary, never silently."""
    rows = [_row(WRAP.format(problem="What is 6 x 7?"), "42", 0), _row("", "8", 1, prompt=[
        {"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "What is 2^3?"},
        {"role": "assistant", "content": "8"}])]
    schema = SCHEMA.append(pa.field("answer", pa.string()))
    f = tmp_path / "with_answer.parquet"
    pq.write_table(pa.Table.from_pylist([{**r, "answer": "wrong"} for r in rows], schema=schema), f)
    res = load_problems(f)
    assert [(r["problem"], r["answer"]) for r in res.rows] == [("What is 6 x 7?", "42"), ("What is 2^3?", "8")]
    assert res.other_roles == {"assistant": 1, "system": 1}
    assert "messages dropped (only the user message is the problem): 1 assistant, 1 system" in res.report()
