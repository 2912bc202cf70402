"""``DistillationTrainer`` for a TRL without one (0.29 - 1.9): the text-only, single-turn subset OPDTrainer uses.

TRL added ``DistillationTrainer`` in 1.10; the formal image may carry an earlier TRL (``trainers.trl_compat``).
``OPDTrainer`` overrides the loss, the data order, the batch preparation and (fast decoder, async) the generation
itself; from its base it needs only what this class does, with TRL 1.16's names and contracts:

- ``__init__``: pad token, every EOS id of the model, the teacher prepared by accelerate (evaluation mode),
  the generation config, the metric store, the generation-batch buffer;
- ``_tokenize_prompts`` / ``_generate_single_turn`` (HF ``generate``) / ``_generate``: token ids in, completion
  ids out (each cut after its first EOS), the length metrics;
- ``_generate_and_score_completions``: prompts left-padded and completions right-padded into tensors, with
  ``num_items_in_batch`` the completion tokens of every process;
- ``_prepare_inputs``: one generation every ``gradient_accumulation_steps`` micro-steps, shuffled and split;
- ``_get_last_hidden_state``: the backbone's hidden states at the positions that predict the completion;
- ``compute_loss``: ``_compute_loss`` through ``_forward_redirection`` (DDP hooks fire), the entropy metric;
- ``log``: the stored metrics averaged into transformers' log.

Not here (refused at start-up with the reason): vision-language models, tools, PEFT, vLLM (OPDTrainer generates
with its fast decoder instead: ``trainers.model_utils.vllm_usable``).
"""

from __future__ import annotations

import copy
import inspect
import math
import time
from collections import defaultdict
from typing import Any

import torch
from accelerate.utils import set_seed
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerBase, Trainer
from trl.models.utils import _ForwardRedirection
from trl.trainer.utils import RepeatSampler, disable_dropout_in_model, identity, pad, shuffle_sequence_dict, split_tensor_dict

from trainers.text_distill_config import DistillationConfig
from trainers.trl_calls import unwrap_for_generation


class DistillationTrainer(Trainer):
    """Text-only on-policy distillation base with TRL 1.16 ``DistillationTrainer``'s attributes and hooks.

    Args:
        model: the student (a ``PreTrainedModel`` or a local path).
        teacher_model: the teacher, or None when a subclass supplies it (``OPDTrainer`` does).
        args: ``DistillationConfig`` (``trainers.text_distill_config``).
        train_dataset: rows with a ``prompt`` column (rendered text or chat messages).
        processing_class: the student's tokenizer.

    Raises:
        TypeError: a processor other than a tokenizer (vision-language models are not supported here).
        ValueError: ``use_vllm`` (no vLLM path here), several GPUs in one process.
    """

    _tag_names = ["trl", "distillation"]
    _name = "Distillation"

    def __init__(self, model, teacher_model=None, args: DistillationConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, callbacks=None, optimizers=(None, None), **unsupported):
        if unsupported.get("peft_config") is not None or unsupported.get("tools"):
            raise ValueError("this TRL has no DistillationTrainer; opd's text-only base supports neither PEFT nor tools")
        args = args or DistillationConfig("distillation")
        set_seed(args.seed)
        if isinstance(model, str):
            model = AutoModelForCausalLM.from_pretrained(model, **(args.model_init_kwargs or {}))
        if isinstance(teacher_model, str):
            teacher_model = AutoModelForCausalLM.from_pretrained(teacher_model, **(args.teacher_model_init_kwargs or {}))
        if not isinstance(processing_class, PreTrainedTokenizerBase):
            raise TypeError("opd's text-only distillation base needs a tokenizer as processing_class, got "
                            f"{type(processing_class).__name__}")
        if args.use_vllm:
            raise ValueError("use_vllm: this TRL has no DistillationTrainer and opd's text-only base has no vLLM "
                             "path; generate with the fast decoder (use_vllm: false)")
        self.model_kwarg_keys = inspect.signature(model.forward).parameters.keys()
        self._tokenizer, self._is_vlm, self.tools, self.chat_template = processing_class, False, [], None
        if processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token
        model.config.pad_token_id = processing_class.pad_token_id
        model.generation_config.pad_token_id = processing_class.pad_token_id
        eos = model.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        if processing_class.eos_token_id not in eos:  # every EOS the model declares ends a completion
            eos = [processing_class.eos_token_id, *eos]
        self.eos_token_ids = eos
        self._forward_redirection = _ForwardRedirection()  # the backbone is called past DDP's forward

        super().__init__(model=model, args=args, data_collator=identity, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers)
        if args.n_gpu > 1:
            raise ValueError(f"{type(self).__name__} does not support nn.DataParallel (several GPUs visible to one "
                             "process): launch with accelerate / torchrun, or narrow CUDA_VISIBLE_DEVICES")
        if teacher_model is not None:
            self.teacher_model = self.accelerator.prepare_model(teacher_model, evaluation_mode=True)
        else:
            self.teacher_model = None
        if args.disable_dropout:
            disable_dropout_in_model(self.model)

        self.beta, self.temperature, self.top_p, self.top_k = args.beta, args.temperature, args.top_p, args.top_k
        self.min_p, self.repetition_penalty = args.min_p, args.repetition_penalty
        self.max_completion_length = args.max_completion_length
        self.chat_template_kwargs = args.chat_template_kwargs or {}
        self.pad_to_multiple_of = args.pad_to_multiple_of
        self.shuffle_dataset = args.shuffle_dataset
        self._step = 0  # micro-steps (forward + backward), within a gradient-accumulation window included
        self._buffered_inputs = None  # one generation batch, split into the window's micro-batches
        self._current_train_step_time = 0.0
        set_seed(args.seed, device_specific=True)  # each process samples different completions
        gen = {"max_new_tokens": self.max_completion_length, "do_sample": True,
               "pad_token_id": processing_class.pad_token_id, "bos_token_id": processing_class.bos_token_id,
               "eos_token_id": self.eos_token_ids, "temperature": self.temperature, "top_p": self.top_p,
               "top_k": self.top_k, "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
               "cache_implementation": args.cache_implementation}
        gen.update(args.generation_kwargs or {})
        self.generation_config = GenerationConfig(**gen)
        self.generation_kwargs = gen
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self.use_vllm, self.vllm_mode = False, args.vllm_mode
        self._last_loaded_step = -1

    # ---- data ----
    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:  # the rows are read by _generate_and_score_completions, not the model
            self._signature_columns = ["prompt"]

    def get_train_dataloader(self):
        # one dataloader batch = one generation batch: the window's micro-batches come from its split
        return self._get_dataloader(dataset=self.train_dataset, description="Training",
                                    batch_size=self._train_batch_size * self.args.gradient_accumulation_steps,
                                    sampler_fn=self._get_train_sampler, is_training=True)

    def _get_train_sampler(self, dataset=None):
        dataset = self.train_dataset if dataset is None else dataset
        gen_batch = self.args.per_device_train_batch_size * self.accelerator.num_processes * \
            self.args.gradient_accumulation_steps
        return RepeatSampler(data_source=dataset, mini_repeat_count=1, batch_size=gen_batch,
                             repeat_count=self.args.gradient_accumulation_steps, shuffle=self.shuffle_dataset,
                             seed=self.args.seed)

    # ---- generation ----
    def _tokenize_prompts(self, prompts: list):
        if prompts and isinstance(prompts[0], list):  # chat messages
            ids = self.processing_class.apply_chat_template(prompts, add_generation_prompt=True, tokenize=True,
                                                            **self.chat_template_kwargs)
            ids = ids["input_ids"] if isinstance(ids, dict) else ids
        else:
            ids = self.processing_class(text=prompts)["input_ids"]
        return ids, None, {}

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, has_tool_images=False):
        device = self.accelerator.device
        t = [torch.tensor(ids) for ids in prompt_ids]
        inputs = {"input_ids": pad(t, padding_value=self._tokenizer.pad_token_id, padding_side="left"),
                  "attention_mask": pad([torch.ones_like(x) for x in t], padding_value=0, padding_side="left")}
        inputs = Trainer._prepare_inputs(self, inputs)  # onto the device
        with unwrap_for_generation(self.model_wrapped, self.accelerator,
                                   gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                                   generation_kwargs=self.generation_kwargs,
                                   gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs) as m, \
                torch.no_grad():
            out = m.generate(**inputs, generation_config=self.generation_config)
        comp = out[:, inputs["input_ids"].size(1):]
        is_eos = torch.isin(comp, torch.tensor(self.eos_token_ids, device=device))
        first = torch.full((comp.size(0),), comp.size(1), dtype=torch.long, device=device)
        any_eos = is_eos.any(dim=1)
        first[any_eos] = is_eos.int().argmax(dim=1)[any_eos]
        keep = torch.arange(comp.size(1), device=device).expand(comp.size(0), -1) <= first.unsqueeze(1)
        return [c[k].tolist() for c, k in zip(comp.cpu(), keep.cpu())]

    def _generate(self, prompts: list):
        device = self.accelerator.device
        mode = "train" if self.model.training else "eval"
        prompt_ids, images, fields = self._tokenize_prompts(copy.deepcopy(prompts))
        completion_ids = self._generate_single_turn(prompt_ids, images, fields)
        p_len = self.accelerator.gather(torch.tensor([len(x) for x in prompt_ids], device=device))
        c_len = self.accelerator.gather(torch.tensor([len(x) for x in completion_ids], device=device))
        if c_len.numel() == 0:
            raise RuntimeError("no completions were generated")
        if mode == "train":
            self.state.num_input_tokens_seen += int((p_len.sum() + c_len.sum()).item())
        m = self._metrics[mode]
        m["num_tokens"] = [self.state.num_input_tokens_seen]
        m["completions/mean_length"].append(c_len.float().mean().item())
        m["completions/min_length"].append(c_len.float().min().item())
        m["completions/max_length"].append(c_len.float().max().item())
        ends = {*self.eos_token_ids, self._tokenizer.pad_token_id}
        clipped = self.accelerator.gather(torch.tensor([not x or x[-1] not in ends for x in completion_ids],
                                                       device=device))
        m["completions/clipped_ratio"].append(clipped.float().mean().item())
        term = c_len[~clipped] if bool((~clipped).any()) else torch.zeros(1, device=device)
        m["completions/mean_terminated_length"].append(term.float().mean().item())
        m["completions/min_terminated_length"].append(term.float().min().item())
        m["completions/max_terminated_length"].append(term.float().max().item())
        return prompt_ids, completion_ids, None, images, []

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        device = self.accelerator.device
        prompt_ids, completion_ids, _, _, _ = self._generate([x["prompt"] for x in inputs])
        pid = [torch.tensor(x) for x in prompt_ids]
        cid = [torch.tensor(x, dtype=torch.long) for x in completion_ids]
        m = self.pad_to_multiple_of
        out = {
            "prompt_ids": pad(pid, padding_value=self._tokenizer.pad_token_id, padding_side="left",
                              pad_to_multiple_of=m).to(device),
            "prompt_mask": pad([torch.ones_like(x) for x in pid], padding_value=0, padding_side="left",
                               pad_to_multiple_of=m).to(device),
            "completion_ids": pad(cid, padding_value=self._tokenizer.pad_token_id, padding_side="right",
                                  pad_to_multiple_of=m).to(device),
            "completion_mask": pad([torch.ones_like(x) for x in cid], padding_value=0, padding_side="right",
                                   pad_to_multiple_of=m).to(device),
        }
        out["num_items_in_batch"] = self.accelerator.gather(out["completion_mask"].sum()).sum()
        return out

    def _prepare_inputs(self, generation_batch):
        if not self.model.training:
            return self._generate_and_score_completions(generation_batch)
        ga = self.args.gradient_accumulation_steps
        if self._step % ga == 0 or self._buffered_inputs is None:
            batch = shuffle_sequence_dict(self._generate_and_score_completions(generation_batch))
            self._buffered_inputs = split_tensor_dict(batch, ga)
        return self._buffered_inputs[self._step % ga]

    # ---- forward ----
    def _get_last_hidden_state(self, unwrapped_model, input_ids, attention_mask, logits_to_keep, **_):
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False}
        if "logits_to_keep" in self.model_kwarg_keys:
            inputs["logits_to_keep"] = logits_to_keep + 1
        h = unwrapped_model.base_model(**inputs).last_hidden_state
        return h[:, :-1, :][:, -logits_to_keep:, :]  # the positions that predict the completion's tokens

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.model.training and inputs.get("num_items_in_batch") is not None:
            num_items_in_batch = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        student = self.accelerator.unwrap_model(model)
        loss, entropy_sum, n = self._forward_redirection(model, student, self._compute_loss, student, inputs,
                                                          num_items_in_batch)
        mode = "train" if self.model.training else "eval"
        n = self.accelerator.gather_for_metrics(n).sum()
        entropy_sum = self.accelerator.gather_for_metrics(entropy_sum).sum()
        self._metrics[mode]["entropy"].append((entropy_sum / n).item() if n > 0 else 0.0)
        return (loss, None) if return_outputs else loss

    def _compute_loss(self, unwrapped_student, inputs, num_items_in_batch):
        raise NotImplementedError("the subclass defines the objective (OPDTrainer._compute_loss)")

    def training_step(self, model, inputs, num_items_in_batch=None):
        t0 = time.perf_counter()
        out = super().training_step(model, inputs, num_items_in_batch)
        self._step += 1
        self._current_train_step_time += time.perf_counter() - t0
        if self._step % self.args.gradient_accumulation_steps == 0:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
        return out

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.mean().detach(), None, None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        metrics = {}
        for k, vals in self._metrics[mode].items():
            ok = [v for v in vals if not math.isnan(v)]
            metrics[("eval_" if mode == "eval" else "") + k] = sum(ok) / len(ok) if ok else None
        logs.update(metrics)
        super().log(logs, start_time)
        self._metrics[mode].clear()
