"""Config parsing shared by every stage: YAML recipe < environment < command line.

Built on TRL's ``TrlParser`` (``trl/scripts/utils.py``) over dataclasses: ``--config FILE.yaml``
sets the defaults, unknown YAML keys are an error, ``--field value`` flags override. Between the
two sits the formal run contract (docs/design.md section 6): the environment variables below win over
the YAML recipe, so a launcher can point one recipe at other models, data and directories.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import warnings
from typing import Any, Iterable

import yaml

from data_tools import rehearsal

# TRL 1.16 warns five times on import that it was tested up to vLLM 0.31 (we pin 0.32, docs/design.md
# section 8): known and harmless, so only that message is silenced.
warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions", category=UserWarning)
from trl import TrlParser  # noqa: E402 - after the filter above

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
        raise ValueError(f"config file not found: {path}") from None
    except yaml.YAMLError as e:  # one line naming the file and the place, not the parser's traceback
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"config file {path} is not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"config file {path} must contain a YAML mapping, got {type(cfg).__name__}")
    rehearsal.refuse_in_config(cfg, path)  # the rehearsal's verified share is an environment variable only
    return cfg


def stage_help(doc: str | None, paragraphs: int | None = None) -> dict[str, str]:
    """``parse_config``'s ``usage`` and ``description`` from a stage's module docstring: its ``python -m ...`` lines
    are the usage (argparse's own lists every field, a page long), its first ``paragraphs`` paragraphs (all when
    None) the description, where ``--config`` and the stage's switches that are not fields are explained. ``{}``
    without a docstring (``python -OO``)."""
    if not doc:
        return {}
    is_usage = lambda ln: ln.strip().startswith("python -m ")  # noqa: E731
    usage = [ln.strip() for ln in doc.splitlines() if is_usage(ln)]
    head = "\n".join(ln for ln in "\n\n".join(doc.split("\n\n")[:paragraphs]).splitlines() if not is_usage(ln))
    head = re.sub(r"\n{3,}", "\n\n", head).strip()
    if "Precedence" not in head:
        head += ("\n\nEach option below is a --flag and a key of the --config YAML. Precedence (lowest first):\n"
                 "the defaults, the YAML, the run contract's environment (STUDENT_MODEL, TRAIN_DATA, ...), the flags.")
    out = {"description": head}
    if usage:
        out["usage"] = "\n       ".join(usage)
    return out


def parse_config(dataclass_types: Iterable[type], args: list[str] | None = None,
                 env: dict[str, str] | None = None, description: str | None = None, usage: str | None = None) -> tuple:
    """Parse ``--config`` YAML, contract environment variables and CLI flags into dataclasses.

    Precedence (lowest first): dataclass defaults, YAML values, environment (``ENV_CONTRACT``),
    command-line flags. Range checks run in each dataclass's ``__post_init__`` on the final values.

    Raises:
        ValueError: a missing or unparsable config file, ``--config`` without a file, a YAML key that no
            dataclass declares, or a YAML value of the wrong type (a float or a list where an int belongs;
            the message names the file and key); a bad command-line flag (one line naming the flag, not
            argparse's page of usage). Flags must be written in full: argparse's prefix matching is off,
            so ``--learning_rat`` is an error, not ``--learning_rate``.
    """
    args = list(sys.argv[1:] if args is None else args)
    env = os.environ if env is None else env
    # allow_abbrev off: a truncated flag ("--temp") would otherwise set whichever field it prefixes, silently
    # usage / description (stage_help): the stage's python -m lines and its docstring's head, so --help names --config
    # and the stage's own switches, which are not dataclass fields
    parser = TrlParser(dataclass_types=list(dataclass_types), allow_abbrev=False, description=description, usage=usage,
                       formatter_class=argparse.RawDescriptionHelpFormatter)

    def one_line_error(message: str):
        raise ValueError(f"command line: {message}")

    parser.error = one_line_error
    config_path = None
    if "--config" in args:
        i = args.index("--config")
        if i + 1 >= len(args) or args[i + 1].startswith("--"):
            raise ValueError("--config needs a YAML file, e.g. --config configs/demo_cpu.yaml")
        config_path = args[i + 1]
        del args[i : i + 2]
        cfg = _load_yaml(config_path)
        cfg.pop("command", None)  # documentation only: the command that runs this config
        actions = {a.dest: a for a in parser._actions}
        cfg = {k: _check_yaml_value(actions[k], v, config_path) if k in actions else v for k, v in cfg.items()}
        unknown = parser.set_defaults_with_config(**cfg)
        if unknown:
            keys = sorted({u[2:] for u in unknown[::2]})
            raise ValueError(f"unknown key(s) {keys} in config file {config_path}")
    fields = {a.dest for a in parser._actions}
    from_env = {field: env[var] for var, field in ENV_CONTRACT.items() if field in fields and env.get(var)}
    if "teacher_model" in from_env and "teacher_context" in fields:
        # The contract's TEACHER_MODEL is the teacher: a recipe whose teacher is the student given the answer
        # (privileged context) gets that model instead, with one line; never a TEACHER_MODEL read and left unused
        if "--teacher_context" in args and args[args.index("--teacher_context") + 1:][:1] == ["privileged"]:
            raise ValueError(f"TEACHER_MODEL={from_env['teacher_model']} is set, but --teacher_context privileged "
                             "makes the student its own teacher: unset TEACHER_MODEL, or drop --teacher_context")
        if parser.get_default("teacher_context") == "privileged" and int(env.get("RANK") or 0) == 0:
            print(f"[config] TEACHER_MODEL is set: the teacher is {from_env['teacher_model']} (teacher_context "
                  f"teacher), not {config_path or 'the default'}'s privileged self-teacher", file=sys.stderr, flush=True)
        if parser.get_default("teacher_context") == "privileged":
            from_env["teacher_context"] = "teacher"
    if from_env:
        parser.set_defaults_with_config(**{k: _coerce(parser, k, v) for k, v in from_env.items()})
    try:
        return parser.parse_args_into_dataclasses(args=args)
    except ValueError as e:
        if "not used by the HfArgumentParser" not in str(e):
            raise
        flags = sorted({o for a in parser._actions for o in a.option_strings if o.startswith("--")})
        unknown = [a for a in args if a.startswith("--") and a.split("=")[0] not in flags]
        names = [f for f in flags if "-" not in f[2:] or "--" + f[2:].replace("-", "_") not in flags]  # one spelling
        hints = []
        for u in unknown:
            name = "--" + u.split("=")[0].lstrip("-").replace("-", "_")
            near = [f for f in names if f.startswith(name)][:3] or difflib.get_close_matches(name, names, n=1, cutoff=0.75)
            hints.append(f"{u} (did you mean {' or '.join(near)}?)" if near else u)
        raise ValueError(f"command line: unknown flag(s): {', '.join(hints) or e}") from None


def _check_yaml_value(action: argparse.Action, value: Any, path: str) -> Any:
    """``value`` converted as argparse would convert the flag's string; ``ValueError`` naming ``path`` and the key.

    YAML has its own types, so without this a ``max_tokens: 2.5`` would reach the stage as a float
    (and hang vLLM's engine) and a list value would fail later with a ``TypeError``.
    """
    where = f"config file {path}: key {action.dest!r}"
    if value is None:
        if action.default is None or getattr(action.type, "__qualname__", "").startswith("_accept_none"):
            return None
        raise ValueError(f"{where} needs a value (got null)")
    if action.nargs in ("+", "*"):
        items = value if isinstance(value, list) else [value]
        return [_convert(action, v, where) for v in items]
    if isinstance(value, (list, dict)):
        raise ValueError(f"{where} takes a single value, got a {type(value).__name__}: {value!r}")
    return _convert(action, value, where)


def _convert(action: argparse.Action, value: Any, where: str) -> Any:
    if action.type is not None and callable(action.type):
        try:
            value = action.type(str(value))  # "2.5" is not an int, "True" is not a float: as on the command line
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            kind = getattr(action.type, "__name__", "value")
            raise ValueError(f"{where}: {value!r} ({type(value).__name__}) is not a valid {kind}") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{where}: {value!r} is not one of {sorted(map(str, action.choices))}")
    return value


def _coerce(parser: TrlParser, dest: str, value: str) -> Any:
    """Apply the argparse type of ``dest`` to an environment string, so '90' becomes 90.0 for a float field."""
    for action in parser._actions:
        if action.dest == dest and action.type is not None and callable(action.type):
            try:
                return action.type(value)
            except (TypeError, ValueError) as e:
                raise ValueError(f"environment value {value!r} for {dest} is not valid: {e}") from None
    return value
