"""Test-session housekeeping: what the tests' libraries write under /tmp goes, at the end, with the session.

- torch.compile's caches (inductor, triton) default to ``/tmp/torchinductor_<user>``: the session points them at a
  directory of its own (the tests' subprocesses inherit it) and removes it at the end. Inductor's precompiled C++
  headers (~150 MB) ignore that setting and go to ``/tmp/torchinductor_<user>`` anyway: removed at the end when the
  session created that directory.
- vLLM's CPU backend leaves an empty ``vllm_dist_<uuid>`` file per engine in the temp dir (its distributed init's
  file store): those that appeared during the session are removed at the end.
- A machine with the formal layout (a writable ``/out``) would take every run the tests start without OUTPUT_DIR:
  the session turns that layout off (``OPD_FORMAL_OUT`` empty) unless the caller named a root; tests of the layout
  name their own.
"""

from __future__ import annotations

import getpass
import glob
import os
import re
import shutil
import tempfile

_session: dict = {}


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # an xdist worker: the controller owns the directories
        return
    root = tempfile.mkdtemp(prefix="opd-tests-")
    _session["root"] = root
    _session["vllm_before"] = set(glob.glob(_vllm_dist_files()))
    default = _inductor_default_dir()  # where torch._inductor.codecache puts its precompiled headers
    if default and not os.path.exists(default):
        _session["inductor_default"] = default
    if "OPD_FORMAL_OUT" not in os.environ:
        os.environ["OPD_FORMAL_OUT"] = ""
        _session.setdefault("set", []).append("OPD_FORMAL_OUT")
    for var, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
        if var not in os.environ:
            os.environ[var] = os.path.join(root, sub)
            _session.setdefault("set", []).append(var)


def pytest_unconfigure(config):
    root = _session.pop("root", None)
    if root is None:
        return
    for var in _session.pop("set", []):
        os.environ.pop(var, None)
    shutil.rmtree(root, ignore_errors=True)
    if _session.get("inductor_default"):
        shutil.rmtree(_session.pop("inductor_default"), ignore_errors=True)
    for path in set(glob.glob(_vllm_dist_files())) - _session.pop("vllm_before", set()):
        try:
            os.remove(path)
        except OSError:
            pass


def _vllm_dist_files() -> str:
    """Where vLLM puts its file store (``vllm.utils.network_utils``: the temp dir, which TMPDIR moves)."""
    return os.path.join(tempfile.gettempdir(), "vllm_dist_*")


def _inductor_default_dir() -> str | None:
    """``torch._inductor.runtime.cache_dir_utils.default_cache_dir()`` without importing torch."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        return None
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


# --------------------------------------------------------------------------- the formal stack: no vLLM, no duckdb

import importlib.util  # noqa: E402

import pytest  # noqa: E402

#: Where vLLM does not import (the formal image's stack on a CPU: ``make test-formal``), a test that would start a
#: real generation engine through vLLM is skipped with this reason: the hf engine would stand in for it, minutes a
#: test on two cores, measuring nothing the main environment's run of the same test does not.
NO_VLLM = "needs vLLM (this environment has none, as the formal image's stack on a CPU): the main suite runs it"


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@pytest.fixture(autouse=True)
def _skip_vllm_engines_where_vllm_is_absent(monkeypatch):
    """Without vLLM, ``make_engine("auto" | "vllm", ...)`` skips the test (NO_VLLM); a test that replaces
    ``make_engine`` with a stand-in of its own still runs (its patch comes after this one)."""
    if _has("vllm"):
        yield
        return
    from data_tools.generation import engines

    real = engines.make_engine

    def make_engine(kind, model, **kw):
        if kind in ("auto", "vllm"):
            pytest.skip(NO_VLLM)
        return real(kind, model, **kw)

    monkeypatch.setattr(engines, "make_engine", make_engine)
    for mod in ("stages.curate_sampling", "stages.evaluate"):
        m = importlib.import_module(mod)
        if getattr(m, "make_engine", None) is real:
            monkeypatch.setattr(m, "make_engine", make_engine)
    yield


def pytest_collection_modifyitems(config, items):
    """Tests that query a run's tables need duckdb (``make query``), optional since the formal image has none."""
    if _has("duckdb"):
        return
    skip = pytest.mark.skip(reason="needs duckdb (make query's only dependency; this environment has none, as the "
                                   "formal image)")
    for item in items:
        if "query" in item.name or "duckdb" in item.name:
            item.add_marker(skip)
