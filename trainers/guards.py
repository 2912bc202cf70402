"""Start-up guard for the trainer's path that has never run on a GPU here: vLLM colocate.

A 12-hour run that raises in its first on-policy step scores nothing; a slower run scores. So a path that cannot be
tested in advance is checked where it starts and, if it fails, replaced by the tested path with one line
(``data_tools.generation.fallback``, where the compile guard of ``compile_layers`` / ``decode_compile`` lives too):

- **vLLM colocate** (``use_vllm: true``, ``vllm_mode: colocate``): ``probe_vllm`` generates ``PROBE_TOKENS`` tokens for
  ``PROBE_PROMPTS`` prompts of the training set through TRL's own path (``VLLMGeneration.sync_weights`` +
  ``generate`` with the sampled token's log-prob, as ``trainers.rollout_source.VLLM`` does every step) and
  scores the same tokens with the trainer's forward (``OPDTrainer._policy_logps``, the pi_old of the rollout
  importance weights). It fails if the generation raises, returns no tokens or ids outside the model's rows, or if the
  mean |log p_vLLM - log p_trainer| over the sampled tokens (the ``sampling/sampling_logp_difference/mean`` metric) is
  not finite or exceeds ``vllm_probe_tolerance`` (nats per token). ``trainers.rollout_source.VLLM.probed`` then
  prints one line (``say_once``), releases the engine (``release_vllm``) and generates with the fast decoder
  (``data_tools.generation.fast_decoder``).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math

import torch

# say_once: the guard's one line, also OPDTrainer's (``guards.say_once``)
from data_tools.generation.fallback import first_line, say_once
from trainers.trl_compat import pad

log = logging.getLogger(__name__)

#: the probe's size: a few prompts, a few dozen tokens (seconds, at start-up)
PROBE_PROMPTS, PROBE_TOKENS = 2, 32


def probe_vllm(trainer, tolerance: float, n_prompts: int = PROBE_PROMPTS, max_tokens: int = PROBE_TOKENS) -> str | None:
    """Generate with ``trainer.vllm_generation`` and compare its log-probs with the trainer's; None if it passes,
    else the reason (one clause). ``trainer`` is an ``OPDTrainer`` with ``use_vllm`` on (see the module docstring)."""
    vg = trainer.vllm_generation
    texts = list(trainer.train_dataset[:n_prompts]["prompt"])
    if not texts:
        return "had no prompt to generate from"
    prompt_ids = trainer._tokenize_prompts(texts)[0]
    saved = (vg.max_completion_length, vg.logprobs)
    try:
        vg.max_completion_length, vg.logprobs = max_tokens, 0
        vg.sync_weights()
        _, cids, lps, _ = vg.generate(prompts=prompt_ids, images=None, num_generations=1)
    except Exception as e:  # noqa: BLE001 - any failure of the engine is a failed probe
        return f"raised {first_line(e)}"
    finally:
        vg.max_completion_length, vg.logprobs = saved
    rows = trainer.accelerator.unwrap_model(trainer.model).get_output_embeddings().weight.shape[0]
    if len(cids) != len(prompt_ids) or not all(len(c) for c in cids):
        return f"returned {sum(map(len, cids))} tokens for {len(prompt_ids)} prompts"
    if lps is None or any(len(lp) != len(c) for lp, c in zip(lps, cids)):
        return "returned no log-prob for some sampled tokens"
    if max(max(c) for c in cids) >= rows or min(min(c) for c in cids) < 0:
        return f"sampled ids outside the model's {rows} rows"
    dev = trainer.accelerator.device
    p = [torch.tensor(x) for x in prompt_ids]
    c = [torch.tensor(list(x)) for x in cids]
    out = {"prompt_ids": pad(p, padding_value=trainer._tokenizer.pad_token_id, padding_side="left").to(dev),
           "prompt_mask": pad([torch.ones_like(x) for x in p], padding_value=0, padding_side="left").to(dev),
           "completion_ids": pad(c, padding_value=trainer._tokenizer.pad_token_id, padding_side="right").to(dev),
           "completion_mask": pad([torch.ones_like(x) for x in c], padding_value=0, padding_side="right").to(dev)}
    try:
        ctx = getattr(trainer, "compute_loss_context_manager", contextlib.nullcontext)
        with ctx():
            mine = trainer._policy_logps(out).float().cpu()
    except Exception as e:  # noqa: BLE001 - the trainer's forward failing on vLLM's tokens is a failed probe too
        return f"tokens could not be scored by the trainer ({first_line(e)})"
    diffs = []
    for i, seq in enumerate(lps):
        for j, lp in enumerate(seq):
            v = lp[0] if isinstance(lp, (list, tuple)) else lp
            if v is None:
                continue
            diffs.append(abs(float(v) - float(mine[i, j])))
    if not diffs:
        return "returned no log-prob for the sampled tokens"
    mean = sum(diffs) / len(diffs)
    if not math.isfinite(mean) or mean > tolerance:
        return (f"log-probs disagree with the trainer's: mean |difference| {mean:.3g} nats/token over {len(diffs)} tokens "
                f"> vllm_probe_tolerance {tolerance:g}")
    log.info("vLLM colocate probe passed: %d tokens, mean |log-prob difference| %.3g nats/token", len(diffs), mean)
    return None


def release_vllm(trainer) -> None:
    """Drop the trainer's vLLM engine (best effort: shut its engine core down, collect, empty the CUDA cache)."""
    vg = getattr(trainer, "vllm_generation", None)
    llm = getattr(vg, "llm", None)
    engine = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    with contextlib.suppress(Exception):
        if engine is not None and hasattr(engine, "shutdown"):
            engine.shutdown()
    if vg is not None:
        with contextlib.suppress(Exception):
            vg.llm = None
    with contextlib.suppress(AttributeError):
        del trainer.vllm_generation
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


__all__ = ["probe_vllm", "release_vllm", "say_once", "PROBE_PROMPTS", "PROBE_TOKENS"]
