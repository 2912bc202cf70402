"""``DistillationConfig`` for a TRL without one (0.29 - 1.9): the fields and defaults of TRL 1.16's, text-only.

``trainers.trl_compat`` imports it only where ``from trl import DistillationConfig`` fails, so ``OPDConfig`` has
the same fields, defaults and help on every supported TRL. Fields for what the text-only base cannot do
(tools, vLLM server mode) are kept so a recipe parses the same everywhere; ``OPDTrainer`` says where one is not
honoured.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments


@dataclass
class DistillationConfig(TrainingArguments):
    """TRL 1.16's ``DistillationConfig`` fields (``trl/trainer/distillation_config.py``), text-only."""

    # ---- models ----
    model_init_kwargs: dict[str, Any] | str | None = field(default=None, metadata={
        "help": "Keyword arguments for from_pretrained when the student is given as a path."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom model code from the model's directory."})
    teacher_model_name_or_path: str | None = field(default=None, metadata={"help": "Teacher path (TRL's name; OPDConfig uses teacher_model)."})
    teacher_model_revision: str | None = field(default=None, metadata={"help": "Teacher revision (unused without a hub)."})
    teacher_model_init_kwargs: dict[str, Any] | str | None = field(default=None, metadata={
        "help": "Keyword arguments for from_pretrained when the teacher is given as a path."})
    disable_dropout: bool = field(default=False, metadata={"help": "Turn dropout off in the student."})
    # ---- generation ----
    max_completion_length: int | None = field(default=512, metadata={"help": "Most tokens a completion may have."})
    ds3_gather_for_generation: bool = field(default=True, metadata={
        "help": "Gather ZeRO-3 weights for generation (unused by the text-only base, which refuses ZeRO-3 generation)."})
    shuffle_dataset: bool | None = field(default=True, metadata={"help": "Shuffle the training prompts."})
    pad_to_multiple_of: int | str | None = field(default="auto", metadata={
        "help": "Pad prompt and completion tensors to a multiple of this; 'auto' = none off Neuron."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (also divides both models' logits)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass."})
    top_k: int = field(default=0, metadata={"help": "Top-k sampling; 0 = off."})
    min_p: float | None = field(default=None, metadata={"help": "Min-p sampling; None = off."})
    generation_kwargs: dict | str | None = field(default=None, metadata={"help": "Extra GenerationConfig fields."})
    chat_template_kwargs: dict | str | None = field(default=None, metadata={"help": "Extra chat-template arguments."})
    repetition_penalty: float = field(default=1.0, metadata={"help": "Repetition penalty; 1 = off."})
    cache_implementation: str | None = field(default=None, metadata={"help": "transformers' KV-cache implementation for generate."})
    # ---- vLLM ----
    use_vllm: bool = field(default=False, metadata={"help": "Generate with vLLM (colocate)."})
    vllm_mode: str = field(default="colocate", metadata={"help": "colocate | server."})
    vllm_model_impl: str = field(default="vllm", metadata={"help": "vLLM's model implementation: vllm | transformers."})
    vllm_enable_sleep_mode: bool = field(default=False, metadata={"help": "Let vLLM release its memory between generations."})
    vllm_structured_outputs_regex: str | None = field(default=None, metadata={"help": "Constrain completions to a regex."})
    vllm_server_base_url: str | None = field(default=None, metadata={"help": "vLLM server URL (server mode)."})
    vllm_server_host: str = field(default="0.0.0.0", metadata={"help": "vLLM server host (server mode)."})
    vllm_server_port: int = field(default=8000, metadata={"help": "vLLM server port (server mode)."})
    vllm_server_timeout: float = field(default=240.0, metadata={"help": "Seconds to wait for a vLLM server."})
    vllm_group_port: int = field(default=51216, metadata={"help": "Weight-sync port (server mode)."})
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata={"help": "vLLM's share of GPU memory (colocate)."})
    vllm_max_model_length: int | None = field(default=None, metadata={"help": "vLLM's context length."})
    vllm_tensor_parallel_size: int = field(default=1, metadata={"help": "vLLM tensor parallelism (colocate)."})
    # ---- loss / logging ----
    beta: float = field(default=1.0, metadata={"help": "Generalised JSD interpolation; 1 = reverse KL."})
    max_tool_calling_iterations: int | None = field(default=None, metadata={"help": "Tool calls (unsupported here)."})
    log_completions: bool = field(default=False, metadata={"help": "Print a sample of completions at each log."})
    num_completions_to_print: int | None = field(default=None, metadata={"help": "How many completions to print."})
    log_unique_prompts: bool = field(default=False, metadata={"help": "Deduplicate prompts in completion logs."})
    # ---- TrainingArguments defaults TRL's config changes ----
    learning_rate: float = field(default=1e-6, metadata={"help": "Peak learning rate."})
    bf16: bool | None = field(default=None, metadata={"help": "bf16 mixed precision."})
    gradient_checkpointing: bool = field(default=True, metadata={"help": "Activation checkpointing."})
    logging_steps: float = field(default=10, metadata={"help": "Log every N steps."})
    remove_unused_columns: bool | None = field(default=False, metadata={
        "help": "Keep every dataset column: the trainer reads prompt and the curriculum's columns itself."})

    def __post_init__(self):
        for name in ("model_init_kwargs", "teacher_model_init_kwargs", "generation_kwargs", "chat_template_kwargs"):
            v = getattr(self, name)
            if isinstance(v, str):  # the CLI passes dicts as JSON text
                setattr(self, name, json.loads(v))
        if self.bf16 is None:  # TRL's reading of None: bf16 where the hardware has it, as fp16 is never the default
            self.bf16 = False
        super().__post_init__()
        if isinstance(self.pad_to_multiple_of, str):
            p = self.pad_to_multiple_of.lower()
            self.pad_to_multiple_of = None if p in ("auto", "none", "null") else int(p)
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta must be in [0.0, 1.0], got {self.beta}.")
