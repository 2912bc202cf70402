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
