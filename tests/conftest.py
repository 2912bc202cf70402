"""Test-session housekeeping: what the tests' libraries write under /tmp goes, at the end, with the session.

- torch.compile's caches (inductor, triton) default to ``/tmp/torchinductor_<user>``: the session points them at a
  directory of its own (the tests' subprocesses inherit it) and removes it at the end.
- vLLM's CPU backend leaves an empty ``/tmp/vllm_dist_<uuid>`` file per engine (its distributed init's file store):
  those that appeared during the session are removed at the end.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile

_session: dict = {}


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # an xdist worker: the controller owns the directories
        return
    root = tempfile.mkdtemp(prefix="opd-tests-")
    _session["root"] = root
    _session["vllm_before"] = set(glob.glob("/tmp/vllm_dist_*"))
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
    for path in set(glob.glob("/tmp/vllm_dist_*")) - _session.pop("vllm_before", set()):
        try:
            os.remove(path)
        except OSError:
            pass
