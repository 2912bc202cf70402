"""The vLLM engine's processes: they die with the stage, are recorded in a pid file, and are watched.

Faults: the engine's processes die with this one (``PR_SET_PDEATHSIG``, asked for by the children forked
or spawned while it starts, :func:`children_die_with_us`; a spawned child asks when it imports this module, which it
does because the stages import it at top level and spawn re-imports the main module); their pids are kept in a pid
file of the run directory, so a re-run after a ``kill -9`` ends the ones left over (:func:`reap_stale_engines`); and a
watchdog turns a dead or stalled engine into :class:`EngineDead` instead of a wait without end. Also: a private folder
for vLLM's IPC sockets, and SIGTERM / SIGINT turned into a clean exit (:func:`exit_on_sigterm`).

Standard library and psutil only: worker processes and vLLM's spawned children import it before anything heavy.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

import psutil

log = logging.getLogger(__name__)

#: Seconds of no CPU progress in this process and the engine's processes, while requests are open,
#: after which the engine counts as dead (env ``OPD_ENGINE_STALL_S``).
STALL_S = float(os.environ.get("OPD_ENGINE_STALL_S") or 180)


class EngineDead(RuntimeError):
    """The vLLM engine's processes died or stopped working while requests were open."""


_ARMED = False  # True while an engine starts: its forked children ask to die with their parent
_FORK_PARENT = 0
#: Set while an engine starts: the pid of the process starting it (seen by its spawned children).
PARENT_ENV = "OPD_ENGINE_PARENT"


def _before_fork() -> None:
    global _FORK_PARENT
    _FORK_PARENT = os.getpid()


def _die_with_parent(parent: int | None) -> None:
    """Ask the kernel for SIGKILL when this process's parent dies (Linux ``prctl(2)``).

    ``parent``: the expected parent pid, to catch a parent that died before the call took effect.
    """
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if (parent is not None and os.getppid() != parent) or os.getppid() == 1:
        os._exit(1)


def _ignore_terminal_interrupt() -> None:
    """Block SIGINT in an engine process (and the threads and processes it starts: the mask is inherited).

    Ctrl-C in a terminal signals the whole foreground process group. The stage process turns it into a
    clean exit that shuts its engine down (``exit_on_sigterm``); vLLM's own processes install SIGINT
    handlers of their own, and one hit while its workers start prints a page of tracebacks ("WorkerProc
    initialization failed") for an interrupt that was the user's. Blocked, the signal reaches only the
    stage; vLLM stops its processes with SIGTERM, and they die with their parent regardless.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def _after_fork_in_child() -> None:
    # forked children inherit _ARMED, so the engine-core process's own forked workers get it too
    if _ARMED:
        _die_with_parent(_FORK_PARENT)
        _ignore_terminal_interrupt()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
if os.environ.get(PARENT_ENV) and os.environ[PARENT_ENV] != str(os.getpid()):
    # A process vLLM started with ``spawn`` (its choice on CPU, and once CUDA is initialised): spawn
    # re-imports the stage's main module, which imports this one, so the request is made here.
    _die_with_parent(int(os.environ[PARENT_ENV]) if os.getppid() == int(os.environ[PARENT_ENV]) else None)
    _ignore_terminal_interrupt()


@contextlib.contextmanager
def children_die_with_us() -> Iterator[None]:
    """Inside the block (an engine starting), every child process forked or spawned asks for SIGKILL when this
    process dies and blocks SIGINT (see the module docstring); outside it, children are left alone."""
    global _ARMED
    _ARMED = True
    os.environ[PARENT_ENV] = str(os.getpid())
    try:
        yield
    finally:
        _ARMED = False
        os.environ.pop(PARENT_ENV, None)


def reap_stale_engines(pid_file: Path) -> list[int]:
    """End the engine processes recorded in ``pid_file`` by an earlier run that is gone; returns their pids.

    A process is ended only if its pid *and* start time match the record and its recording run is
    dead, so a reused pid is never touched. The caller holds the run directory's lock, so no live
    run can own these processes.
    """
    pid_file = Path(pid_file)
    try:
        rec = json.loads(pid_file.read_text())
    except (OSError, json.JSONDecodeError):
        return []
    if rec.get("owner") != os.getpid() and psutil.pid_exists(rec.get("owner", -1)):
        try:
            owner = psutil.Process(rec["owner"])
            if abs(owner.create_time() - rec.get("owner_started", 0)) < 1:
                return []  # the recording run is alive (e.g. the lock's owner shell): not stale
        except psutil.Error:
            pass
    ended = []
    for p in rec.get("procs", []):
        try:
            proc = psutil.Process(p["pid"])
            if abs(proc.create_time() - p["started"]) < 1:
                proc.kill()
                proc.wait(10)
                ended.append(p["pid"])
        except (psutil.Error, KeyError):
            continue
    if ended:
        print(f"[engine] ended {len(ended)} engine process(es) left by a killed run: pids {ended}", flush=True)
    pid_file.unlink(missing_ok=True)
    return ended


class Watchdog:
    """Raise :class:`EngineDead` in the main thread when an engine process dies or nothing progresses.

    Progress is CPU time of this process and the engine's; a working engine always spends some
    (the scheduler loop runs on the CPU on GPU machines too). Raised by a SIGUSR1 sent to the
    main thread, which wakes it from the blocking wait on the engine's output queue.
    """

    def __init__(self, procs, stall_s: float = STALL_S, poll_s: float = 5.0):
        self.procs = [psutil.Process()] + list(procs)
        self.stall_s, self.poll_s, self.reason = stall_s, poll_s, ""
        self._stop = threading.Event()
        self._prev = signal.signal(signal.SIGUSR1, self._raise)
        self._thread = threading.Thread(target=self._run, daemon=True, name="opd-engine-watchdog")
        self._thread.start()

    def _raise(self, signum, frame):  # noqa: ARG002 - signal handler signature
        raise EngineDead(self.reason)

    def _cpu(self) -> float:
        # This process's CPU time includes the watchdog's own polling (psutil reads /proc), which is not the engine
        # progressing: without it subtracted, a short poll_s could count its own reads as progress and never fire.
        # Called in the watchdog's thread, so thread_time() is that thread's CPU time.
        total = -time.thread_time()
        for p in self.procs:
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    raise psutil.NoSuchProcess(p.pid)
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                self.reason = f"vLLM engine process {p.pid} died"
                return -1.0
        return total

    def _run(self) -> None:
        last, since = self._cpu(), time.time()
        while not self._stop.wait(self.poll_s):
            now = self._cpu()
            if now >= 0 and now - last > 0.01 * self.poll_s:
                last, since = now, time.time()
                continue
            if now >= 0 and time.time() - since < self.stall_s:
                continue
            if now >= 0:
                self.reason = f"vLLM engine made no progress for {time.time() - since:.0f}s (its processes are idle)"
            if self._stop.is_set():  # stopped while this poll ran: the main thread is done with the engine
                return
            log.error("%s", self.reason)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
            return

    def stop(self) -> None:
        # the thread first, then the handler: a signal sent after the previous handler (SIGUSR1's default ends the
        # process) were back would kill the run
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=max(5.0, 2 * self.poll_s))
        signal.signal(signal.SIGUSR1, self._prev)


#: A Unix socket's path holds at most 107 bytes (sun_path is 108 with its NUL): a longer one cannot be bound.
SOCKET_PATH_MAX = 107
#: What vLLM's socket paths add to the IPC folder's parent: "/opd-vllm-ipc-<pid, 7 digits>-<8>" then "/<uuid4>".
IPC_NAME_BYTES = 30 + 37


def ipc_root(tmp: str | None = None) -> str:
    """The folder that holds the IPC folder: the temp dir (``tmp``, default ``tempfile.gettempdir()``), unless socket
    paths under it would pass the kernel's limit (a TMPDIR deep in OUTPUT_DIR, as run.sh sets where /tmp is small);
    then /tmp, where a socket, which holds no data, costs nothing even on a small tmpfs."""
    tmp = tmp or tempfile.gettempdir()
    if len(os.fsencode(tmp)) + IPC_NAME_BYTES <= SOCKET_PATH_MAX or not os.access("/tmp", os.W_OK | os.X_OK):
        return tmp
    return "/tmp"


def private_ipc_dir() -> None:
    """Point vLLM's ZMQ sockets (``VLLM_RPC_BASE_PATH``, default the system temp dir) at a folder of this process,
    removed when it exits: each engine start otherwise leaves ~7 socket files in /tmp that nothing deletes.
    One folder per process (a second engine reuses it); a value the user set is kept. The folder is made where
    vLLM's socket paths fit the kernel's limit (:func:`ipc_root`)."""
    if os.environ.get("VLLM_RPC_BASE_PATH"):
        return
    root = ipc_root()
    for r in dict.fromkeys((tempfile.gettempdir(), root)):
        sweep_stale_ipc_dirs(r)
    path, owner = tempfile.mkdtemp(prefix=f"opd-vllm-ipc-{os.getpid()}-", dir=root), os.getpid()
    os.environ["VLLM_RPC_BASE_PATH"] = path
    # only the process that made it removes it (a forked child inherits the atexit list)
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(path, ignore_errors=True))


def sweep_stale_ipc_dirs(root: str) -> list[str]:
    """Remove ``opd-vllm-ipc-<pid>-*`` folders under ``root`` whose process is gone (a killed stage skips its atexit);
    returns the removed paths. Folders of live processes, and names without a pid, are left alone."""
    gone = []
    for p in Path(root).glob("opd-vllm-ipc-*"):
        m = re.fullmatch(r"opd-vllm-ipc-(\d+)-.+", p.name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            shutil.rmtree(p, ignore_errors=True)
            gone.append(str(p))
    return gone


def exit_on_sigterm() -> None:
    """Turn SIGTERM and SIGINT into ``SystemExit(143 / 130)`` so ``finally`` blocks and atexit hooks
    run (the engine is shut down, the lock released) with no traceback: otherwise the process dies at
    once and leaves vLLM's engine-core and worker processes running as orphans. SIGINT is handled
    even where the shell started the stage with it ignored (a background job of a script)."""

    def stop(signum, frame):  # noqa: ARG001 - signal handler signature
        print(f"stopping on {signal.Signals(signum).name}", file=sys.stderr, flush=True)
        # a second Ctrl-C while the engine shuts down would raise again inside vLLM's shutdown and pull the
        # IPC folder from under its starting workers (a page of their tracebacks): say so and let it finish
        signal.signal(signal.SIGTERM, already_stopping)
        signal.signal(signal.SIGINT, already_stopping)
        sys.exit(128 + signum)

    def already_stopping(signum, frame):  # noqa: ARG001
        print(f"{signal.Signals(signum).name} again: already stopping (the engine shuts down; kill -9 to force)",
              file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
