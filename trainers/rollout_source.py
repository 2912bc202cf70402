"""Where ``OPDTrainer``'s rollouts come from: one source object, chosen once at start-up (``choose``).

The trainer asks its source (``trainer.rollouts``) for the completions of a generation batch and keeps the reward, the
teacher, the loss and the bookkeeping. ``generate`` returns a ``Rollout``: the completion ids, the behaviour log-prob of
each sampled token where the engine reports one (the rollout importance-sampling weights: the ``sampling_logps`` key
of a batch, ``OPDTrainer._rollout_is_weights``) and the optimizer step of the weights that sampled it (the rollout
files' ``behaviour_step``); ``name`` is the ``engine`` field of the metrics and the exports.

- ``HFGenerate`` (``hf-generate``): TRL's HF ``generate``, the base trainer's ``_generate_single_turn``.
- ``FastDecoder`` (``hf-generate-fast``): ``data_tools.generation.fast_decoder`` through ``trainers.fast_generation``;
  TRL's HF generate for a call it cannot serve (multimodal inputs, a generation setting it lacks).
- ``AsyncFast`` (``hf-generate-fast``, ``async_generation``): one-step off-policy generation, the fast decoder on a
  weight snapshot while the update runs (``trainers.async_rollouts``), with the snapshot's log-probs.
- ``VLLM`` (``vllm-colocate``, ``vllm-server``): TRL's vLLM generation, with the engine's sampled-token log-probs when
  ``vllm_importance_sampling_correction`` is on. Colocate is probed at start-up (``trainers.guards.probe_vllm``); a
  failed probe, or a generation that raises at any step, hands every later generation to the fast decoder or TRL's
  HF generate with one line (``drop_vllm``) and the run goes on.

``use_vllm`` is decided in two steps because TRL builds the vLLM engine inside the base trainer's ``__init__``:
``vllm_request`` turns it off before (where vLLM cannot run here), ``choose`` picks the source after.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass
from typing import Callable

import torch

from data_tools.generation.fallback import first_line
from data_tools.generation.fast_decoder import decode_options, sampling_params_from
from trainers import guards
from trainers.async_rollouts import AsyncRollouts
from trainers.fast_generation import fast_generate_single_turn, fast_path_unsupported
from trainers.model_utils import vllm_usable
from trainers.trl_compat import profiling

log = logging.getLogger(__name__)

#: The base trainer's ``_generate_single_turn`` bound to the trainer (TRL's HF generate or vLLM branch), which a
#: source calls for what it does not do itself.
BaseGenerate = Callable[..., list[list[int]]]


@dataclass
class Rollout:
    """One generation batch from a source: completion ids, the behaviour log-prob of each sampled token (None: the
    engine reports none; NaN: not known for that token), and ``behaviour_step``, the optimizer steps in the weights that
    sampled (None: the current weights)."""

    completions: list[list[int]]
    logprobs: list[list[float]] | None = None
    behaviour_step: int | None = None

    def logps_tensor(self, shape: torch.Size) -> torch.Tensor:
        """``(B, K)`` float32 log-probs aligned with the right-padded ``completion_ids`` of ``shape``; NaN: none."""
        samp = torch.full(shape, math.nan, dtype=torch.float32)
        for i, lps in enumerate(self.logprobs or ()):
            n = min(len(lps), samp.size(1))
            samp[i, :n] = torch.tensor(lps[:n], dtype=torch.float32)
        return samp


class HFGenerate:
    """TRL's HF ``generate``; the base of every source (what each does by default)."""

    name = "hf-generate"
    #: whether this source's log-probs weight the loss (rollout IS) and the step logs the ``sampling/*`` metrics
    is_weights = False

    def generate(self, trainer, base: BaseGenerate, prompt_ids, images, fields, has_tool_images=False) -> Rollout:
        return Rollout(base(prompt_ids, images, fields, has_tool_images))

    def read_batches(self, trainer, read, epoch_iterator, num_batches: int, device):
        """One optimizer step's dataloader batches and their item count: transformers' ``get_batch_samples``
        (``read``)."""
        return read(epoch_iterator, num_batches, device)

    def close(self) -> None:
        """Stop background work when training stops (``AsyncFast``'s prefetch); nothing here."""


class FastDecoder(HFGenerate):
    """The fast decoder (``trainers.fast_generation.fast_generate_single_turn``); TRL's HF generate for a call it
    cannot serve. ``decode_copy``: the student in ``decode_dtype`` when that differs from its weights' dtype."""

    name = "hf-generate-fast"

    def __init__(self):
        self.decode_copy: torch.nn.Module | None = None

    def generate(self, trainer, base, prompt_ids, images, fields, has_tool_images=False) -> Rollout:
        if images is None and not fields:
            out = fast_generate_single_turn(trainer, prompt_ids, owner=self)
            if out is not None:
                return Rollout(out)
        return super().generate(trainer, base, prompt_ids, images, fields, has_tool_images)


class AsyncFast(FastDecoder):
    """``async_generation``: each training step's completions are the prefetch of its prompts (decoded during the
    previous step on the weights before its update) or, when none was launched for them, a synchronous decode; then
    the next step's decode is launched on the weights as they are now. ``prefetch`` is the weight snapshot and its
    background decoder (``AsyncRollouts``); ``lookahead`` the next step's dataloader batches (``read_batches``).

    Raises ValueError where it cannot run: several processes, vLLM, or the fast decoder off or lacking a setting."""

    def __init__(self, trainer, fast: bool):
        a = trainer.args
        if trainer.accelerator.num_processes != 1:
            raise ValueError("async_generation runs one background decode on one device; it does not support "
                             f"{trainer.accelerator.num_processes} processes")
        if trainer.use_vllm:
            raise ValueError("async_generation decodes with the fast decoder's path, not vLLM")
        if not fast or sampling_params_from(trainer.generation_config) is None:
            raise ValueError("async_generation needs the fast HF generator (data_tools.generation.fast_decoder), "
                             "which is off here: fast_generation=False, a sharded setup (FSDP1 / ZeRO-3), or a "
                             "generation setting it lacks (repetition_penalty, beams, suppress_tokens, ...)")
        super().__init__()
        model = trainer.accelerator.unwrap_model(trainer.model)
        self.prefetch = AsyncRollouts(model, trainer._tokenizer.pad_token_id, trainer.eos_token_ids,
                                      dtype=a.decode_torch_dtype(next(model.parameters()).dtype),
                                      **decode_options(a.decode_compaction, a.decode_compile,
                                                       getattr(a, "decode_kv_growth", False)))
        self.is_weights = bool(a.vllm_importance_sampling_correction)  # from the snapshot's log-probs
        self.lookahead: tuple | None = None  # (epoch iterator, the next step's dataloader batches)

    def generate(self, trainer, base, prompt_ids, images, fields, has_tool_images=False) -> Rollout:
        if not trainer.model.training or images is not None or fields:
            return super().generate(trainer, base, prompt_ids, images, fields, has_tool_images)
        sp = sampling_params_from(trainer.generation_config)
        model = trainer.accelerator.unwrap_model(trainer.model)
        step = trainer.state.global_step
        job = self.prefetch.take(prompt_ids)
        overlap = 0.0
        if job is None:
            job = self.prefetch.generate_now(model, prompt_ids, sp, step)
        else:
            overlap = max(job.generate_s - job.wait_s, 0.0)
        nxt = self._next_prompt_ids(trainer)
        if nxt is not None:
            self.prefetch.launch(model, nxt, sp, step)
        m = trainer._metrics["train"]
        m["async/staleness"].append(float(step - job.version))
        m["async/overlap_s"].append(overlap)  # decode seconds hidden behind the previous step's main thread
        m["async/wait_s"].append(job.wait_s)
        m["async/generate_s"].append(job.generate_s)
        return Rollout(job.completions, job.logprobs if self.is_weights else None, job.version)

    def _next_prompt_ids(self, trainer) -> list[list[int]] | None:
        """Token ids of the next optimizer step's generation batch, or None (epoch end, last debug step)."""
        a = trainer.args
        if self.lookahead is None or (a.debug_max_steps and trainer.state.global_step + 1 >= a.debug_max_steps):
            return None
        # the first of a step's GA dataloader batches is the whole local generation batch (RepeatSampler contract)
        prompts = [x["prompt"] for x in self.lookahead[1][0]]
        return trainer._tokenize_prompts(copy.deepcopy(prompts))[0]

    def read_batches(self, trainer, read, epoch_iterator, num_batches: int, device):
        """This step's dataloader batches, and the next step's kept as the lookahead whose prompts the background
        decode starts on.

        Ordering: the dataloader is read one step ahead *within* an epoch, so each batch is still trained exactly
        once, at the step it has without async; the first step of every epoch (and of a resumed run) decodes
        synchronously (staleness 0). A prefetch in flight when training stops is cancelled and dropped: its batch
        was never trained, and a resumed run (which skips ``global_step`` steps of batches) decodes it again."""
        la, self.lookahead = self.lookahead, None
        if la is not None and la[0] is epoch_iterator:
            batches = la[1]
        else:
            batches, _ = read(epoch_iterator, num_batches, device)
        nxt, _ = read(epoch_iterator, num_batches, device)
        self.lookahead = (epoch_iterator, nxt) if nxt else None
        return batches, trainer._get_num_items_in_batch(batches, device)

    def close(self) -> None:
        """Cancel the prefetch in flight and drop the lookahead (no background decode outlives training)."""
        self.prefetch.cancel()
        self.lookahead = None


class VLLM(HFGenerate):
    """TRL's vLLM generation (``trainer.vllm_generation``, built by the base trainer); with ``is_weights`` the engine's
    log-prob of each sampled token too. A generation that raises hands the run to ``drop_vllm``'s source."""

    def __init__(self, trainer, is_weights: bool):
        self.name = "vllm-" + trainer.args.vllm_mode
        self.is_weights = is_weights

    def probed(self, trainer) -> HFGenerate:
        """Colocate mode with ``vllm_probe_tolerance`` > 0: ``trainers.guards.probe_vllm`` at start-up. This source if
        it passes on every process, else ``drop_vllm``'s (one line, the engine released)."""
        a = trainer.args
        if a.vllm_mode != "colocate" or a.vllm_probe_tolerance <= 0:
            return self
        reason = guards.probe_vllm(trainer, a.vllm_probe_tolerance)
        many = trainer.accelerator.num_processes > 1
        if not (trainer._any_process(reason is not None) if many else reason is not None):
            return self
        return drop_vllm(trainer, f"the vLLM colocate probe {reason or 'failed on another process'}")

    def generate(self, trainer, base, prompt_ids, images, fields, has_tool_images=False) -> Rollout:
        try:
            if self.is_weights:
                return self._with_logprobs(trainer, prompt_ids, images)
            return super().generate(trainer, base, prompt_ids, images, fields, has_tool_images)
        except Exception as e:  # noqa: BLE001 - an untested vLLM (the formal image's) failing mid-run must not end it
            if trainer.accelerator.num_processes > 1:
                raise  # the other processes would wait at vLLM's collectives: stop, resume from the last state
            trainer.rollouts = drop_vllm(trainer, f"vLLM failed at step {trainer.state.global_step} ({first_line(e)})")
            return trainer.rollouts.generate(trainer, base, prompt_ids, images, fields, has_tool_images)

    @staticmethod
    def _with_logprobs(trainer, prompt_ids, images) -> Rollout:
        """TRL's vLLM branch, keeping the engine's sampled-token log-probs."""
        if trainer.state.global_step != trainer._last_loaded_step:
            with profiling(trainer, "sync_weights"):
                trainer.vllm_generation.sync_weights()
            trainer._last_loaded_step = trainer.state.global_step
        _, completion_ids, logprobs, _ = trainer.vllm_generation.generate(
            prompts=prompt_ids, images=images, num_generations=1, profiler=profiling(trainer, "vLLM.generate"))
        return Rollout(completion_ids, [[math.nan if lp[0] is None else lp[0] for lp in seq] for seq in logprobs])


def vllm_request(args) -> bool:
    """Whether the recipe asked for vLLM; where vLLM colocate cannot run here (``trainers.model_utils.vllm_usable``),
    ``args.use_vllm`` is turned off with a warning, before the base trainer would build an engine."""
    asked = bool(args.use_vllm)
    if asked and not vllm_usable():
        log.warning("use_vllm is set but vLLM colocate needs CUDA, an importable vllm and TRL >= 1.10: generating "
                    "with the fast decoder (data_tools.generation.fast_decoder) where it applies, else HF generate")
        args.use_vllm = False
    return asked


def choose(trainer, vllm_asked: bool) -> HFGenerate:
    """The trainer's rollout source, once its base has built any vLLM engine: vLLM (colocate probed), the fast
    decoder, TRL's HF generate, or under ``async_generation`` the async fast decoder (ValueError where it cannot
    run). ``vllm_asked``: ``vllm_request``'s answer."""
    a = trainer.args
    if trainer.use_vllm:
        if a.vllm_importance_sampling_correction:
            trainer.vllm_generation.logprobs = 0  # rollout IS needs the sampled token's log-prob; TRL asks for none
        src = VLLM(trainer, bool(a.vllm_importance_sampling_correction)).probed(trainer)
    else:
        fast = a.fast_generation
        if fast is None:  # async_generation decodes with the fast path, also on CPU (tests); so does a recipe that
            # asked for vLLM where it cannot run (the fallback vllm_request's warning names: 13x TRL's HF generate on
            # a CPU, 128 random-length completions of a tiny Qwen2)
            fast = torch.cuda.is_available() or a.async_generation or vllm_asked
        why = fast_path_unsupported(trainer) if fast else None
        if why:  # the source's name says what runs: TRL's HF generate
            log.warning("fast_generation: not supported under %s; using TRL's HF generate", why)
        src = FastDecoder() if fast and not why else HFGenerate()
    if a.async_generation:
        src = AsyncFast(trainer, fast=isinstance(src, FastDecoder))
    return src


def drop_vllm(trainer, why: str) -> HFGenerate:
    """vLLM failed (its start-up probe, or a generation at any step): the engine released, ``use_vllm`` off, one line;
    returns the source of every later generation, the fast decoder (``fast_generation`` not False, a setup it runs
    under) or TRL's HF generate."""
    a = trainer.args
    guards.release_vllm(trainer)
    trainer.use_vllm = a.use_vllm = False
    fast = (a.fast_generation is not False) and fast_path_unsupported(trainer) is None
    guards.say_once(f"use_vllm: {why}; generating with "
                    f"{'the fast decoder (data_tools.generation.fast_decoder)' if fast else 'HF generate'} "
                    f"instead, use_vllm off for this run")
    return FastDecoder() if fast else HFGenerate()


__all__ = ["Rollout", "HFGenerate", "FastDecoder", "AsyncFast", "VLLM", "choose", "drop_vllm", "vllm_request"]
