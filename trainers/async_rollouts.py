"""One-step off-policy generation: the next batch's rollouts are decoded while the current update runs.

``OPDConfig.async_generation`` (the realistic step's lever a). The schedule (TRL's ``experimental.async_grpo``,
verl's one-step off-policy recipe, NeMo-RL and slime ship the same idea with separate rollout engines):

    step k start:  take R_k (sampled during step k-1 by theta_{k-2}; synchronously by theta_{k-1} when
                   nothing was prefetched); copy theta_{k-1} into the snapshot; launch the decode of
                   batch k+1 on it in a background thread; then grade R_k, score it with the teacher,
                   run the update theta_{k-1} -> theta_k, all in the main thread.
    step k+1:      trains theta_k on R_{k+1} sampled by theta_{k-1}: staleness 1.

The trainer's rollout source under ``async_generation`` (``trainers.rollout_source.AsyncFast``, ``trainer.rollouts``)
owns one ``AsyncRollouts`` (``.prefetch``) and drives it from the generation step: it takes the prefetch of the step's
prompts or decodes them now, and launches the next step's decode on the weights as they are (``AsyncFast.generate``);
it reads the dataloader one step ahead for the next step's prompts (``AsyncFast.read_batches``) and stops the decode
when training stops (``AsyncStop``).

The generator decodes a *snapshot copy* of the student (same dtype, fixed addresses, so its CUDA graph is
captured once and kept) and records the log-prob of every sampled token (``FastGenerator``'s
``return_logprobs``). The trainer weights each token by the truncated importance ratio
``min(pi_theta_k(y) / pi_theta_{k-1}(y), vllm_importance_sampling_cap)`` through the same code path as
vLLM rollouts (``OPDTrainer._rollout_is_weights`` -> ``losses.rollout_is_weights``).

Why a Python thread is enough on one GPU: with the CUDA graph, a decode step is one ``graph.replay()``
call (``torch/csrc/cuda/Graph.cpp`` binds it with the GIL released, so a launch that blocks on a full
launch queue does not hold the GIL) plus, every ``check_every`` steps, a host sync on a flag; the thread
needs the GIL for a few microseconds per token step against a GPU step of milliseconds, and the main
thread releases the GIL inside every ATen op it dispatches (torch's generated bindings). The graph is
captured in the worker with ``capture_error_mode="thread_local"`` (the main thread keeps launching work
meanwhile; the caching allocator routes only the capturing stream's allocations to the graph's pool),
normally once: in the first, synchronous step, while the main thread waits. What limits the
gain is the GPU itself: decode (bandwidth-bound, small grids) and the update (compute-bound GEMMs) share
the SMs and the memory bandwidth, so the overlapped step is at best max(generation, update) and at
worst their sum plus the snapshot copy (a few ms); it also holds the snapshot (one more copy of the
student's weights) and the decode KV cache through the update.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import TrainerCallback

from data_tools.generation.fast_decoder import FastGenerator, SamplingParams
from trainers.fast_generation import make_snapshot


#: Held by the worker around each CUDA-graph capture (``FastGenerator(capture_lock=...)``: the ``torch.cuda.graph``
#: block, whose entry synchronizes the device; the warm-up step, where ``decode_compile`` compiles, runs outside
#: it, so a compile that waits on dynamo's lock held by the main thread can never wait on this one too).
#: Synchronizing the whole device while any stream captures fails in every capture mode ("operation not permitted
#: when stream is capturing"), and the main thread does it where we do not control it: inductor's autotuning
#: benchmarks the compiled layers' kernels with a device synchronize in the first backward (RESULTS.md run 10, the
#: async step with ``compile_layers``). ``guard_device_synchronize`` makes those calls wait for the lock.
CAPTURE_LOCK = threading.RLock()


def _guarded(orig):
    def synchronize(*args, **kwargs):
        with CAPTURE_LOCK:
            return orig(*args, **kwargs)

    synchronize._opd_unguarded = orig
    synchronize.__doc__ = orig.__doc__
    return synchronize


def guard_device_synchronize() -> None:
    """Route the device-wide synchronizes of this process through ``CAPTURE_LOCK`` (once per process), so one from
    any thread waits for the worker's capture in progress instead of breaking it: ``torch.cuda.synchronize``
    (inductor's benchmarker calls it in torch 2.11), dynamo's ``CudaInterface.synchronize`` (a staticmethod bound to
    the original at import; inductor's benchmarker calls it in torch 2.13) and ``torch.accelerator.synchronize``.
    The lock is re-entrant: the worker's own synchronizes inside its capture block pass. Never removed (an
    uncontended lock per call)."""
    try:
        from torch._dynamo.device_interface import CudaInterface
    except ImportError:  # pragma: no cover - private module moved
        CudaInterface = None
    for owner, static in ((torch.cuda, False), (CudaInterface, True), (getattr(torch, "accelerator", None), False)):
        fn = getattr(owner, "synchronize", None)
        if fn is not None and getattr(fn, "_opd_unguarded", None) is None:
            setattr(owner, "synchronize", staticmethod(_guarded(fn)) if static else _guarded(fn))


@dataclass
class Rollouts:
    """One generation batch from the snapshot: ids and behaviour log-probs per completion.

    ``version``: optimizer steps in the weights that sampled (``state.global_step`` at the snapshot);
    ``generate_s``: the decode's wall seconds; ``wait_s``: seconds the main thread blocked on it.
    """

    prompt_ids: list[list[int]]
    version: int
    completions: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    generate_s: float = 0.0
    wait_s: float = 0.0
    error: BaseException | None = None
    cancelled: bool = False


class AsyncRollouts:
    """A weight snapshot of the student and one background decode on it at a time.

    Args:
        model: the (unwrapped, single-process) student; copied once here.
        dtype: the snapshot's parameter dtype (``OPDConfig.decode_dtype``); None = the student's.
        pad_token_id, eos_token_ids: as ``FastGenerator``.
        generator_kw: further ``FastGenerator`` arguments (``compaction``, ``compile_step``, ``kv_growth``).

    Thread contract: ``launch``, ``take``, ``generate_now``, ``cancel`` are called from the main thread
    only; the worker thread touches the snapshot, its ``FastGenerator`` and its own ``Rollouts``.
    """

    def __init__(self, model: torch.nn.Module, pad_token_id: int, eos_token_ids, dtype: torch.dtype | None = None,
                 **generator_kw):
        self.snapshot = make_snapshot(model, dtype)
        self.device = next(model.parameters()).device
        self._stop = threading.Event()
        # keep_cache: the snapshot's addresses never change, so the captured decode step is reused each step
        self.generator = FastGenerator(pad_token_id, eos_token_ids, keep_cache=True,
                                       capture_error_mode="thread_local", stop_event=self._stop,
                                       capture_lock=CAPTURE_LOCK, **generator_kw)
        if self.device.type == "cuda":
            guard_device_synchronize()
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._thread: threading.Thread | None = None
        self._job: Rollouts | None = None

    # ---- weights ----
    @torch.no_grad()
    def _copy_weights(self, model: torch.nn.Module):
        """theta -> snapshot on the main stream; returns the event the decode stream waits for (CUDA)."""
        src = list(model.parameters())
        dst = list(self.snapshot.parameters())
        if len(src) != len(dst):
            raise RuntimeError(f"snapshot has {len(dst)} parameters, the student {len(src)}")
        torch._foreach_copy_(dst, [s.detach() for s in src])
        if self.device.type != "cuda":
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def _run(self, job: Rollouts, sp: SamplingParams, ready) -> None:
        t0 = time.perf_counter()
        try:
            if self.stream is None:
                job.completions, job.logprobs = self.generator.generate(self.snapshot, job.prompt_ids, sp,
                                                                        return_logprobs=True)
            else:
                with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                    self.stream.wait_event(ready)
                    job.completions, job.logprobs = self.generator.generate(self.snapshot, job.prompt_ids, sp,
                                                                            return_logprobs=True)
            job.cancelled = self._stop.is_set()
        except BaseException as e:  # re-raised in the main thread by take()
            job.error = e
        job.generate_s = time.perf_counter() - t0

    # ---- main-thread API ----
    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def launch(self, model: torch.nn.Module, prompt_ids: list[list[int]], sp: SamplingParams, version: int) -> None:
        """Copy ``model``'s weights into the snapshot and start decoding ``prompt_ids`` in the background.

        Raises ``RuntimeError`` if a decode is still in flight (``take`` or ``cancel`` it first).
        """
        if self._thread is not None:
            raise RuntimeError("a background generation is still pending: take() or cancel() it first")
        ready = self._copy_weights(model)
        self._stop.clear()
        self._job = Rollouts(prompt_ids=[list(p) for p in prompt_ids], version=int(version))
        self._thread = threading.Thread(target=self._run, args=(self._job, sp, ready), name="opd-async-generation",
                                        daemon=True)
        self._thread.start()

    def _join(self) -> None:
        t = self._thread
        while t is not None and t.is_alive():
            t.join(timeout=0.5)  # a timed join stays interruptible by the main thread's signal handlers
        self._thread = None

    def take(self, prompt_ids: list[list[int]]) -> Rollouts | None:
        """The prefetched rollouts of ``prompt_ids`` (waiting for the decode to finish), or None if none was
        launched or it was for other prompts (then it is cancelled and dropped). Re-raises the worker's error."""
        if self._job is None:
            return None
        if self._job.prompt_ids != [list(p) for p in prompt_ids]:
            self.cancel()
            return None
        t0 = time.perf_counter()
        self._join()
        job, self._job = self._job, None
        job.wait_s = time.perf_counter() - t0
        if job.error is not None:
            raise job.error
        return None if job.cancelled else job

    def generate_now(self, model: torch.nn.Module, prompt_ids: list[list[int]], sp: SamplingParams,
                     version: int) -> Rollouts:
        """Synchronous decode of ``prompt_ids`` by ``model``'s current weights (through the snapshot, so the
        log-probs come from the same code path); staleness 0."""
        self.launch(model, prompt_ids, sp, version)
        job = self.take(prompt_ids)
        assert job is not None
        return job

    def cancel(self) -> None:
        """Stop the in-flight decode (at its next check, <= ``check_every`` token steps) and join its thread."""
        if self._thread is None:
            self._job = None
            return
        self._stop.set()
        self._join()
        self._job = None
        self._stop.clear()


class AsyncStop(TrainerCallback):
    """Calls ``shutdown`` (the owner's: cancel the prefetch, drop its lookahead) as soon as training is to stop
    (deadline, max steps, signal), before the final save, and at the end of training."""

    def __init__(self, shutdown: Callable[[], None]):
        self.shutdown = shutdown

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_training_stop:
            self.shutdown()

    def on_train_end(self, args, state, control, **kwargs):
        self.shutdown()


__all__ = ["AsyncRollouts", "AsyncStop", "Rollouts", "make_snapshot"]
