"""Generation without vLLM: the project's fast decoder (``trainers.generation``) behind vLLM's interface.

For machines where vLLM cannot be installed (a CUDA stack it has no wheels for yet): stage one and
evaluation call ``HFEngine.generate`` exactly as they call ``data_tools.engine.Engine.generate``, and
get the same ``Sample`` records, so the tables are the same whichever engine wrote them
(lm-evaluation-harness's ``hf`` / ``vllm`` backends answer the same problem the same way).

- The ``n`` samples of a prompt sit in a row of one batch (G per prompt, as in training), decoded by
  ``FastGenerator``: one prefill, a static KV cache and, on CUDA, a CUDA-graph decode step.
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
"""

from __future__ import annotations

import logging
import time
from typing import Iterator, Sequence

from data_tools.engine import Sample

log = logging.getLogger(__name__)


def kv_bytes_per_token(config, dtype_bytes: int) -> int:
    """Bytes of KV cache one token takes in every layer: ``2 * layers * kv_heads * head_dim * dtype_bytes``."""
    cfg = getattr(config, "text_config", config)
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return 2 * cfg.num_hidden_layers * kv * head_dim * dtype_bytes


class HFEngine:
    """A transformers model decoded by ``trainers.generation.FastGenerator``; ``generate`` as ``Engine``'s.

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
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from trainers.generation import FastGenerator, decode_options

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
        log.info("%s engine for %s ready in %.1fs (up to %d sequences per batch)", self.name, model,
                 self.startup_s, self.max_batch)

    def close(self) -> None:
        """Free the model's memory (before another engine starts)."""
        import gc

        import torch

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
                 seeds: Sequence[int] | None = None) -> Iterator[list[Sample]]:
        """Sample ``n`` completions for each rendered prompt string, yielding per chunk of prompts.

        As ``data_tools.engine.Engine.generate``: one list per chunk of ``chunk_size`` prompts, their
        samples in prompt order, ``prompt_index`` into ``prompts``. Within a chunk, prompts are decoded
        ``max_batch // n`` at a time (at least one prompt, i.e. its ``n`` samples, per call).
        ``seeds`` (one per prompt, as vLLM's per-request seeds): ``torch.manual_seed(seeds[0])`` before the first
        decode (None: continue the engine's stream).

        Raises:
            ValueError: a prompt plus ``max_tokens`` exceeds ``max_model_len``.
        """
        from trainers.generation import SamplingParams

        sp = SamplingParams(max_new_tokens=max_tokens, do_sample=temperature > 0, temperature=temperature or 1.0,
                            top_p=top_p)
        per_call = max(1, self.max_batch // n)
        total = len(prompts)
        done = tokens = 0
        t0 = time.time()
        from data_tools.prompts import prompt_ids

        if seeds is not None:
            import torch

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
            for b0 in range(0, len(ids), per_call):
                group = ids[b0 : b0 + per_call]
                outs = self.generator.generate(self.model, [p for p in group for _ in range(n)], sp)
                for k, out in enumerate(outs):
                    i = b0 + k // n
                    batch.append(self._finish(start + i, k % n, out, len(ids[i]), max_tokens))
            done += len(ids)
            tokens += sum(s.n_tokens for s in batch)
            el = time.time() - t0
            print(f"[{desc}] {done}/{total} prompts x {n} samples | {el:.0f}s | "
                  f"{tokens / max(el, 1e-9):.0f} completion tok/s ({self.name})", flush=True)
            yield batch
