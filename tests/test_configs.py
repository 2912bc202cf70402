"""Every config states its run command on its first line, under a short header; stage-one configs load and validate;
help strings say what a setting does, never which run chose it."""

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from bench.learning_config import LearningConfig
from data_tools.config import parse_config
from stages.curate import CurateConfig
from stages.evaluate import EvalConfig
from trainers.opd_config import OPDConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
FORMAL_ENV = {"STUDENT_MODEL": "/models/student", "TEACHER_MODEL": "/models/teacher", "TRAIN_DATA": "/data/train.jsonl",
              "OUTPUT_DIR": "/tmp/opd-config-test"}


@pytest.mark.parametrize("path", sorted(CONFIGS.rglob("*.yaml")), ids=lambda p: str(p.relative_to(CONFIGS)))
def test_first_line_states_the_command(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("#") and any(w in first for w in ("make ", "python -m", "accelerate launch", "bash run.sh")), first
    assert isinstance(yaml.safe_load(path.read_text()), dict)


#: A config's header: its command (first line) and at most five lines more; the evidence lives in bench/*.md.
MAX_HEADER_LINES = 6
MAX_LINE = 120


def header_lines(text: str) -> int:
    """The comment lines at the top of a YAML file, before its first setting."""
    n = 0
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        n += 1
    return n


def test_header_lines_counts_the_leading_comments():
    assert header_lines("# run: make x\n# a\nkey: 1  # b\n# c\n") == 2
    assert header_lines("key: 1\n") == 0


@pytest.mark.parametrize("path", sorted(CONFIGS.rglob("*.yaml")), ids=lambda p: str(p.relative_to(CONFIGS)))
def test_config_header_and_lines_are_short(path):
    text = path.read_text()
    assert header_lines(text) <= MAX_HEADER_LINES, (
        f"{path.name}: a header of {header_lines(text)} comment lines; keep the command plus at most "
        f"{MAX_HEADER_LINES - 1} lines and link the evidence (bench/LEARNING.md, bench/RESULTS.md)")
    long = [i for i, line in enumerate(text.splitlines(), 1) if len(line) > MAX_LINE]
    assert not long, f"{path.name}: lines over {MAX_LINE} characters: {long}"


#: What a help string must not carry: citations of runs or dates (the evidence belongs in bench/LEARNING.md and
#: bench/RESULTS.md, linked from there), and measured speed-ups.
RUN_CITATION = re.compile(
    r"RESULTS(?:\.md)?|LEARNING(?:\.md)?|(?i:\bcommands? \d+|\bruns? \d+\b|\bissue \d+)|\b20\d\d-[01]\d-[0-3]\d\b"
    r"|(?i:\b\d+\.\d+ ?x (?:faster|slower))")


def test_run_citation_pattern():
    for cited in ("measured by optim/update_rms in bench/LEARNING.md's 16r, 2026-12-03",
                  "2.76x faster on a 128 x 8,192 call (bench/RESULTS.md, run 7)", "as RESULTS run 9 showed",
                  "see command 17b", "1.34x faster again",
                  # a tracker citation, composed so that this file cites none itself
                  "the step's peak on issue {}'s realistic step".format(7 * 2)):
        assert RUN_CITATION.search(cited), cited
    for plain in ("Peak learning rate (AdamW).", "Samples per prompt; the reward baseline is the group mean.",
                  "Share of training seconds in off-policy steps, in [0, 1]; 10x learning_rate is usual for SFT."):
        assert not RUN_CITATION.search(plain), plain


def _own_help(cls) -> dict[str, str]:
    """Help text of the fields this project declares (not those inherited from TRL / transformers)."""
    ours = {name for k in cls.__mro__ if k.__module__.split(".")[0] in ("trainers", "stages", "bench", "data_tools")
            for name in k.__dict__.get("__annotations__", {})}
    return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cls) if f.name in ours}


@pytest.mark.parametrize("cls", [OPDConfig, CurateConfig, EvalConfig, LearningConfig], ids=lambda c: c.__name__)
def test_help_strings_cite_no_runs(cls):
    helps = _own_help(cls)
    assert len(helps) >= 10
    missing = sorted(name for name, h in helps.items() if not h.strip())
    assert not missing, f"{cls.__name__}: fields without help: {missing}"
    cited = {name: m.group(0) for name, h in helps.items() if (m := RUN_CITATION.search(h))}
    assert not cited, (f"{cls.__name__}: help strings citing runs ({cited}): say what the setting does, its unit "
                       "and range; the evidence goes to bench/LEARNING.md or bench/RESULTS.md")


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("curate_*.yaml")), ids=lambda p: p.name)
def test_curate_configs_validate(path):
    (cfg,) = parse_config([CurateConfig], ["--config", str(path)], env=FORMAL_ENV)
    assert cfg.output_dir == "/tmp/opd-config-test"
    assert cfg.student_samples >= 2 and cfg.teacher_samples >= 1


def test_formal_curate_config_needs_its_environment():
    with pytest.raises(ValueError, match="TEACHER_MODEL"):
        parse_config([CurateConfig], ["--config", str(CONFIGS / "curate_r1_distill_1p5b.yaml")], env={"OUTPUT_DIR": "/tmp/x"})


def test_config_mistakes_are_one_line_errors(tmp_path):
    """Unparsable YAML names the file and line; --config without a file and a missing file are ValueErrors (the stages
    print them as one line and exit 2); a truncated flag is refused, not taken as the field it prefixes, and an unknown
    one gets the closest real flag."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("student_model: [smollm2\n")
    with pytest.raises(ValueError, match=r"bad.yaml is not valid YAML at line 2"):
        parse_config([CurateConfig], ["--config", str(bad)])
    with pytest.raises(ValueError, match="--config needs a YAML file"):
        parse_config([CurateConfig], ["--config"])
    with pytest.raises(ValueError, match="config file not found: .*nope.yaml"):
        parse_config([CurateConfig], ["--config", str(tmp_path / "nope.yaml")])
    with pytest.raises(ValueError, match=r"unknown flag\(s\): --temp \(did you mean --temperature\?\)"):
        parse_config([CurateConfig], ["--temp", "1.5"])
    (cfg,) = parse_config([CurateConfig], ["--temperature", "1.5"])
    assert cfg.temperature == 1.5
