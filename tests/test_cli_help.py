"""Every runnable module's ``--help`` prints its usage and exits 0: argparse formats each help string with ``%``, so
one literal percent sign in a field's help (``30%``) turns ``--help`` into a crash (``unsupported format character``)
that no other test reaches."""

from __future__ import annotations

import runpy
import sys

import pytest

MODULES = [
    "stages.curate", "stages.evaluate", "stages.launch", "stages.rehearse", "stages.report", "stages.train",
    "bench.decode_bench", "bench.grader_bench", "bench.handover_replay", "bench.head_bench", "bench.learning",
    "bench.memory_steps", "bench.opd_gradients", "bench.opd_step_bench", "bench.opd_step_realistic", "bench.two_gpu",
    "data_tools.clock", "data_tools.formal_models", "data_tools.layout", "data_tools.preflight", "data_tools.query",
    "data_tools.rundirs", "data_tools.runio", "data_tools.synth",
]


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # runpy on an imported module
@pytest.mark.parametrize("module", MODULES)
def test_help_prints_usage_and_exits_0(module, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with pytest.raises(SystemExit) as exc:
        runpy.run_module(module, run_name="__main__", alter_sys=False)
    out = capsys.readouterr()
    assert exc.value.code in (0, None), f"{module} --help exited {exc.value.code}: {out.err[-800:]}"
    assert "usage" in (out.out + out.err).lower(), f"{module} --help printed no usage: {(out.out + out.err)[:400]}"


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
@pytest.mark.parametrize("module, names", [("stages.train", ("--config", "--check_config", "Precedence")),
                                           ("stages.curate", ("--config", "Precedence")),
                                           ("stages.evaluate", ("--config", "--protocol", "Precedence"))])
def test_stage_help_names_its_switches_that_are_not_fields(module, names, monkeypatch, capsys):
    """``--config`` (and train's ``--check_config``) are read before argparse sees the fields, so --help shows them only
    through the stage's usage lines (``data_tools.config.stage_help``): at the top of the page, not after argparse's
    usage of every field, and how the YAML and the flags combine."""
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with pytest.raises(SystemExit):
        runpy.run_module(module, run_name="__main__", alter_sys=False)
    top = "\n".join(capsys.readouterr().out.splitlines()[:16])
    assert top.startswith(f"usage: python -m {module} "), top[:200]
    for name in names:
        assert name in top, f"{module} --help does not name {name} near its top"


def test_stage_help_from_a_docstring_and_without_one():
    from data_tools.config import stage_help

    doc = "Stage x: does y.\n\n    python -m stages.x --config C.yaml\n    python -m stages.x --other\n\nMore.\n\nLater."
    h = stage_help(doc, 3)
    assert h["usage"] == "python -m stages.x --config C.yaml\n       python -m stages.x --other"
    assert h["description"].startswith("Stage x: does y.\n\nMore.\n\nEach option below is a --flag")
    assert "Later." not in h["description"] and "Later." in stage_help(doc)["description"]
    assert stage_help(None) == {} and stage_help("") == {}  # python -OO strips docstrings
