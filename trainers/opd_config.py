"""``OPDConfig``: the configuration of ``OPDTrainer`` and ``python -m stages.train`` (fields, help, checks).

Extends TRL 1.16's ``DistillationConfig``; every field has help text (``python -m stages.train --help``)
and is checked in ``_validate``.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from data_tools.clock import DEFAULT_MAX_WALL_S, DEFAULT_RESERVE_S
from trainers.heads import HEAD_KERNELS, liger_unavailable
from trainers.sampler import MODES as CURRICULUM_MODES
from trainers.trl_compat import DistillationConfig

log = logging.getLogger(__name__)


def cpu_bf16_native() -> bool:
    """Whether this CPU computes bf16 matmuls natively (AVX512-BF16 or AMX, as oneDNN reports). Without, CPU bf16
    autocast emulates them: a 2,048 x 256 x 1,024 linear layer took 8.6x its fp32 time on an AVX2-only EPYC."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without the probe: assume native, as before
        return True

#: ``max_steps`` given to transformers: the wall clock ends a formal run, never a step count (a user's max_steps becomes
#: the trainer's own step cap, debug_max_steps; docs/design.md section 6).
UNBOUNDED_STEPS = 10**9
KL_MODES = ("sampled", "full")
TEACHER_CONTEXTS = ("teacher", "privileged")
#: What a completion that hit max_completion_length (no EOS) gets: reward 0, or also no place in the loss.
TRUNCATION_MODES = ("zero_reward", "mask")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Step-count schedules decay over ``max_steps``, which is unbounded here; only these are meaningful.
SCHEDULES = ("constant", "constant_with_warmup")
#: Schedules over the wall clock (trainers.schedules), by lr_scheduler_type: the shape after warmup.
TIME_SCHEDULES = {"linear_time": "linear", "cosine_time": "cosine"}


@dataclass
class OPDConfig(DistillationConfig):
    r"""Configuration of ``OPDTrainer`` and ``python -m stages.train``.

    Extends TRL's ``DistillationConfig`` (all its fields and TrainingArguments' remain available).
    ``per_device_train_batch_size`` counts *completions*; one optimizer step trains on
    per_device_train_batch_size x world_size x gradient_accumulation_steps completions, i.e. that
    divided by ``num_generations`` prompts. Fields marked *contract* are also set by the run
    contract's environment variables (``data_tools.config.ENV_CONTRACT``), which win over the YAML.
    """

    # ---- run contract ----
    student_model: str | None = field(default=None, metadata={
        "help": "Contract STUDENT_MODEL: local HF directory of the student; empty = the embedded SmolLM2-135M-Instruct."})
    teacher_model: str | None = field(default=None, metadata={
        "help": "Contract TEACHER_MODEL: local HF directory of a separate teacher sharing the student's tokenizer; "
                "empty = a frozen copy of the initial student (self-teacher)."})
    curriculum_path: str | None = field(default=None, metadata={
        "help": "Stage one's curriculum parquet; default <output_dir>/curate/curriculum.parquet. (TRAIN_DATA names the "
                "raw problems that stage one reads, so it does not set this.)"})
    max_wall_time_seconds: float = field(default=DEFAULT_MAX_WALL_S, metadata={
        "help": "Contract MAX_WALL_TIME_SECONDS: wall-clock budget of the whole process, counted from its start."})
    deadline_reserve_seconds: float = field(default=DEFAULT_RESERVE_S, metadata={
        "help": "Contract DEADLINE_RESERVE_SECONDS: kept free at the end for the final checkpoint; training stops "
                "at max_wall_time_seconds - deadline_reserve_seconds."})
    ckpt_dir: str | None = field(default=None, metadata={
        "help": "Contract CKPT_DIR: where checkpoint-<step>/ HF exports go; default <output_dir>/checkpoints."})
    experiment_name: str | None = field(default=None, metadata={
        "help": "Contract EXPERIMENT_NAME: names the default output dir and is recorded with the metrics."})

    # ---- models ----
    model_dtype: str = field(default="float32", metadata={
        "help": "dtype the student (trained weights) is loaded in: float32 | bfloat16 | float16. Mixed precision "
                "is TrainingArguments' bf16 flag on top of float32 weights."})
    teacher_dtype: str | None = field(default=None, metadata={
        "help": "dtype of the teacher (frozen); empty = model_dtype."})
    export_dtype: str = field(default="auto", metadata={
        "help": "dtype of the HF exports in ckpt_dir: auto (= model_dtype) | float32 | bfloat16 | float16."})

    # ---- objective ----
    kl_mode: str = field(default="sampled", metadata={
        "help": "sampled: sampled-token reverse KL as a per-token advantage (policy-gradient form); "
                "full: full-vocabulary reverse KL via TRL's chunked kernel (or top-k, see full_topk)."})
    full_topk: int = field(default=0, metadata={
        "help": "full mode only: >0 restricts the reverse KL to the student's top-k tokens (renormalised); 0 = exact."})
    head_kernel: str = field(default="trl", metadata={
        "help": "Kernels of the output-head terms (trainers.heads): trl = TRL's chunked log-prob / divergence kernels; "
                "liger = Liger-Kernel 0.8.5's fused linear cross-entropy (sampled-token log-probs, temperature 1 only) "
                "and fused linear JSD at beta 1 (full reverse KL), TRL's kernels wherever Liger's maths would differ. "
                "liger needs CUDA and liger_kernel."})
    w_kl: float = field(default=1.0, metadata={"help": "Weight of the reverse-KL term (0 = reward-only training)."})
    w_reward: float = field(default=1.0, metadata={"help": "Weight of the verifier-reward term (0 = pure distillation)."})
    num_generations: int = field(default=4, metadata={"help": "G: samples per prompt; the reward baseline is the group mean."})
    scale_advantages_by_std: bool = field(default=True, metadata={
        "help": "Divide group-centred rewards by the group std (GRPO); False = r - mean only (Dr. GRPO)."})
    advantage_eps: float = field(default=1e-4, metadata={"help": "Added to the group std before dividing."})
    teacher_logprob_min: float | None = field(default=None, metadata={
        "help": "sampled mode: clamp teacher log-probs from below (verl uses -10); empty = no clamp."})
    k1_clamp: float | None = field(default=10.0, metadata={
        "help": "sampled mode: clamp k1 = log pi_student - log pi_teacher to [-k1_clamp, k1_clamp] after the teacher "
                "floor (verl clamps its KL estimates to +-10); empty = no clamp. kl/sampled_mean stays unclamped."})
    vllm_importance_sampling_correction: bool = field(default=True, metadata={
        "help": "vLLM generation (and async_generation): weight each token's loss by the truncated importance ratio "
                "min(pi_trainer / pi_rollout, vllm_importance_sampling_cap) of the sampled token (TRL GRPO's "
                "token_truncate, verl's rollout IS), correcting for the engines' log-prob mismatch and, under "
                "async_generation, the one-step policy lag (logged as sampling/*)."})
    vllm_importance_sampling_cap: float = field(default=2.0, metadata={
        "help": "Upper bound C on the rollout importance ratio (verl's rollout_is_threshold default and the "
                "truncated-IS paper's C = 2; TRL's clip_max default is 3)."})
    vllm_probe_tolerance: float = field(default=0.1, metadata={
        "help": "use_vllm with vllm_mode colocate: the largest mean absolute difference (nats per token, "
                "sampling/sampling_logp_difference/mean) between vLLM's and the trainer's log-probs of 32 tokens "
                "sampled for 2 prompts at start-up (trainers.guards.probe_vllm); above it, or if vLLM fails, the run "
                "says so and uses the fast decoder. 0 = no probe. Range >= 0."})
    num_iterations: int = field(default=1, metadata={
        "help": "Optimizer passes over each generated batch; >1 turns on the PPO ratio and clipping."})
    steps_per_generation: int = field(default=1, metadata={
        "help": "Optimizer steps per rollout batch (TRL GRPO's steps_per_generation, verl's ppo_mini_batch_size): one "
                "generation call decodes per_device_train_batch_size x gradient_accumulation_steps x this many "
                "completions (x processes), split into this many mini-batches of one optimizer step each, every "
                "one normalised by its own completion tokens. >1: the student's log-probs before the first update "
                "(pi_old) are computed once per rollout batch and later mini-batches are PPO-clipped against them "
                "(sampled mode). Range >= 1."})
    epsilon_low: float = field(default=0.2, metadata={"help": "PPO clip: lower bound 1 - epsilon_low on the ratio."})
    epsilon_high: float = field(default=0.28, metadata={"help": "PPO clip: upper bound 1 + epsilon_high on the ratio."})
    truncated_completions: str = field(default="zero_reward", metadata={
        "help": "A completion that hit max_completion_length without EOS: zero_reward = reward 0 whatever an "
                "earlier \\boxed{} says (it may have been retracted), still in the loss (its KL term trains); mask = "
                "reward 0 and dropped from the loss (TRL's mask_truncated_completions, DAPO)."})
    teacher_context: str = field(default="privileged", metadata={
        "help": "teacher: the teacher reads the student's prompt; privileged: it reads the problem plus the "
                "curriculum's reference solution / answer (data_tools.prompts.privileged_messages)."})

    # ---- off-policy term: stage one's verified teacher solutions (trainers.offpolicy) ----
    w_sft: float = field(default=0.0, metadata={
        "help": "Weight of the cross-entropy on the curriculum's teacher_solution of each prompt in an on-policy step "
                "(per token over the step's solution tokens; 0 = off). Rows without a verified solution add nothing."})
    sft_share_start: float = field(default=0.0, metadata={
        "help": "Share of training seconds spent in off-policy steps (cross-entropy on teacher solutions only: no "
                "generation, no teacher) at the start of the training window, in [0, 1]. An off-policy step draws "
                "its solutions from its own shuffled pool; the curriculum's prompts drawn for that step are skipped."})
    sft_share_end: float = field(default=0.0, metadata={
        "help": "The same share at the end of the window; linear in time_fraction() in between."})
    sft_batch_size: int = field(default=64, metadata={
        "help": "Teacher solutions per off-policy optimizer step (all processes; a multiple of world size x "
                "gradient_accumulation_steps)."})
    sft_micro_batch_size: int = field(default=0, metadata={
        "help": "> 0: at most this many teacher solutions per forward in an off-policy step: each of its "
                "gradient_accumulation_steps micro-batches runs in slices of this size, gradients summed; the step "
                "is the same (its solutions, its one update, its loss), only its memory lower. For recipes whose "
                "on-policy updates are small (steps_per_generation with gradient_accumulation_steps 1) while an SFT "
                "step is sft_batch_size long solutions. 0 = a micro-batch in one forward."})
    sft_learning_rate: float = field(default=0.0, metadata={
        "help": "> 0: the learning rate of off-policy steps, on learning_rate's schedule (warm-up, decay): each such "
                "step runs at the scheduled rate x sft_learning_rate / learning_rate; on-policy steps keep "
                "learning_rate. 0 = learning_rate for both. On-policy recipes run at ~1e-6; SFT of a 1.5B model "
                "usually at 1e-5 to 5e-5."})
    sft_max_epochs: float = field(default=0.0, metadata={
        "help": "> 0: at most this many passes of the off-policy steps over the verified teacher solutions, then every "
                "step is on-policy (with the w_sft term if set); a step that would pass the cap is on-policy, and the "
                "count survives a resume. 0 = no cap."})
    sft_handover_reset: int = field(default=0, metadata={
        "help": "> 0 (with sft_max_epochs): at the hand-over to on-policy steps, clear the optimizer's moments and "
                "warm the rate up again linearly over this many steps, as a separate on-policy run after SFT would "
                "start. 0 = carry them: Adam's second moments then come from SFT's smaller gradients, so the first "
                "on-policy steps move the weights further than the rate says."})

    # ---- data ----
    prompt_style: str | None = field(default=None, metadata={
        "help": "Prompt instruction (data_tools.prompts.STYLES); empty = the curriculum's prompt_style column "
                "(so training matches curation), else 'reasoning'."})
    curriculum: str = field(default="ordered", metadata={
        "help": "ordered: easy-to-hard buckets each epoch; shuffled: random order; mixed: ordered with a share "
                "curriculum_mix of rows drawn from the whole set."})
    curriculum_mix: float = field(default=0.0, metadata={"help": "mixed curriculum: share of replayed random rows, in [0, 1]."})
    curriculum_shuffle_within_bucket: bool = field(default=True, metadata={
        "help": "ordered/mixed: shuffle rows inside a bucket (seeded per epoch) rather than strict curriculum_index order."})
    grader_timeout_s: float = field(default=5.0, metadata={"help": "Per-answer grading deadline (seconds)."})
    answer_filter: str = field(default="math", metadata={
        "help": "Reward's answer filter (data_tools.grader): math = equal as mathematics; numeric = a plain-number "
                "gold needs a plain-number answer (arithmetic tasks: stops rewarding a restated '41 * 74')."})
    grader_profile: str = field(default="default", metadata={
        "help": "Reward's grader profile (data_tools.grader.PROFILES): default = the grader's pipeline with answer_filter; "
                "formal = the formal metric's rule (the last \\boxed{} only, an integer gold needs the integer itself)."})
    grader_workers: int | None = field(default=None, metadata={"help": "Grader worker processes; empty = grader default."})

    # ---- checkpoints, logging, safety ----
    ckpt_every_steps: int = field(default=0, metadata={"help": "Export a checkpoint every N optimizer steps (0 = off)."})
    ckpt_every_minutes: float = field(default=30.0, metadata={"help": "Export a checkpoint every M minutes (0 = off)."})
    ckpt_keep: int = field(default=3, metadata={"help": "Exports kept in ckpt_dir (highest steps)."})
    ckpt_hedge_fractions: list[float] = field(default_factory=lambda: [0.8, 0.9], metadata={
        "help": "Shares of the training window (its start to the horizon) at which to export once each; from the first "
                "on, the ckpt_every_* cadence stops, so the ckpt_keep exports kept are these plus the final one, spread "
                "over the end of the window (the orchestrator scores the highest three). [] = cadence to the end."})
    resume: bool = field(default=True, metadata={
        "help": "Resume from the newest complete state in <output_dir>/resume if there is one."})
    save_rollouts: bool = field(default=True, metadata={"help": "Write every rollout to <output_dir>/rollouts/step-*.parquet."})
    max_consecutive_nonfinite: int = field(default=5, metadata={
        "help": "Non-finite loss/gradient steps are skipped; this many in a row stop the run with an error."})
    fast_generation: bool | None = field(default=None, metadata={
        "help": "HF-generate path (no vLLM): decode all samples in one call with a static KV cache and a CUDA-graph "
                "decode step (data_tools.generation.fast_decoder). Empty = on with CUDA and no vLLM, and wherever use_vllm asked for "
                "a vLLM that cannot run here (CPU included). Under FSDP2 the weights are gathered once a call; FSDP1 "
                "and ZeRO-3 keep TRL's HF generate."})
    async_generation: bool = field(default=False, metadata={
        "help": "One-step off-policy generation (trainers.async_rollouts): a background thread decodes step k+1's "
                "batch on a snapshot of the weights from the end of step k-1 while step k updates; each token is "
                "weighted by the truncated importance ratio (vllm_importance_sampling_*). Costs a copy of the weights "
                "and the decode cache. One process, fast_generation, no vLLM, num_iterations = 1, no off-policy steps. "
                "Logged as async/*, sampling/*."})
    decode_compaction: bool = field(default=True, metadata={
        "help": "fast_generation only: the decoder stops paying for finished rows and unwritten cache positions "
                "(data_tools.generation.kv_cache): decode attention reads the written length rounded up to a bucket, and the live "
                "rows move into the smallest halving of the batch that holds them; one CUDA graph per (batch, length) "
                "bucket met. Same greedy tokens as off."})
    decode_compile: bool = field(default=False, metadata={
        "help": "fast_generation on CUDA only (off on CPU, with a warning): the decode step's decoder layers run "
                "through torch.compile (dynamic=False, one compile per batch bucket; attention over the cache stays "
                "eager) inside the captured CUDA graph. Faster decoding for tens of seconds of compiling once per "
                "process: on in the formal recipe, off by default and in the demos."})
    matmul_precision: str = field(default="", metadata={
        "help": "torch.set_float32_matmul_precision for the matmuls left in fp32 under bf16 autocast (the student's "
                "output head): 'high' runs them on TF32 tensor cores, 'highest' in full fp32; empty leaves torch's "
                "setting. Applied on a CUDA device once the trainer is built, after vLLM colocate's engine (which sets "
                "its own, 'highest'). Not transformers' tf32 flag: that one uses torch's newer precision API, after "
                "which torch.get_float32_matmul_precision (read by inductor) raises."})
    decode_dtype: str = field(default="auto", metadata={
        "help": "fast_generation only: the dtype the decoder's weights are in. 'auto': bfloat16 when the student's "
                "weights are float32 and bf16 autocast is on (the formal recipe: decoding reads half the bytes a "
                "token, as vLLM's bf16 copy does), else the student's own weights. Another dtype than the "
                "student's: a copy of its weights in that dtype, refreshed before every generation (one more copy of "
                "the student in memory: ~3.6 GB for R1-Distill-1.5B in bf16). Not under FSDP2, whose gathered weights are already "
                "in the mixed-precision dtype. One of 'auto', 'float32', 'bfloat16', 'float16'."})
    decode_kv_growth: bool = field(default=True, metadata={
        "help": "fast_generation with decode_compaction only (ignored without it): the KV cache holds only the current "
                "window, not the whole batch at full length: its length grows with the attention bucket and its rows "
                "shrink at each compaction, so the cache peaks at the largest window (rows x length bucket x KV bytes "
                "per token). Same tokens as off."})
    compile_layers: bool | None = field(default=None, metadata={
        "help": "torch.compile the student's and teacher's decoder layers (regional compile; the student compiled "
                "only when gradients are on). Empty = on when CUDA is available, off under FSDP / DeepSpeed."})
    split_batch_over_processes: bool = field(default=True, metadata={
        "help": "Under a launcher, keep the recipe's step: per_device_train_batch_size x gradient_accumulation_steps "
                "as written is the completions of one optimizer step for the whole run, split over the P processes "
                "(data_tools.layout.split_batch; a batch that does not divide is an error naming the numbers). False = "
                "TRL's per-device meaning (a step trains on P times the completions)."})
    debug_max_steps: int = field(default=0, metadata={
        "help": "Tests/debugging only: stop (with a final checkpoint) after this many optimizer steps; 0 = never. "
                "Formal runs are bounded by the wall clock alone."})

    # ---- TrainingArguments / DistillationConfig defaults changed for this project ----
    learning_rate: float = field(default=1e-6, metadata={"help": "Peak learning rate (AdamW)."})
    lr_scheduler_type: str = field(default="constant", metadata={
        "help": "linear_time | cosine_time: decay over the fraction of the training window used (trainers.schedules; "
                "warmup lr_warmup_time, floor lr_final_ratio). constant | constant_with_warmup (warmup_steps). "
                "Step-count decays are refused: the horizon is time, the step count unknown."})
    lr_warmup_time: float = field(default=0.0, metadata={
        "help": "linear_time / cosine_time: linear warmup from 0; < 1 = a share of the training window, >= 1 = seconds."})
    lr_final_ratio: float = field(default=0.0, metadata={
        "help": "linear_time / cosine_time: learning rate at the horizon as a share of the peak, in [0, 1]."})
    logging_steps: float = field(default=1, metadata={"help": "Log (and write a metrics line) every N steps."})
    save_strategy: str = field(default="no", metadata={
        "help": "Leave 'no': saving is driven by ckpt_every_steps / ckpt_every_minutes and the deadline."})
    save_total_limit: int | None = field(default=1, metadata={"help": "Resume states kept in <output_dir>/resume."})
    bf16: bool | None = field(default=False, metadata={
        "help": "bf16 autocast. Off by default: docs/design.md section 8 saw bf16 autocast break SmolLM2 GRPO on GPU. On "
                "a CPU without native bf16 (AVX512-BF16 / AMX) it is turned off with a warning: emulated, it runs "
                "several times slower than fp32."})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "Activation checkpointing (on for long completions)."})
    disable_dropout: bool = field(default=True, metadata={"help": "Dropout off: log-probs must be deterministic for k1 and the PPO ratio."})
    disable_tqdm: bool | None = field(default=True, metadata={
        "help": "No progress bar: its total would be the unbounded max_steps; metrics/train.jsonl has the progress."})
    num_train_epochs: float = field(default=0.0, metadata={
        "help": "Not a stopping rule here (refused if set): training cycles over the curriculum until the wall clock "
                "or max_steps ends it; sft_max_epochs caps the SFT passes."})
    max_steps: int = field(default=UNBOUNDED_STEPS, metadata={
        "help": "Stop after this many optimizer steps (-1 = no cap), with a final export; the wall clock still ends "
                "training if it comes first. The same cap as debug_max_steps."})

    def __post_init__(self):
        from data_tools.runio import default_output_dir

        if not self.output_dir:
            self.output_dir = str(default_output_dir(self.experiment_name))
        self.output_dir = str(Path(self.output_dir).expanduser())
        if not self.ckpt_dir:
            from data_tools.runio import default_ckpt_dir  # the formal layout's /out/checkpoints, else <output_dir>/checkpoints

            self.ckpt_dir = str(default_ckpt_dir(self.output_dir))
        if not self.curriculum_path:
            self.curriculum_path = str(Path(self.output_dir) / "curate" / "curriculum.parquet")
        import torch

        if not torch.cuda.is_available():
            self.dataloader_pin_memory = False  # nothing to pin for; torch warns at every epoch otherwise
        # Under a launcher (accelerate / torchrun set WORLD_SIZE) a step keeps the recipe's batch: see
        # split_batch_over_processes. The recipe's own numbers stay readable as ``recipe_batch``.
        self.processes = int(os.environ.get("WORLD_SIZE") or 1)
        self.recipe_batch = (self.per_device_train_batch_size, self.gradient_accumulation_steps)
        if self.processes > 1 and self.split_batch_over_processes:
            from data_tools.layout import split_batch

            self.per_device_train_batch_size, self.gradient_accumulation_steps = split_batch(
                *self.recipe_batch, self.processes, num_generations=self.num_generations,
                sft_batch_size=self.sft_batch_size if self.trains_on_teacher_solutions else None)
        if not torch.cuda.is_available():
            # a CPU machine: several processes then use gloo DDP (without it transformers trains each one alone),
            # and a GPU recipe's bf16 runs as CPU autocast (transformers refuses bf16 without a GPU otherwise)
            self.use_cpu = True
        if self.use_cpu and self.bf16 and not cpu_bf16_native():
            # emulated bf16 is slower than fp32 and less exact: the recipe's fp32 weights then compute in fp32
            log.warning("bf16: this CPU has no native bf16 (AVX512-BF16 / AMX), where bf16 autocast runs several "
                        "times slower than fp32: training computes in fp32")
            self.bf16 = False
        if self.ddp_find_unused_parameters is None:
            # every parameter of a causal LM gets a gradient each step; True costs a graph walk a step (and is
            # refused with gradient checkpointing's re-entrant backward)
            self.ddp_find_unused_parameters = False
        for name in ("student_model", "teacher_model", "teacher_dtype", "prompt_style", "teacher_logprob_min",
                     "k1_clamp"):
            if getattr(self, name) in ("", "none", "None", "null"):
                setattr(self, name, None)
        if self.num_train_epochs:
            raise ValueError(f"num_train_epochs {self.num_train_epochs:g} would not stop training: it cycles over the "
                             "curriculum until the wall clock ends it (max_wall_time_seconds); cap the steps with "
                             "max_steps, the SFT passes with sft_max_epochs")
        self.num_train_epochs = 3.0  # transformers' default, unused beside a max_steps
        if self.max_steps == 0 or self.max_steps < -1:  # transformers reads these as "use the epochs": never here
            raise ValueError(f"max_steps must be a cap of >= 1 optimizer steps, or -1 for none; got {self.max_steps}")
        if 0 < self.max_steps != UNBOUNDED_STEPS:
            # a TRL user stops a run with max_steps: it caps the optimizer steps as debug_max_steps does, while
            # transformers keeps an unbounded count (its step-count schedules and progress would read it as the horizon)
            if self.debug_max_steps and self.debug_max_steps != self.max_steps:
                raise ValueError(f"max_steps {self.max_steps} and debug_max_steps {self.debug_max_steps} disagree: both cap "
                                 "the optimizer steps, set one")
            log.info("max_steps=%d: training stops after step %d (as debug_max_steps) or at the wall clock, whichever "
                     "comes first", self.max_steps, self.max_steps)
            self.debug_max_steps = self.max_steps
        self.max_steps = UNBOUNDED_STEPS
        # TrainingArguments only knows transformers' scheduler names: validate as constant, then keep ours.
        sched = getattr(self.lr_scheduler_type, "value", self.lr_scheduler_type)
        if sched in TIME_SCHEDULES:
            self.lr_scheduler_type = "constant"
        # ACCELERATE_MIXED_PRECISION is process-wide: transformers 4.57 exports it for bf16 / fp16 and never clears it,
        # 5.x reads it as the default of mixed_precision. A later config of the same process without bf16
        # (bench/learning's arms, tests) then got the earlier one's autocast: this config's own value, before and after
        mp = "bf16" if self.bf16 else "fp16" if self.fp16 else "no"
        os.environ["ACCELERATE_MIXED_PRECISION"] = mp
        super().__post_init__()
        os.environ["ACCELERATE_MIXED_PRECISION"] = mp
        if sched in TIME_SCHEDULES:
            self.lr_scheduler_type = sched
        self._validate()

    def _validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        need(self.kl_mode in KL_MODES, f"kl_mode must be one of {KL_MODES}, got {self.kl_mode!r}")
        need(self.matmul_precision in ("", "highest", "high", "medium"),
             f"matmul_precision must be '', 'highest', 'high' or 'medium', got {self.matmul_precision!r}")
        need(self.decode_dtype == "auto" or self.decode_dtype in DTYPES,
             f"decode_dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.decode_dtype!r}")
        need(self.teacher_context in TEACHER_CONTEXTS,
             f"teacher_context must be one of {TEACHER_CONTEXTS}, got {self.teacher_context!r}")
        need(self.truncated_completions in TRUNCATION_MODES,
             f"truncated_completions must be one of {TRUNCATION_MODES}, got {self.truncated_completions!r}")
        need(self.curriculum in CURRICULUM_MODES, f"curriculum must be one of {CURRICULUM_MODES}, got {self.curriculum!r}")
        need(0.0 <= self.curriculum_mix <= 1.0, f"curriculum_mix must be in [0, 1], got {self.curriculum_mix}")
        need(self.num_generations >= 1, f"num_generations must be >= 1, got {self.num_generations}")
        need(self.num_iterations >= 1, f"num_iterations must be >= 1, got {self.num_iterations}")
        need(self.steps_per_generation >= 1, f"steps_per_generation must be >= 1, got {self.steps_per_generation}")
        need(self.w_kl >= 0 and self.w_reward >= 0, "w_kl and w_reward must be >= 0")
        need(self.w_kl > 0 or self.w_reward > 0 or self.trains_on_teacher_solutions,
             "w_kl, w_reward, w_sft and the sft shares are all 0: nothing to train")
        need(self.w_sft >= 0 and 0 <= self.sft_share_start <= 1 and 0 <= self.sft_share_end <= 1,
             "need w_sft >= 0 and sft_share_start, sft_share_end in [0, 1]")
        need(self.sft_batch_size >= 1 and self.sft_batch_size % self.gradient_accumulation_steps == 0,
             f"sft_batch_size ({self.sft_batch_size}) must be a positive multiple of gradient_accumulation_steps "
             f"({self.gradient_accumulation_steps}): e.g. "
             f"{max(1, self.sft_batch_size // self.gradient_accumulation_steps) * self.gradient_accumulation_steps}")
        need(self.sft_micro_batch_size >= 0, f"sft_micro_batch_size must be >= 0, got {self.sft_micro_batch_size}")
        need(self.sft_max_epochs >= 0, f"sft_max_epochs must be >= 0, got {self.sft_max_epochs}")
        need(math.isfinite(self.sft_learning_rate) and self.sft_learning_rate >= 0,
             f"sft_learning_rate must be a finite number >= 0, got {self.sft_learning_rate}")
        need(not self.sft_learning_rate or self.learning_rate > 0,
             "sft_learning_rate scales the scheduled rate by sft_learning_rate / learning_rate: it needs learning_rate > 0")
        if self.sft_share_start == 0 and self.sft_share_end == 0:  # one error naming every setting to change
            what = {"sft_learning_rate": "sets the rate of off-policy steps", "sft_max_epochs": "caps the off-policy steps"}
            only_sft = [k for k in what if getattr(self, k)]
            need(not only_sft,
                 "off-policy SFT steps are off (sft_share_start = sft_share_end = 0), but "
                 + "; ".join(f"{k} {getattr(self, k):g} {what[k]}" for k in only_sft)
                 + ": to turn SFT off set " + " ".join(f"--{k} 0" for k in only_sft)
                 + " as well; to keep it, set sft_share_start or sft_share_end > 0")
        need(self.sft_handover_reset >= 0 and (not self.sft_handover_reset or self.sft_max_epochs > 0),
             f"sft_handover_reset ({self.sft_handover_reset}) acts at the hand-over that sft_max_epochs > 0 makes: "
             f"it must be >= 0, and > 0 only with sft_max_epochs > 0")
        need(not self.sft_max_epochs or self.w_kl > 0 or self.w_reward > 0,
             "sft_max_epochs > 0 hands the steps after the cap to on-policy training, which needs w_kl > 0 or "
             "w_reward > 0; for SFT-only runs (w_kl = w_reward = 0) leave sft_max_epochs at 0 and let the clock end "
             "the run")
        need(self.full_topk >= 0, f"full_topk must be >= 0, got {self.full_topk}")
        need(self.head_kernel in HEAD_KERNELS, f"head_kernel must be one of {HEAD_KERNELS}, got {self.head_kernel!r}")
        why = liger_unavailable() if self.head_kernel == "liger" else None
        need(why is None, f"head_kernel=liger cannot run here: {why}; use head_kernel=trl")
        need(0.0 <= self.epsilon_low < 1.0 and self.epsilon_high >= 0.0, "need 0 <= epsilon_low < 1 and epsilon_high >= 0")
        need(self.advantage_eps > 0, "advantage_eps must be > 0")
        need(self.teacher_logprob_min is None or self.teacher_logprob_min < 0,
             "teacher_logprob_min must be negative (a log-probability floor) or empty")
        need(self.k1_clamp is None or self.k1_clamp > 0, "k1_clamp must be > 0 or empty")
        need(self.vllm_importance_sampling_cap > 0, "vllm_importance_sampling_cap must be > 0")
        need(self.vllm_probe_tolerance >= 0, f"vllm_probe_tolerance must be >= 0, got {self.vllm_probe_tolerance}")
        need(self.max_wall_time_seconds > 0, "max_wall_time_seconds must be > 0")
        need(0 <= self.deadline_reserve_seconds < self.max_wall_time_seconds,
             f"deadline_reserve_seconds ({self.deadline_reserve_seconds}) must be in [0, max_wall_time_seconds "
             f"({self.max_wall_time_seconds}))")
        need(self.ckpt_every_steps >= 0 and self.ckpt_every_minutes >= 0, "checkpoint cadences must be >= 0")
        need(self.ckpt_keep >= 1, "ckpt_keep must be >= 1")
        hedges = list(self.ckpt_hedge_fractions or [])
        need(all(0.0 < h < 1.0 for h in hedges) and hedges == sorted(set(hedges)),
             f"ckpt_hedge_fractions must be increasing shares in (0, 1), got {hedges}")
        need(len(hedges) < self.ckpt_keep, f"ckpt_keep ({self.ckpt_keep}) must exceed the {len(hedges)} "
                                           "ckpt_hedge_fractions, else rotation deletes the hedge exports")
        need(self.max_consecutive_nonfinite >= 1, "max_consecutive_nonfinite must be >= 1")
        need(self.debug_max_steps >= 0, "debug_max_steps must be >= 0")
        need(self.grader_timeout_s > 0, "grader_timeout_s must be > 0")
        from data_tools.grader import ANSWER_FILTERS, PROFILES

        need(self.answer_filter in ANSWER_FILTERS, f"answer_filter must be one of {ANSWER_FILTERS}, got {self.answer_filter!r}")
        need(self.grader_profile in PROFILES, f"grader_profile must be one of {PROFILES}, got {self.grader_profile!r}")
        need(self.grader_profile != "formal" or self.answer_filter == "math", f"answer_filter {self.answer_filter!r} does "
             "not apply under grader_profile formal (the metric's own rule decides): leave answer_filter at math")
        need(self.model_dtype in DTYPES, f"model_dtype must be one of {list(DTYPES)}")
        need(self.teacher_dtype is None or self.teacher_dtype in DTYPES, f"teacher_dtype must be one of {list(DTYPES)}")
        need(self.export_dtype == "auto" or self.export_dtype in DTYPES, f"export_dtype must be auto or one of {list(DTYPES)}")
        sched = getattr(self.lr_scheduler_type, "value", self.lr_scheduler_type)
        need(sched in SCHEDULES or sched in TIME_SCHEDULES,
             f"lr_scheduler_type must be one of {(*TIME_SCHEDULES, *SCHEDULES)} (the horizon is wall-clock time, "
             f"not a step count), got {sched!r}")
        need(0 <= self.lr_warmup_time and self.lr_warmup_fraction < 1,
             f"lr_warmup_time ({self.lr_warmup_time}) must be a share in [0, 1) or seconds shorter than the training "
             f"window ({self.horizon_seconds:.0f} s)")
        need(0.0 <= self.lr_final_ratio <= 1.0, f"lr_final_ratio must be in [0, 1], got {self.lr_final_ratio}")
        need(self.save_strategy in ("no", getattr(type(self.save_strategy), "NO", "no")),
             "save_strategy must stay 'no': use ckpt_every_steps / ckpt_every_minutes")
        gen = self.per_device_train_batch_size * self.gradient_accumulation_steps * self.steps_per_generation
        need(self.per_device_train_batch_size >= 1, "per_device_train_batch_size must be >= 1")
        need(gen % self.num_generations == 0,
             f"per_device_train_batch_size x gradient_accumulation_steps x steps_per_generation ({gen}) must be a "
             f"multiple of num_generations ({self.num_generations}) so each prompt's group fits in a rollout batch")
        if self.async_generation:
            why = ("use_vllm (the async decode runs the fast decoder on a weight snapshot)" if self.use_vllm
                   else "fast_generation=False (it decodes with the fast path)" if self.fast_generation is False
                   else "num_iterations > 1 (a reused batch already carries its PPO pi_old)" if self.num_iterations > 1
                   else "steps_per_generation > 1 (its mini-batches already carry their PPO pi_old)"
                   if self.steps_per_generation > 1
                   else "sft_share_start / sft_share_end > 0 (off-policy steps would leave a prefetch waiting)"
                   if self.sft_share_start > 0 or self.sft_share_end > 0
                   else f"{self.world_size} processes (one background decode on one device)" if self.world_size > 1
                   else None)
            need(why is None, f"async_generation does not support {why}; set async_generation=False")
        if self.prompt_style is not None:
            from data_tools.prompts import STYLES

            need(self.prompt_style in STYLES, f"prompt_style must be one of {sorted(STYLES)} or empty")

    @property
    def resume_dir(self) -> Path:
        """Trainer state for resuming (weights + optimizer + scheduler + RNG + trainer_state.json)."""
        return Path(self.output_dir) / "resume"

    @property
    def export_owner(self) -> str:
        """What this run's exports name as their writer (``opd_checkpoint.json``): the id ``stages.train`` keeps in the
        run directory (``trainers.callbacks.start_owner``: new on a fresh start, the same on resume), else the run
        directory itself."""
        from trainers.callbacks import owner_file

        f = owner_file(self.output_dir)
        return (f.read_text().strip() if f.is_file() else "") or str(Path(self.output_dir).resolve())

    @property
    def metrics_path(self) -> Path:
        return Path(self.output_dir) / "metrics" / "train.jsonl"

    @property
    def rollouts_dir(self) -> Path:
        return Path(self.output_dir) / "rollouts"

    @property
    def horizon_seconds(self) -> float:
        return self.max_wall_time_seconds - self.deadline_reserve_seconds

    @property
    def trains_on_teacher_solutions(self) -> bool:
        """Any off-policy term is on (``w_sft`` or an SFT share): the curriculum's ``teacher_solution`` is read."""
        return self.w_sft > 0 or self.sft_share_start > 0 or self.sft_share_end > 0

    @property
    def needs_teacher_solutions(self) -> bool:
        """An off-policy term that has nothing to train on without verified solutions: ``w_sft``, or an SFT share
        for the whole clock. An SFT share capped at ``sft_max_epochs`` passes (SFT first, then on-policy) over no
        solution is an empty first phase: every step is on-policy."""
        return self.w_sft > 0 or (self.trains_on_teacher_solutions and not self.sft_max_epochs)

    def decode_torch_dtype(self, weights: torch.dtype) -> torch.dtype:
        """The dtype ``decode_dtype`` asks of the decoder's weights when the student's are ``weights``."""
        if self.decode_dtype != "auto":
            return DTYPES[self.decode_dtype]
        return torch.bfloat16 if weights == torch.float32 and self.bf16 else weights

    @property
    def lr_warmup_fraction(self) -> float:
        """``lr_warmup_time`` as a share of the training window (the unit of ``OPDTrainer.time_fraction``)."""
        w = self.lr_warmup_time
        return w if w < 1 else w / self.horizon_seconds
