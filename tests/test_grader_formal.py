"""The ``formal`` grader profile against the formal metric's rules, and the prompt style that matches its prompt.

``tests/data/formal_grader_cases.jsonl``: one case a line -- ``gold``, ``pred`` (a whole completion), optional
``truncated``; ``metric``: the verdict of the formal metric's rule grader (``grade_answer_verl`` of thunlp/JustRL
``evals/utils.py``, commit cf444e9, with sympy 1.14 and pylatexenc 2.10), run on each case when the cases were
written; ``formal``: this profile's verdict, the metric's except where ``stricter`` says why it refuses what the
metric accepts; ``rule``: the metric's rule the case shows.
"""

import io
import json
import time
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from data_tools.grader import PROFILES, Verdict, grade, grade_batch
from data_tools.grader.__main__ import main
from data_tools.grader.formal import hendrycks, last_box, plain
from data_tools.prompts import render, student_messages

CASES = [json.loads(line) for line in (Path(__file__).parent / "data" / "formal_grader_cases.jsonl").read_text().splitlines()]
METRIC_MESSAGE = "{problem} Please reason step by step, and put your final answer within \\boxed{{}}."


def test_the_cases_cover_the_metrics_rules():
    ids = [c["id"] for c in CASES]
    assert len(CASES) == 61 and len(set(ids)) == 61
    assert sum(c["metric"] for c in CASES) == 35 and sum(c["formal"] for c in CASES) == 32
    for needed in ("no_box_prose", "no_box_dapo_answer_line", "earlier_box_right_last_wrong", "frac_for_integer",
                   "sum_for_integer", "power_for_integer", "thin_space_thousands", "plain_integer", "leading_zero",
                   "dfrac_for_integer", "text_wrapped", "negative", "comma_thousands", "box_after_think_overrides"):
        assert needed in ids


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["id"])
def test_formal_profile_gives_each_cases_verdict(case):
    v = grade(case["pred"], case["gold"], truncated=case.get("truncated", False), profile="formal")
    assert v.correct is case["formal"], case["rule"]
    assert v.path in ("formal", "no_answer")


def test_formal_profile_rewards_nothing_the_metric_rejects():
    preds, golds = [c["pred"] for c in CASES], [c["gold"] for c in CASES]
    verdicts = grade_batch(preds, golds, truncated=[c.get("truncated", False) for c in CASES], profile="formal")
    assert [v.correct for v in verdicts] == [c["formal"] for c in CASES]
    assert not [c["id"] for c, v in zip(CASES, verdicts) if v.correct and not c["metric"]]
    # where the two differ the profile is the stricter, and each such case says why
    differ = sorted(c["id"] for c, v in zip(CASES, verdicts) if v.correct != c["metric"])
    assert differ == ["left_right_parens", "textbf_wrapped", "truncated_box_then_text"]
    assert all(c.get("stricter") for c in CASES if c["id"] in differ)


def test_the_default_profile_is_unchanged_and_is_why_formal_exists():
    """The default pipeline still reads markers and equal mathematics: it accepts these, the metric does not."""
    lenient = {"no_box_dapo_answer_line": "exact", "no_box_prose": "exact", "frac_for_integer": "numeric",
               "power_for_integer": "numeric", "box_with_space": "exact", "fbox": "exact"}
    by_id = {c["id"]: c for c in CASES}
    for cid, path in lenient.items():
        c = by_id[cid]
        assert not c["metric"]
        assert grade(c["pred"], c["gold"]).path == path and grade(c["pred"], c["gold"]).correct
        assert grade(c["pred"], c["gold"], answer_filter="math", profile="default").correct
        assert not grade(c["pred"], c["gold"], profile="formal").correct


def test_formal_extraction_reads_only_the_last_box():
    assert grade("So \\boxed{41}.\nAnswer: 42", "42", profile="formal") == Verdict(False, "41", "formal")
    assert grade("Answer: 42", "42", profile="formal") == Verdict(False, None, "no_answer")
    assert grade("\\boxed{42} then \\boxed{4", "42", profile="formal") == Verdict(False, None, "no_answer")
    assert grade("<think>\\boxed{41}</think>\n\n\\boxed{42}", "42", profile="formal") == Verdict(True, "42", "formal")
    assert last_box("a \\boxed{\\frac{1}{2}} b") == ("\\frac{1}{2}", 21)
    assert last_box("\\boxed {5}") == (None, -1) and last_box("no box") == (None, -1)
    assert last_box("\\boxed{x} \\boxed{y}") == ("y", 19)
    # a boxed gold is unwrapped as the metric does
    assert grade("\\boxed{7}", "\\boxed{7}", profile="formal") == Verdict(True, "7", "formal")
    # one answer over several boxes is one answer by default, never here: the metric reads the last box alone
    multi = "\\boxed{(2, 2)} \\quad \\text{and} \\quad \\boxed{(6, 2)}"
    assert grade(multi, "(2, 2), (6, 2)") == Verdict(True, "(2, 2), (6, 2)", "exact")
    assert grade(multi, "(2, 2), (6, 2)", profile="formal") == Verdict(False, "(6, 2)", "formal")
    # the default profile's TeX glue (brace-less \frac arguments, \approx) is not the metric's
    assert grade("\\boxed{\\frac{\\pi}{2}}", "\\frac\\pi 2", profile="formal").correct is False
    assert grade("\\boxed{8.24}", "\\approx 8.24", profile="formal").correct is False


def test_the_two_normalisations_on_plain_values():
    assert hendrycks(" \\text{42} ") == "42" and hendrycks("x = 42") == "42" and hendrycks("42 \\text{ cm}") == "42"
    assert hendrycks("\\dfrac12") == "\\frac{1}{2}" and hendrycks("3/4") == "\\frac{3}{4}" and hendrycks("0.5") == "\\frac{1}{2}"
    assert hendrycks("\\frac") == "\\frac" and hendrycks("a \\text{ b} \\text{ c}") == "a \\text{ b} \\text{ c}"  # it gives up
    assert plain("1,000") == "1000" and plain("042") == "42" and plain("{42}") == "42" and plain("1e3") == "1000"
    assert plain("41+1") == "41+1" and plain("7 3") == "7+3" and plain("\\frac{84}{2}") is None


def test_formal_profile_is_fast_on_hostile_completions():
    huge = "\\boxed{1}" * 200_000 + " \\boxed{42}"
    deep = "\\boxed{" + "{" * 100_000 + "42" + "}" * 100_000 + "}"
    t0 = time.perf_counter()
    assert grade(huge, "42", profile="formal") == Verdict(True, "42", "formal")
    assert grade(deep, "42", profile="formal").correct is True  # the metric drops every brace too
    assert grade("\\boxed{" + "1," * 100_000 + "1}", "1", profile="formal").correct is False
    assert time.perf_counter() - t0 < 5


def test_unknown_profile_is_refused():
    assert PROFILES == ("default", "formal")
    with pytest.raises(ValueError, match="grader profile must be one of"):
        grade("1", "1", profile="metric")
    with pytest.raises(ValueError, match="grader profile must be one of"):
        grade_batch(["1"], ["1"], profile="metric")


def test_cli_profile_formal(tmp_path):
    f = tmp_path / "answers.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in [
        {"gold": "42", "pred": "\\boxed{42}"}, {"gold": 42, "pred": "Answer: 42"},
        {"gold": "1000", "pred": "\\boxed{10^3}"}, {"gold": "42", "pred": "\\boxed{41}\nAnswer: 42"}]))

    def run(*flags):
        out = io.StringIO()
        with redirect_stdout(out):
            rc = main([*flags, str(f)])
        return rc, [(r["correct"], r["extracted"], r["grader_path"]) for r in map(json.loads, out.getvalue().splitlines())]

    assert run("--profile", "formal") == (0, [(True, "42", "formal"), (False, None, "no_answer"),
                                              (False, "10^3", "formal"), (False, "41", "formal")])
    assert run() == (0, [(True, "42", "exact"), (True, "42", "exact"), (True, "10^3", "numeric"), (True, "42", "exact")])
    with pytest.raises(SystemExit):
        main(["--profile", "metric", str(f)])


def test_formal_prompt_style_is_the_metrics_user_message():
    """The metric asks ``"<problem> Please reason ... \\boxed{}."`` of the stripped problem (a space, no newline)."""
    assert student_messages("  What is $6 \\times 7$?\n", "formal") == [{"role": "user", "content": (
        "What is $6 \\times 7$? Please reason step by step, and put your final answer within \\boxed{}.")}]
    assert student_messages("What is 1+1?", "reasoning")[0]["content"] == (
        "What is 1+1?\nPlease reason step by step, and put your final answer within \\boxed{}.")  # unchanged

    class Tok:
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert not tokenize and add_generation_prompt
            return "<|User|>" + messages[0]["content"] + "<|Assistant|><think>\n"

    problem = "Find the sum of all integers $n$."
    assert render(Tok(), student_messages(problem, "formal")) == (
        "<|User|>" + METRIC_MESSAGE.format(problem=problem) + "<|Assistant|><think>\n")


def test_formal_recipe_configs_set_style_and_profile():
    import yaml

    root = Path(__file__).resolve().parents[1] / "configs"
    for name in ("curate_r1_distill_1p5b.yaml", "curate_r1_distill_1p5b_filtered.yaml", "opd_r1_distill_1p5b.yaml"):
        cfg = yaml.safe_load((root / name).read_text())
        assert (cfg["prompt_style"], cfg["grader_profile"], cfg.get("answer_filter", "math")) == ("formal", "formal", "math")


def test_trainer_config_takes_the_profile(tmp_path):
    try:
        from trainers.opd_config import OPDConfig
    except ImportError as e:  # TRL without DistillationConfig: the trainer's TRL range is tested elsewhere
        pytest.skip(f"trainers.opd_config does not import with this TRL: {e}")
    kw = dict(output_dir=str(tmp_path), report_to="none")
    assert OPDConfig(**kw).grader_profile == "default"
    assert OPDConfig(**kw, grader_profile="formal").grader_profile == "formal"
    with pytest.raises(ValueError, match="grader_profile must be one of"):
        OPDConfig(**kw, grader_profile="metric")
    with pytest.raises(ValueError, match="does not apply under grader_profile formal"):
        OPDConfig(**kw, grader_profile="formal", answer_filter="numeric")
