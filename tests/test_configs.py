"""Every config states its run command on its first line; stage-one configs load and validate."""

from pathlib import Path

import pytest
import yaml

from data_tools.config import parse_config
from stages.curate import CurateConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
FORMAL_ENV = {"STUDENT_MODEL": "/models/student", "TEACHER_MODEL": "/models/teacher", "TRAIN_DATA": "/data/train.jsonl",
              "OUTPUT_DIR": "/tmp/opd-config-test"}


@pytest.mark.parametrize("path", sorted(CONFIGS.rglob("*.yaml")), ids=lambda p: str(p.relative_to(CONFIGS)))
def test_first_line_states_the_command(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("#") and any(w in first for w in ("make ", "python -m", "accelerate launch", "bash run.sh")), first
    assert isinstance(yaml.safe_load(path.read_text()), dict)


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
