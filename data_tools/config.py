"""Config parsing shared by every stage: YAML recipe < environment < command line.

Built on TRL's ``TrlParser`` (``trl/scripts/utils.py``) over dataclasses: ``--config FILE.yaml``
sets the defaults, unknown YAML keys are an error, ``--field value`` flags override. Between the
two sits the formal run contract (design.md section 6): the environment variables below win over
the YAML recipe, so a launcher can point one recipe at other models, data and directories.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Iterable

import yaml
from trl import TrlParser

#: Environment variables of the run contract, mapped to the dataclass field each one sets
#: (a field of that name must exist in one of the stage's dataclasses to be used).
ENV_CONTRACT = {
    "STUDENT_MODEL": "student_model",
    "TEACHER_MODEL": "teacher_model",
    "TRAIN_DATA": "train_data",
    "EVAL_DATA": "eval_data",
    "MAX_WALL_TIME_SECONDS": "max_wall_time_seconds",
    "DEADLINE_RESERVE_SECONDS": "deadline_reserve_seconds",
    "OUTPUT_DIR": "output_dir",
    "CKPT_DIR": "ckpt_dir",
    "EXPERIMENT_NAME": "experiment_name",
}


def _load_yaml(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            cfg = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise SystemExit(f"config file not found: {path}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"config file {path} must contain a YAML mapping, got {type(cfg).__name__}")
    return cfg


def parse_config(dataclass_types: Iterable[type], args: list[str] | None = None,
                 env: dict[str, str] | None = None) -> tuple:
    """Parse ``--config`` YAML, contract environment variables and CLI flags into dataclasses.

    Precedence (lowest first): dataclass defaults, YAML values, environment (``ENV_CONTRACT``),
    command-line flags. Range checks run in each dataclass's ``__post_init__`` on the final values.

    Raises:
        ValueError: a YAML key that no dataclass declares (the message names the key and file).
        SystemExit: bad command-line flags (argparse's own message), or a missing config file.
    """
    args = list(sys.argv[1:] if args is None else args)
    env = os.environ if env is None else env
    parser = TrlParser(dataclass_types=list(dataclass_types))
    config_path = None
    if "--config" in args:
        i = args.index("--config")
        config_path = args[i + 1]
        del args[i : i + 2]
        cfg = _load_yaml(config_path)
        cfg.pop("command", None)  # documentation only: the command that runs this config
        unknown = parser.set_defaults_with_config(**cfg)
        if unknown:
            keys = sorted({u[2:] for u in unknown[::2]})
            raise ValueError(f"unknown key(s) {keys} in config file {config_path}")
    fields = {a.dest for a in parser._actions}
    from_env = {field: env[var] for var, field in ENV_CONTRACT.items() if field in fields and env.get(var)}
    if from_env:
        parser.set_defaults_with_config(**{k: _coerce(parser, k, v) for k, v in from_env.items()})
    return parser.parse_args_into_dataclasses(args=args)


def _coerce(parser: TrlParser, dest: str, value: str) -> Any:
    """Apply the argparse type of ``dest`` to an environment string, so '90' becomes 90.0 for a float field."""
    for action in parser._actions:
        if action.dest == dest and action.type is not None and callable(action.type):
            try:
                return action.type(value)
            except (TypeError, ValueError) as e:
                raise ValueError(f"environment value {value!r} for {dest} is not valid: {e}") from None
    return value
