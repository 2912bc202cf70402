"""OPDTrainer: on-policy distillation with a verifier reward, built on TRL 1.16's ``DistillationTrainer``.

What TRL's trainer keeps doing (``trl/trainer/distillation_trainer.py``): on-policy generation
(HF ``generate`` or vLLM colocate / server, weight sync each step), generation once per
gradient-accumulation window with the buffered batch split into micro-batches, loss normalised by
the global completion-token count (``num_items_in_batch``), ``_forward_redirection`` so DDP / FSDP /
DeepSpeed hooks fire, the chunked divergence kernel.

What this subclass adds (docs/design.md section 5):

- G samples per prompt (``num_generations``) via ``CurriculumSampler`` (each prompt G times in a
  row, each generation batch repeated GA x ``num_iterations`` times, TRL's ``RepeatSampler`` contract).
- A verifier reward (``data_tools.grader.grade_batch`` against the ``answer`` column) turned into a
  group-normalised advantage (``losses.group_advantages``).
- Two KL modes: ``sampled`` (per-token advantage -w_kl * stopgrad(k1) + w_reward * A, PPO-clipped
  when a batch is reused) and ``full`` (TRL's chunked reverse-KL kernel, beta = 1, or top-k) plus
  the reward policy-gradient term.
- A teacher context: the teacher reads ``teacher_prompt_ids`` + the student's ``completion_ids``, so a
  privileged self-teacher (frozen copy of the initial student) can see the reference solution.
- Vocabulary-size mismatch with one tokenizer (Qwen2.5 1.5B 151,936 rows vs 7B 152,064): both heads
  are sliced to the shared range; different tokenizers are an error at start-up.
- An off-policy term on stage one's verified teacher solutions (curriculum column ``teacher_solution``):
  ``w_sft`` cross-entropy in on-policy steps and a clock-scheduled share of cross-entropy-only steps; its state
  across steps is a ``trainers.offpolicy.OffPolicySchedule`` (``self.offpolicy``).
- One rollout source, chosen at start-up (``trainers.rollout_source``, ``self.rollouts``): vLLM (probed, and
  replaced by the fast decoder with one line if it fails), the fast decoder, TRL's HF generate, or one-step
  off-policy generation on a weight snapshot while the update runs (``async_generation``); rollout IS weights
  from the engine's log-probs.
- Run-contract plumbing: resume state under ``<output_dir>/resume``, HF exports under ``ckpt_dir``,
  per-step metrics, rollout parquet files, a non-finite guard.

``OPDConfig`` lives in ``trainers.opd_config``, the curriculum loading and the rollout schema in
``trainers.data``, the model loading and checks in ``trainers.model_utils``, saving and resuming in
``trainers.checkpointing``; import each from its module.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import Any

import torch

from trainers import heads, losses, rollout_source
from trainers.async_rollouts import AsyncStop
from trainers.callbacks import DeadlineCallback, MetricsJsonlCallback, SaveCadenceCallback, process_start_time
from trainers.checkpointing import CLOCK_STATE, SaveAndResume
from trainers.data import ROLLOUT_SCHEMA
from trainers.model_utils import apply_matmul_precision, logit_transform, shared_vocabulary, student_and_teacher
from trainers.offpolicy import OffPolicySchedule, clear_optimizer_moments, solution_batch
from trainers.opd_config import TIME_SCHEDULES, OPDConfig
from trainers.sampler import CurriculumSampler
from trainers.schedules import adam_update_sumsq
from trainers.step_log import NonFiniteError, StepHooks, StepLog
from trainers.trl_compat import DistillationTrainer, pad, shuffle_sequence_dict, split_tensor_dict

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# trainer


class OPDTrainer(SaveAndResume, DistillationTrainer):
    """On-policy distillation + verifier reward (see the module docstring and ``OPDConfig``).

    Args:
        model: the student, a ``PreTrainedModel`` or a local path (loaded in ``args.model_dtype``).
        teacher_model: a ``PreTrainedModel``, a local path, or None for a frozen copy of the initial
            student (deep-copied here, before any training touches it).
        args: ``OPDConfig``.
        train_dataset: from ``build_train_dataset`` (columns prompt, teacher_prompt, answer,
            problem_id, bucket, curriculum_index).
        processing_class: the student's tokenizer (left padding).
        teacher_processing_class: the teacher's tokenizer, compared with the student's when the
            teacher is a separate model (None: loaded from a path teacher, else not checked).
        start_time: Unix time the wall clock counts from (default: process start).

    The run-contract callbacks are installed here: ``DeadlineCallback`` (``self.deadline``),
    ``SaveCadenceCallback`` and ``MetricsJsonlCallback``.

    Raises:
        ValueError: tokenizers differ; the tokenizer has ids beyond the shared vocabulary; batch
            sizes that do not hold whole prompt groups.
    """

    _tag_names = ["trl", "opd"]
    _name = "OPD"

    def __init__(self, model, teacher_model=None, args: OPDConfig | None = None, train_dataset=None,
                 processing_class=None, callbacks=None, optimizers=(None, None), teacher_processing_class=None,
                 start_time: float | None = None):
        args = args or OPDConfig()
        vllm_asked = rollout_source.vllm_request(args)  # off before the base builds an engine where vLLM cannot run
        model, teacher_model, self._self_teacher = student_and_teacher(model, teacher_model, args, processing_class,
                                                                       teacher_processing_class)
        self.shared_vocab = shared_vocabulary(model, teacher_model, processing_class)

        super().__init__(model=model, teacher_model=None, args=args, train_dataset=train_dataset,
                         processing_class=processing_class, callbacks=callbacks, optimizers=optimizers)
        if self.is_deepspeed_enabled:
            from trl.models import prepare_deepspeed

            self.teacher_model = prepare_deepspeed(teacher_model, self.accelerator)
        else:
            # accelerate leaves an evaluation-mode model where it is under FSDP (huggingface/trl#2580), and the models are
            # loaded on the CPU: the frozen teacher goes whole onto this process's device (a 7B in bf16: 15 GB a GPU)
            self.teacher_model = self.accelerator.prepare_model(teacher_model, evaluation_mode=True)
            self.teacher_model.to(self.accelerator.device)

        self.rollouts = rollout_source.choose(self, vllm_asked)  # vLLM (probed), fast decoder, HF generate, async
        self._rollout: rollout_source.Rollout | None = None  # the last generation, until its batch is scored
        apply_matmul_precision(args.matmul_precision)  # after vLLM's engine, which sets "highest" in this process
        world = self.accelerator.num_processes
        self.generation_batch_size = (args.per_device_train_batch_size * world * args.gradient_accumulation_steps
                                      * args.steps_per_generation)
        self._buffer_pos = 0  # micro-steps served from the buffered rollout batch (its window: _prepare_inputs)
        self._slice = None  # an off-policy micro-batch's slice, handed to _prepare_inputs by training_step
        if self.generation_batch_size % args.num_generations:
            raise ValueError(f"generation batch of {self.generation_batch_size} completions is not a multiple of "
                             f"num_generations={args.num_generations}")
        compile_on = args.compile_layers
        if compile_on is None:  # sharded weights (FSDP / ZeRO) are gathered inside the layers: leave them eager
            compile_on = torch.cuda.is_available() and not (self.is_fsdp_enabled or self.is_deepspeed_enabled)
        self.compiled_layers = False
        if compile_on:
            from trainers.model_utils import compile_decoder_layers

            student_ok = compile_decoder_layers(self.accelerator.unwrap_model(self.model), only_with_grad=True)
            teacher_ok = compile_decoder_layers(self.accelerator.unwrap_model(self.teacher_model), only_with_grad=False)
            self.compiled_layers = student_ok and teacher_ok
            if not self.compiled_layers:
                log.warning("compile_layers: model has no model.layers to compile; running eagerly")
        self.steps = StepLog(self.accelerator, args.max_consecutive_nonfinite)  # the running step's sums and guard
        self._fraction0 = 0.0  # time_fraction() at the resumed checkpoint (CLOCK_STATE); 0 for a fresh run
        self._pending_rollouts: dict[str, Any] | None = None
        ds = self.train_dataset
        solutions = (ds["teacher_solution"] if args.trains_on_teacher_solutions and ds is not None
                     and "teacher_solution" in ds.column_names else None)
        self.offpolicy = OffPolicySchedule(args, solutions, world_size=self.accelerator.num_processes)
        if args.head_kernel == "liger":  # say which terms Liger computes; TRL's kernels keep the others
            pair = (self.accelerator.unwrap_model(self.model), teacher_model)
            split = heads.liger_split(temperature=self.temperature, kl_mode=args.kl_mode, full_topk=args.full_topk,
                                      biases=[heads.shared_head(m, self.shared_vocab)[1] for m in pair],
                                      transforms=[logit_transform(m.config) for m in pair])
            log.info("head_kernel=liger: sampled-token log-probs by %s, full reverse KL by %s (without rollout IS "
                     "weights)", *split)
        self.add_callback(StepHooks(self))
        # The run contract travels with the trainer (not only with stages.train): wall-clock stop,
        # save cadence, per-step metrics file.
        self.start_time = process_start_time() if start_time is None else start_time
        sync = self._any_process if self.accelerator.num_processes > 1 else None
        self.deadline = DeadlineCallback(args.horizon_seconds, self.start_time, max_steps=args.debug_max_steps,
                                         sync=sync)
        self.add_callback(self.deadline)
        self.cadence = SaveCadenceCallback(args.ckpt_every_steps, args.ckpt_every_minutes, sync=sync,
                                           hedge_fractions=tuple(args.ckpt_hedge_fractions or ()),
                                           fraction=self.time_fraction)  # the run's window, across resumes
        self.add_callback(self.cadence)
        self.add_callback(MetricsJsonlCallback(args.metrics_path, self.start_time,
                                               static={"engine": self.rollouts.name, "experiment": args.experiment_name,
                                                       "kl_mode": args.kl_mode,
                                                       "truncated_completions": args.truncated_completions}))
        if args.async_generation:  # last: the prefetch is cancelled once the deadline's callback has stopped training
            self.add_callback(AsyncStop(self.rollouts.close))

    def sft_phase_done(self) -> bool:
        """True once every later step is on-policy (the solution stream has no batch left under ``sft_max_epochs``
        passes); always False without a cap. Read at a step's end, it says whether the next step is past the
        hand-over (bench/learning.py exports the model there)."""
        return self.offpolicy.phase_done()

    def time_fraction(self) -> float:
        """Fraction of the training window used, in [0, 1]: 0 when training starts, 1 at the horizon.

        Schedules over the wall clock (learning rate, objective mix) read this, never the step count:
        a formal run's step count is unknown in advance.
        """
        # The window starts at training, not at run.sh's start; a resumed run continues from the fraction
        # it saved (f0) and reaches 1 at this run's horizon: f = f0 + (1 - f0) * this window's share.
        f0 = self._fraction0
        return f0 + (1.0 - f0) * self.deadline.window_fraction()

    def create_optimizer(self, model=None):
        """TRL's / transformers' optimizer, plus the off-policy steps' rate (``sft_learning_rate``) and the re-warm-up
        after a reset hand-over (``sft_handover_reset``) as step hooks."""
        # transformers 5 takes the model; 4.57 (the formal image's) takes none
        opt = super().create_optimizer(model) if model is not None else super().create_optimizer()
        self.offpolicy.install_rate_hooks(opt, step=lambda: int(self.state.global_step))
        torch_opt = getattr(opt, "optimizer", opt)
        if isinstance(torch_opt, torch.optim.Optimizer) and not getattr(torch_opt, "_opd_update_probe", False):
            torch_opt._opd_update_probe = True

            def probe(o, args, kwargs):  # optim/update_rms: Adam's step in units of the rate (schedules.py)
                sq, n = adam_update_sumsq(o)
                self.steps.acc["upd_sumsq"] += sq
                self.steps.acc["upd_count"] += n

            torch_opt.register_step_post_hook(probe)
        return opt

    # ---- learning-rate schedule on the clock ----
    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """``linear_time`` / ``cosine_time``: ``trainers.schedules.time_lambda_lr`` over ``time_fraction``;
        transformers' own schedulers otherwise."""
        shape = TIME_SCHEDULES.get(getattr(self.args.lr_scheduler_type, "value", self.args.lr_scheduler_type))
        if shape is None or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)
        from trainers.schedules import time_lambda_lr

        self.lr_scheduler = time_lambda_lr(optimizer if optimizer is not None else self.optimizer, self.time_fraction,
                                           shape, warmup=self._warmup_share(), final=self.args.lr_final_ratio)
        self._created_lr_scheduler = True
        return self.lr_scheduler

    def _warmup_share(self) -> float:
        """``lr_warmup_time`` as a share of the training window: a share (< 1) as given; seconds over the window
        left from now (training's start) to the horizon, not over the whole clock (stage one is not training)."""
        w = self.args.lr_warmup_time
        if w < 1:
            return w
        window = self.deadline.start_time + self.deadline.horizon_s - self.deadline.clock()
        return min(w / max(window, 1e-9), 0.99)

    def _any_process(self, flag: bool) -> bool:
        """True on every process if ``flag`` is True on any (a max-reduce)."""
        t = torch.tensor([1.0 if flag else 0.0], device=self.accelerator.device)
        return bool(self.accelerator.reduce(t, reduction="max").item())

    # ---- generation (the rollout source: trainers.rollout_source) ----
    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:  # also on HorizonReached / errors: no background decode outlives train()
            self.rollouts.close()

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """transformers' one optimizer step of dataloader batches, read by the rollout source (under
        ``async_generation`` one step ahead: ``AsyncFast.read_batches``)."""
        return self.rollouts.read_batches(self, super().get_batch_samples, epoch_iterator, num_batches, device)

    def _tokenize_prompts(self, prompts: list):
        # TRL tokenizes string prompts with processing_class(text=...), which lets a post-processor add a
        # second BOS after the one the chat template wrote (DeepSeek-R1-Distill-Qwen); prompts here are
        # always rendered text, so tokenize them as apply_chat_template(tokenize=True) would.
        if prompts and isinstance(prompts[0], str):
            from data_tools.prompts import prompt_ids

            return prompt_ids(self.processing_class, prompts), None, {}
        return super()._tokenize_prompts(prompts)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, has_tool_images=False):
        self._rollout = self.rollouts.generate(self, super()._generate_single_turn, prompt_ids, images,
                                               multimodal_fields, has_tool_images)
        return self._rollout.completions

    # ---- data order ----
    def _get_train_sampler(self, dataset=None):
        ds = dataset if dataset is not None else self.train_dataset
        n = len(ds)
        cols = ds.column_names
        buckets = ds["bucket"] if "bucket" in cols else [0] * n
        order = ds["curriculum_index"] if "curriculum_index" in cols else list(range(n))
        a = self.args
        return CurriculumSampler(buckets, order, prompts_per_batch=self.generation_batch_size // a.num_generations,
                                 num_generations=a.num_generations,
                                 repeat_count=a.gradient_accumulation_steps * a.steps_per_generation * a.num_iterations,
                                 mode=a.curriculum, mix=a.curriculum_mix,
                                 shuffle_within_bucket=a.curriculum_shuffle_within_bucket, seed=a.seed)

    def get_train_dataloader(self):
        # one dataloader batch = one rollout batch (steps_per_generation optimizer steps of GA micro-batches)
        return self._get_dataloader(dataset=self.train_dataset, description="Training",
                                    batch_size=self._train_batch_size * self.args.gradient_accumulation_steps
                                    * self.args.steps_per_generation,
                                    sampler_fn=self._get_train_sampler, is_training=True)

    # ---- generation, reward, teacher context ----
    def _prepare_inputs(self, generation_batch):
        # TRL's version regenerates every GA micro-steps. Here a rollout batch serves steps_per_generation optimizer
        # steps of GA micro-batches each, num_iterations times over (TRL GRPO's order); an off-policy batch one
        # step. The sampler repeats each rollout batch GA x steps_per_generation x num_iterations times, so a window
        # cut short (an off-policy step) generates next from the same prompts.
        if self._slice is not None:  # training_step's slice of a micro-batch already drawn (sft_micro_batch_size)
            part, self._slice = self._slice, None
            return part
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)
        a = self.args
        ga = a.gradient_accumulation_steps
        if self._buffered_inputs is None or self._buffer_pos >= len(self._buffered_inputs) * a.num_iterations:
            off = self.offpolicy.choose(self.time_fraction(), int(self.state.global_step),
                                        agree=self._any_process if self.accelerator.num_processes > 1 else None)
            if self.offpolicy.handover_now and self.args.sft_handover_reset:
                clear_optimizer_moments(self.optimizer)
                log.info("hand-over at step %d: optimizer moments cleared, rate warming up over %d steps",
                         self.offpolicy.handover_step, self.args.sft_handover_reset)
            batch = self._offpolicy_batch() if off else self._generate_and_score_completions(generation_batch)
            batch = shuffle_sequence_dict(batch)
            self._buffered_inputs = split_tensor_dict(batch, ga * (1 if off else a.steps_per_generation))
            if not off and a.steps_per_generation > 1:
                self._per_step_token_counts(self._buffered_inputs, ga)
            self._buffer_pos = 0
        inputs = self._buffered_inputs[self._buffer_pos % len(self._buffered_inputs)]
        self._buffer_pos += 1
        return inputs

    def _per_step_token_counts(self, micro: list[dict[str, Any]], ga: int) -> None:
        """Each optimizer step's loss is normalised by its own tokens (every process's): the counts the rollout batch
        carries for all its steps are replaced, per group of ``ga`` micro-batches, by that step's."""
        for s in range(0, len(micro), ga):
            group = micro[s : s + ga]
            for key, mask in (("num_items_in_batch", "completion_mask"), ("sft_num_items", "sft_completion_mask")):
                if key in group[0]:
                    n = self.accelerator.gather(sum(m[mask].sum() for m in group).reshape(1)).sum()
                    for m in group:
                        m[key] = n.to(group[0][key].dtype)

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        from data_tools.grader import grade_batch

        device = self.accelerator.device
        a = self.args
        t0 = time.perf_counter()
        out = super()._generate_and_score_completions(inputs)
        self.steps.timers["time/generation"] += time.perf_counter() - t0

        cids, cmask = out["completion_ids"], out["completion_mask"]
        gen_tokens = int(out["num_items_in_batch"].item())  # global, before any truncation mask
        B = cids.size(0)
        ids_list = [c[m.bool()].tolist() for c, m in zip(cids.cpu(), cmask.cpu())]
        eos = set(self.eos_token_ids)
        truncated = [not ids or ids[-1] not in eos for ids in ids_list]
        texts = self.processing_class.batch_decode(ids_list, skip_special_tokens=True)
        t1 = time.perf_counter()
        verdicts = grade_batch(texts, [x["answer"] for x in inputs], truncated=truncated,
                               timeout_s=a.grader_timeout_s, workers=a.grader_workers, answer_filter=a.answer_filter,
                               profile=a.grader_profile)
        self.steps.timers["time/reward"] += time.perf_counter() - t1
        # A truncated completion earns nothing: its \boxed{} may precede a retraction the cap cut off.
        rewards = torch.tensor([1.0 if v.correct and not t else 0.0 for v, t in zip(verdicts, truncated)],
                               device=device)
        withheld = torch.tensor([float(v.correct and t) for v, t in zip(verdicts, truncated)], device=device)
        if a.truncated_completions == "mask":  # TRL GRPO's mask_truncated_completions
            keep = torch.tensor([not t for t in truncated], device=cmask.device, dtype=cmask.dtype)
            out["completion_mask"] = cmask = cmask * keep.unsqueeze(1)
            out["num_items_in_batch"] = self.accelerator.gather(cmask.sum()).sum()

        # Group statistics over the global batch: a prompt's G samples may span processes.
        all_rewards = self.accelerator.gather(rewards)
        G = a.num_generations
        adv = losses.group_advantages(all_rewards, G, scale_by_std=a.scale_advantages_by_std, eps=a.advantage_eps)
        pi = self.accelerator.process_index
        out["advantages"] = adv[pi * B : (pi + 1) * B].to(device)
        groups = all_rewards.view(-1, G)
        m = self._metrics["train"]
        m["reward/mean"].append(all_rewards.mean().item())
        m["reward/std"].append(all_rewards.std().item() if all_rewards.numel() > 1 else 0.0)
        m["reward/group_pass_rate"].append((groups.max(dim=1).values > 0).float().mean().item())
        m["reward/zero_std_frac"].append((groups.max(dim=1).values == groups.min(dim=1).values).float().mean().item())
        m["advantages/abs_mean"].append(adv.abs().mean().item())
        m["reward/truncated_withheld_frac"].append(self.accelerator.gather(withheld).mean().item())

        # Teacher input = teacher prompt + the student's completion tokens, the prompt tokenised as the
        # student's is (_tokenize_prompts), so both carry exactly the chat template's special tokens.
        if a.teacher_context == "privileged":
            t_ids = self._tokenize_prompts([x["teacher_prompt"] for x in inputs])[0]
            t_ids = [torch.tensor(ids) for ids in t_ids]
            out["teacher_prompt_ids"] = pad(t_ids, padding_value=self._tokenizer.pad_token_id,
                                            padding_side="left").to(device)
            out["teacher_prompt_mask"] = pad([torch.ones_like(t) for t in t_ids], padding_value=0,
                                             padding_side="left").to(device)
        else:
            out["teacher_prompt_ids"], out["teacher_prompt_mask"] = out["prompt_ids"], out["prompt_mask"]
        out["rollout_index"] = torch.arange(B, device=device)
        rollout, self._rollout = self._rollout or rollout_source.Rollout([]), None
        if rollout.logprobs is not None:  # the engine's log-probs: rollout IS weights (_rollout_is_weights)
            out["sampling_logps"] = rollout.logps_tensor(cids.shape).to(device)
        if a.num_iterations > 1 or a.steps_per_generation > 1:
            out["old_logps"] = self._policy_logps(out)
        if a.w_sft > 0:
            out.update(self._solution_rows(inputs, B))
        self.steps.gen_tokens = gen_tokens

        if a.save_rollouts:
            first = pi * B
            behaviour = self.state.global_step if rollout.behaviour_step is None else rollout.behaviour_step
            self._pending_rollouts = {
                "step": self.state.global_step + 1,
                "rows": [{
                    "step": self.state.global_step + 1,
                    "problem_id": x["problem_id"],
                    "sample_index": (first + i) % G,
                    "bucket": int(x.get("bucket", 0) or 0),
                    "prompt": x["prompt"],
                    "completion": texts[i],
                    "reward": float(rewards[i]),
                    "correct": bool(verdicts[i].correct),
                    "extracted": verdicts[i].extracted,
                    "n_tokens": len(ids_list[i]),
                    "finish_reason": "length" if truncated[i] else "stop",
                    "advantage": float(out["advantages"][i]),
                    "seq_kl": float("nan"),
                    "behaviour_step": behaviour,
                } for i, x in enumerate(inputs)],
            }
        return out

    # ---- the off-policy term's data (trainers.offpolicy) ----
    def _offpolicy_batch(self) -> dict[str, Any]:
        """The next ``sft_batch_size`` teacher solutions of ``self.offpolicy``'s stream (this process's share)."""
        pi, n = self.accelerator.process_index, self.accelerator.num_processes
        rows = self.train_dataset.select(self.offpolicy.next_rows(pi, n))
        batch = self._solution_batch(rows["prompt"], rows["teacher_solution"])
        batch["off_policy"] = torch.ones(len(rows), device=self.accelerator.device)
        self.steps.gen_tokens = int(batch["sft_num_items"].item())
        return batch

    def _solution_rows(self, inputs: list[dict[str, Any]], B: int) -> dict[str, torch.Tensor]:
        """The ``w_sft`` term's data in an on-policy batch: each prompt's teacher solution on its group's first row."""
        G, first = self.args.num_generations, self.accelerator.process_index * B
        sols = [x.get("teacher_solution") if (first + i) % G == 0 else None for i, x in enumerate(inputs)]
        return self._solution_batch([x["prompt"] for x in inputs], sols)

    def _solution_batch(self, prompts: list[str], solutions: list[str | None]) -> dict[str, torch.Tensor]:
        """``solution_batch`` on this process's device, with ``sft_num_items``: the solution tokens of every process."""
        out = solution_batch(self.processing_class, prompts, solutions, device=self.accelerator.device)
        out["sft_num_items"] = self.accelerator.gather(out["sft_completion_mask"].sum()).sum().float()
        return out

    @torch.no_grad()
    def _policy_logps(self, out: dict[str, Any]) -> torch.Tensor:
        """``(B, K)`` log-probs of the completion tokens under the current (pre-update) student: pi_old."""
        model = self.accelerator.unwrap_model(self.model)
        w, b = heads.shared_head(model, self.shared_vocab)
        scale, cap = logit_transform(model.config)
        cids, cmask = out["completion_ids"], out["completion_mask"]
        K = cids.size(1)
        res = torch.zeros(cids.shape, dtype=torch.float32, device=cids.device)
        mb = self.args.per_device_train_batch_size
        for s in range(0, cids.size(0), mb):
            ids = torch.cat([out["prompt_ids"][s : s + mb], cids[s : s + mb]], dim=1)
            mask = torch.cat([out["prompt_mask"][s : s + mb], cmask[s : s + mb]], dim=1)
            h = self._get_last_hidden_state(model, ids, mask, K)
            valid = cmask[s : s + mb].bool()
            lp, _ = losses.token_logprobs(h[valid], w, b, cids[s : s + mb][valid], temperature=self.temperature,
                                          logit_scale=scale, softcap=cap)
            chunk = res[s : s + mb]
            chunk[valid] = lp.float()
        return res

    def _get_last_hidden_state(self, unwrapped_model, *args, **kwargs):
        # TRL's version calls the backbone (``base_model``) directly, past the top-level ``forward`` that accelerate
        # wraps in autocast: with fp32 weights and ``bf16: true`` every forward would run in fp32, several times
        # slower (the formal recipe's SFT step: bench/results/2026-12-05-formal-shape-rehearsal.md). The mixed
        # precision is applied here.
        with self.accelerator.autocast():
            return super()._get_last_hidden_state(unwrapped_model, *args, **kwargs)

    # ---- loss ----
    def _compute_loss(self, unwrapped_student, inputs, num_items_in_batch):
        a = self.args
        if "off_policy" in inputs:
            return self._sft_loss(unwrapped_student, inputs, 1.0)
        cids, cmask = inputs["completion_ids"], inputs["completion_mask"]
        K = cids.size(1)
        s_ids = torch.cat([inputs["prompt_ids"], cids], dim=1)
        s_mask = torch.cat([inputs["prompt_mask"], cmask], dim=1)

        t0 = time.perf_counter()
        unwrapped_teacher = self.accelerator.unwrap_model(self.teacher_model)
        (ws, bs), (wt, bt) = (heads.shared_head(m, self.shared_vocab) for m in (unwrapped_student, unwrapped_teacher))
        s_scale, s_cap = logit_transform(unwrapped_student.config)
        t_scale, t_cap = logit_transform(unwrapped_teacher.config)
        valid = cmask.bool().to(ws.device)
        targets = cids.to(ws.device)[valid]
        kernel = a.head_kernel
        ht = None
        # Reward-only training (sampled mode, w_kl = 0) never reads the teacher: skip its forward, so
        # that arm pays no teacher compute (bench/learning.py compares arms at equal GPU time).
        score_teacher = a.w_kl > 0 or a.kl_mode == "full"
        if score_teacher:
            # The teacher runs before the student's forward: its no-grad activations then never sit on
            # top of the student's saved ones (peak memory), and the values are the same.
            self.teacher_model.eval()
            t_ids = torch.cat([inputs["teacher_prompt_ids"], cids], dim=1)
            t_mask = torch.cat([inputs["teacher_prompt_mask"], cmask], dim=1)
            with torch.no_grad():
                h_t = self._forward_redirection(self.teacher_model, unwrapped_teacher, self._get_last_hidden_state,
                                                unwrapped_teacher, t_ids, t_mask, K)  # (B, K, H_t)
                ht = h_t.to(wt.device)[valid]
                del h_t  # the (B, K, H_t) tensor incl. padding: only the valid rows are kept
                t_logp, _ = heads.token_logprobs(ht, wt, bt, targets.to(wt.device), kernel=kernel,
                                                 temperature=self.temperature, logit_scale=t_scale, softcap=t_cap)
            t_logp = t_logp.to(ws.device)
            if a.kl_mode == "sampled":
                ht = None  # only the full-vocabulary KL reads the teacher's hidden states again
        self.steps.timers["time/teacher"] += time.perf_counter() - t0

        h_s = self._get_last_hidden_state(unwrapped_student, s_ids, s_mask, K)  # (B, K, H_s)
        hs = h_s.to(ws.device)[valid]
        del h_s  # (B, K, H_s) with padding rows; the copy of the valid rows is what the graph needs
        s_logp, entropy = heads.token_logprobs(hs, ws, bs, targets, kernel=kernel, temperature=self.temperature,
                                               logit_scale=s_scale, softcap=s_cap, with_entropy=True)
        if not score_teacher:
            t_logp = s_logp.detach()  # k1 = 0: the KL metrics read 0 (not measured) in reward-only runs
        adv_tok = inputs["advantages"].to(ws.device).unsqueeze(1).expand_as(cids)[valid]
        N = num_items_in_batch if num_items_in_batch is not None else valid.sum().clamp(min=1)
        k1 = (s_logp.detach() - t_logp)  # for metrics and rollouts, unclamped
        old = inputs["old_logps"].to(ws.device)[valid] if "old_logps" in inputs else s_logp.detach()
        is_w = self._rollout_is_weights(old, inputs, valid)
        if a.kl_mode == "sampled":
            loss, parts = losses.sampled_token_loss(
                s_logp, old, t_logp, adv_tok, N, w_kl=a.w_kl, w_reward=a.w_reward,
                teacher_logprob_min=a.teacher_logprob_min, k1_clamp=a.k1_clamp, epsilon_low=a.epsilon_low,
                epsilon_high=a.epsilon_high, is_weights=is_w)
            self.steps.acc["loss_kl"] += parts.loss_kl
            self.steps.acc["loss_reward"] += parts.loss_reward
            self.steps.acc["clipped"] += parts.clipped
            self.steps.acc["ratio_sum"] += parts.ratio_sum
            self.steps.acc["k1_clamped"] += parts.k1_clamped
        else:
            if a.full_topk:
                kl = losses.topk_reverse_kl(hs, ws, bs, ht.to(ws.device), wt, bt, a.full_topk,
                                            temperature=self.temperature, student_scale=s_scale,
                                            student_softcap=s_cap, teacher_scale=t_scale, teacher_softcap=t_cap)
            else:
                kl = heads.reverse_kl(hs, ws, bs, ht.to(ws.device), wt, bt, kernel=kernel, temperature=self.temperature,
                                      student_scale=s_scale, student_softcap=s_cap, teacher_scale=t_scale,
                                      teacher_softcap=t_cap, is_weights=is_w)  # (n,), or its sum (Liger)
            loss, kl_term, r_term = losses.full_vocab_loss(kl, s_logp, adv_tok, N, w_kl=a.w_kl, w_reward=a.w_reward,
                                                           is_weights=is_w)
            self.steps.acc["loss_kl"] += float(kl_term)
            self.steps.acc["loss_reward"] += float(r_term)
            self.steps.acc["kl_full_sum"] += float(kl.detach().sum())
            self.steps.acc["ratio_sum"] += float(valid.sum())
        self.steps.acc["k1_sum"] += float(k1.sum())
        self.steps.acc["tokens"] += float(valid.sum())

        pend = self._pending_rollouts
        if pend is not None:
            seq = torch.zeros(cids.shape, dtype=torch.float32, device=ws.device)
            seq[valid] = k1.float()
            for idx, v in zip(inputs["rollout_index"].tolist(), seq.sum(dim=1).tolist()):
                if math.isnan(pend["rows"][idx]["seq_kl"]):
                    pend["rows"][idx]["seq_kl"] = v
        if a.w_sft > 0:
            loss = loss + self._sft_loss(unwrapped_student, inputs, a.w_sft)[0]
        return loss, entropy.detach().sum(), valid.sum()

    def _sft_loss(self, unwrapped_student, inputs, weight: float):
        """``(weight * CE, entropy sum, token count)`` of the micro-batch's teacher solutions.

        CE = -sum_t log pi_theta(y_t | x, y_<t) over solution tokens / the step's global solution-token
        count (per process under DDP averaging, as TRL divides ``num_items_in_batch``), at temperature 1
        (TRL ``SFTTrainer``'s completion-only loss). A micro-batch without solution tokens gives 0.
        """
        cids, cmask = inputs["sft_completion_ids"], inputs["sft_completion_mask"]
        rows = cmask.bool().any(dim=1)
        if not bool(rows.any()):
            return cids.new_zeros((), dtype=torch.float32), cids.new_zeros((), dtype=torch.float32), rows.sum()
        cids, cmask = cids[rows], cmask[rows]
        ids = torch.cat([inputs["sft_prompt_ids"][rows], cids], dim=1)
        mask = torch.cat([inputs["sft_prompt_mask"][rows], cmask], dim=1)
        h = self._get_last_hidden_state(unwrapped_student, ids, mask, cids.size(1))
        w, b = heads.shared_head(unwrapped_student, self.shared_vocab)
        scale, cap = logit_transform(unwrapped_student.config)
        valid = cmask.bool().to(w.device)
        lp, entropy = losses.token_logprobs(h.to(w.device)[valid], w, b, cids.to(w.device)[valid], logit_scale=scale,
                                            softcap=cap, with_entropy=True)
        N = inputs["sft_num_items"].clamp(min=1.0).to(lp.device) / self.accelerator.num_processes
        ce = -lp.sum() / N
        self.steps.acc["sft_loss"] += float(ce.detach())
        self.steps.acc["sft_tokens"] += float(valid.sum())
        return weight * ce, entropy.detach().sum(), valid.sum()

    def _rollout_is_weights(self, old: torch.Tensor, inputs, valid: torch.Tensor) -> torch.Tensor | None:
        """``(n,)`` truncated rollout IS weights over the valid tokens (None without engine log-probs), and
        their mismatch statistics into this step's accumulators (``sampling/*`` metrics)."""
        if "sampling_logps" not in inputs:
            return None
        samp = inputs["sampling_logps"].to(old.device)[valid]
        w = losses.rollout_is_weights(old, samp, self.args.vllm_importance_sampling_cap)
        self.steps.add_rollout_is(old, samp, w, self.args.vllm_importance_sampling_cap)
        return w

    # ---- step bookkeeping ----
    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()  # as Trainer.training_step does first: _prepare_inputs reads training mode (after an evaluation
        micro = self._prepare_inputs(inputs)  # or an export at a mark the model is in eval mode)
        parts = self._sft_slices(micro)
        loss = None
        for i, part in enumerate(parts):
            # every slice but the last accumulates locally, as a micro-step inside gradient accumulation does
            sync = contextlib.nullcontext() if i == len(parts) - 1 else self.accelerator.no_sync(model)
            self._slice = part
            with sync:
                got = super().training_step(model, part, num_items_in_batch)
            loss = got if loss is None else loss + got
        if not torch.isfinite(loss).all():
            self.steps.bad_loss = True
        return loss

    def _sft_slices(self, micro: dict[str, Any]) -> list[dict[str, Any]]:
        """An off-policy micro-batch in slices of at most ``sft_micro_batch_size`` solutions (the last may be
        shorter); each slice's loss is normalised by the step's global solution-token count (``_sft_loss``), so
        their gradients sum to the micro-batch's. Anything else is one part."""
        k = self.args.sft_micro_batch_size
        if not k or "off_policy" not in micro or micro["sft_completion_ids"].size(0) <= k:
            return [micro]
        n = micro["sft_completion_ids"].size(0)
        return [{key: v[s : s + k] if torch.is_tensor(v) and v.dim() > 0 and v.size(0) == n else v
                 for key, v in micro.items()} for s in range(0, n, k)]

    def _finish_step(self) -> None:
        """At ``on_step_end``: the step's metrics (``StepLog.finish``, the off-policy term's), then its rollouts."""
        m = self._metrics["train"]
        tot, step_s = self.steps.finish(m, off_policy=self.offpolicy.off_policy, kl_mode=self.args.kl_mode,
                                        rollout_is=self.rollouts.is_weights)
        for k, v in self.offpolicy.finish_step(step_s, tot["sft_loss"], tot["sft_tokens"]).items():
            m[k].append(v)
        self._flush_rollouts()

    def _flush_rollouts(self) -> None:
        pend = self._pending_rollouts
        if pend is None or any(math.isnan(r["seq_kl"]) for r in pend["rows"]):
            return  # not all micro-batches of this generation batch have been through the loss yet
        self._pending_rollouts = None
        from accelerate.utils import gather_object

        from data_tools.runio import write_parquet

        rows = gather_object(pend["rows"]) if self.accelerator.num_processes > 1 else pend["rows"]
        if self.accelerator.is_main_process:
            write_parquet(rows, self.args.rollouts_dir / f"step-{pend['step']:06d}.parquet", schema=ROLLOUT_SCHEMA)


__all__ = ["OPDTrainer", "NonFiniteError", "CLOCK_STATE"]
