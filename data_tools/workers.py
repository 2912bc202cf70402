"""Worker processes of a generation stage, one per GPU (stage one and evaluation with ``workers`` > 1).

vLLM refuses ``LLM(data_parallel_size>1)`` in one process; its own data-parallel example starts one
process per rank. A stage does the same: it starts N copies of itself with a hidden ``--shard i/N``
flag, each with ``CUDA_VISIBLE_DEVICES`` set to its own slice of the parent's GPUs
(:func:`device_slices`), and :func:`run_workers`:

- forwards every line a worker prints to the parent's stdout prefixed ``[w<i>/<N>]``, and appends it
  to the worker's log file;
- waits for all; a worker that exits non-zero (or is killed) stops the others (SIGTERM, then SIGKILL
  after ``stop_timeout_s``) and raises :class:`WorkerFailed`, whose message is one line naming the
  worker, its GPU and its log;
- a SIGTERM / SIGINT to the parent (``SystemExit(143 / 130)`` from ``data_tools.generation.processes.exit_on_sigterm``)
  is passed on as the same signal, and the parent exits once the workers have stopped.

Workers are independent: none waits on another, so a dead worker never leaves a peer hanging. Each
worker asks the kernel for a SIGTERM when its parent dies (:func:`worker_init`), so a parent killed
with ``kill -9`` leaves no worker behind.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Mapping, Sequence

from data_tools.runio import REPO_ROOT

#: Set in a worker's environment: the pid of the stage process that started it (:func:`worker_init`).
WORKER_PARENT_ENV = "OPD_WORKER_PARENT"


def parse_shard(value: str) -> tuple[int, int]:
    """``"1/4"`` -> ``(1, 4)``; ``ValueError`` unless ``0 <= i < N``."""
    try:
        i, n = (int(x) for x in value.split("/"))
    except ValueError:
        raise ValueError(f"--shard must look like i/N (e.g. 0/2), got {value!r}") from None
    if not 0 <= i < n:
        raise ValueError(f"--shard i/N needs 0 <= i < N, got {value!r}")
    return i, n


def pop_shard_flag(argv: list[str]) -> tuple[int, int] | None:
    """Remove the hidden ``--shard i/N`` (or ``--shard=i/N``) from ``argv`` in place; its value, or None."""
    for k, a in enumerate(argv):
        if a == "--shard":
            if k + 1 >= len(argv):
                raise ValueError("--shard needs a value i/N")
            value = argv[k + 1]
            del argv[k : k + 2]
            return parse_shard(value)
        if a.startswith("--shard="):
            del argv[k]
            return parse_shard(a.split("=", 1)[1])
    return None


def node_layout(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """``(NNODES, NODE_RANK)`` from the environment (default 1, 0), the launcher's usual names.

    Raises:
        ValueError: not integers, NNODES < 1, or NODE_RANK outside [0, NNODES).
    """
    env = os.environ if env is None else env
    try:
        nnodes = int(env.get("NNODES") or 1)
        rank = int(env.get("NODE_RANK") or 0)
    except ValueError:
        raise ValueError(f"NNODES={env.get('NNODES')!r} and NODE_RANK={env.get('NODE_RANK')!r} must be integers") from None
    if nnodes < 1 or not 0 <= rank < nnodes:
        raise ValueError(f"need NNODES >= 1 and 0 <= NODE_RANK < NNODES, got NNODES={nnodes} NODE_RANK={rank}")
    return nnodes, rank


def device_slices(workers: int, per_worker: int = 1, env: Mapping[str, str] | None = None) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` value of each of ``workers`` workers: consecutive slices of
    ``per_worker`` entries (``tensor_parallel_size``) of the parent's ``CUDA_VISIBLE_DEVICES`` comma
    list when it is set, else of ``0 .. workers * per_worker - 1``. A parent that hides every GPU
    (``CUDA_VISIBLE_DEVICES`` empty or ``-1``: a CPU run) gives its workers the same value.

    Raises:
        ValueError: the parent's list has fewer entries than ``workers * per_worker``.
    """
    env = os.environ if env is None else env
    need = workers * per_worker
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is not None and raw.strip() in ("", "-1"):
        return [raw] * workers
    if raw is None:
        devices = [str(i) for i in range(need)]
    else:
        devices = [d.strip() for d in raw.split(",") if d.strip()]
        if len(devices) < need:
            raise ValueError(f"workers={workers} x tensor_parallel_size={per_worker} needs {need} GPUs; "
                             f"CUDA_VISIBLE_DEVICES={raw} lists {len(devices)}")
    return [",".join(devices[i * per_worker : (i + 1) * per_worker]) for i in range(workers)]


def config_argv(cfg, **override) -> list[str]:
    """Command-line flags that rebuild dataclass ``cfg`` (every field not None; ``override`` wins)."""
    values = {f.name: getattr(cfg, f.name) for f in fields(cfg)} | override
    return [x for k, v in values.items() if v is not None for x in (f"--{k}", str(v))]


def worker_init() -> None:
    """Called first in a worker process: SIGTERM when the parent dies (Linux ``PR_SET_PDEATHSIG``), so a
    ``kill -9`` of the parent stops its workers (their engines shut down and die with them)."""
    parent = os.environ.get(WORKER_PARENT_ENV)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent and os.getppid() != int(parent):  # the parent died before the request took effect
        os._exit(143)


@dataclass
class Worker:
    """One worker process to start: its command, its GPUs and its log file."""

    index: int
    total: int
    cmd: list[str]
    gpu: str
    log: Path
    env: dict[str, str] = field(default_factory=dict)

    @property
    def tag(self) -> str:
        return f"w{self.index}/{self.total}"


class WorkerFailed(RuntimeError):
    """A worker exited non-zero or was killed; the message is one line naming it, its GPU and its log."""

    def __init__(self, worker: Worker, returncode: int, what: str = "worker"):
        self.worker, self.returncode = worker, returncode
        if returncode < 0:
            try:
                how = f"was killed by {signal.Signals(-returncode).name}"
            except ValueError:
                how = f"was killed by signal {-returncode}"
        else:
            how = f"exited with code {returncode}"
        super().__init__(f"{what} {worker.index}/{worker.total} (CUDA_VISIBLE_DEVICES={worker.gpu}) {how}; "
                         f"its log: {worker.log}")


#: One worker's line at a time on the parent's stdout: print() writes a line and its newline apart, and an
#: unbuffered stdout (PYTHONUNBUFFERED, as run.sh's stages run) lets another thread's line fall between them.
_STDOUT_LOCK = threading.Lock()


def _forward(stream, log: Path, prefix: str) -> None:
    with open(log, "a", encoding="utf-8", errors="replace") as f:
        for line in stream:
            line = line.rstrip("\n")
            f.write(line + "\n")
            f.flush()
            if line.strip():  # a progress bar's carriage returns come through as empty lines
                with _STDOUT_LOCK:
                    sys.stdout.write(f"{prefix} {line}\n")
                    sys.stdout.flush()
    stream.close()


def _stop(procs: Sequence[subprocess.Popen], sig: int, timeout_s: float) -> None:
    """Send ``sig`` to the live ``procs``, wait up to ``timeout_s`` for them, then SIGKILL what is left."""
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(sig)
            except ProcessLookupError:
                pass
    end = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_workers(workers: Sequence[Worker], *, stop_timeout_s: float = 120.0, poll_s: float = 0.2,
                what: str = "worker") -> None:
    """Start ``workers``, forward their output, and wait for all of them (see the module docstring).

    Raises:
        WorkerFailed: the first worker seen to exit non-zero; the others were stopped first.
        SystemExit: the parent got SIGTERM / SIGINT (re-raised once the workers have stopped).
    """
    procs: list[subprocess.Popen] = []
    threads: list[threading.Thread] = []
    try:
        for w in workers:
            w.log.parent.mkdir(parents=True, exist_ok=True)
            with open(w.log, "a", encoding="utf-8") as f:
                f.write(f"== {time.strftime('%Y-%m-%dT%H:%M:%S')} CUDA_VISIBLE_DEVICES={w.gpu} {' '.join(w.cmd)}\n")
            env = {**os.environ, **w.env, "CUDA_VISIBLE_DEVICES": w.gpu, "PYTHONUNBUFFERED": "1",
                   WORKER_PARENT_ENV: str(os.getpid())}
            # own session: a terminal's Ctrl-C reaches the parent only, which passes it on once
            p = subprocess.Popen(w.cmd, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
            procs.append(p)
            t = threading.Thread(target=_forward, args=(p.stdout, w.log, f"[{w.tag}]"), daemon=True,
                                 name=f"opd-{w.tag}")
            t.start()
            threads.append(t)
        while True:
            codes = [p.poll() for p in procs]
            bad = next((k for k, c in enumerate(codes) if c not in (None, 0)), None)
            if bad is not None:
                _stop(procs, signal.SIGTERM, stop_timeout_s)
                for t in threads:
                    t.join(5)
                raise WorkerFailed(workers[bad], codes[bad], what)
            if all(c == 0 for c in codes):
                break
            time.sleep(poll_s)
        for t in threads:
            t.join(30)
    except BaseException as e:
        code = e.code if isinstance(e, SystemExit) else None
        sig = signal.SIGINT if (code == 130 or isinstance(e, KeyboardInterrupt)) else signal.SIGTERM
        if any(p.poll() is None for p in procs):
            print(f"stopping {sum(p.poll() is None for p in procs)} {what}(s) with {sig.name}", file=sys.stderr, flush=True)
        _stop(procs, sig, stop_timeout_s)
        raise
