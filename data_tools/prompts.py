"""Prompt templates shared by curation, training and evaluation.

One template everywhere, so a pass rate measured in stage one means the same thing in stage two
and in evaluation. The instruction follows the common MATH convention (DeepSeek-R1 / Qwen2.5-Math
evaluation): reason, then put the final answer in ``\\boxed{}``, which the grader extracts first.
"""

from __future__ import annotations

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

#: Named instructions (``prompt_style`` in configs). ``reasoning`` is the MATH convention;
#: ``short`` asks for the answer alone, for tiny students (SmolLM2-135M) whose long reasoning
#: only wanders: it keeps completions within a 32-64 token cap on the CPU demo.
STYLES = {
    "reasoning": INSTRUCTION,
    "short": "Give only the final answer, written as \\boxed{answer}.",
}

#: The privileged-context teacher (on-policy self-distillation, OPSD) sees the problem plus the
#: verified reference; the student never does. Wording after the OPSD recipe (siyan-zhao/OPSD).
PRIVILEGED_TEMPLATE = (
    "{problem}\n\nHere is a reference solution to this problem:\n{reference}\n\n"
    "Use it to write your own solution. {instruction}"
)


def _instruction(style: str) -> str:
    try:
        return STYLES[style]
    except KeyError:
        raise ValueError(f"unknown prompt_style {style!r}; choose one of {sorted(STYLES)}") from None


def student_messages(problem: str, style: str = "reasoning") -> list[dict[str, str]]:
    """Chat messages the student (and a plain teacher) sees for ``problem``.

    Raises:
        ValueError: unknown ``style``.
    """
    return [{"role": "user", "content": f"{problem}\n{_instruction(style)}"}]


def privileged_messages(problem: str, reference: str, style: str = "reasoning") -> list[dict[str, str]]:
    """Chat messages of the privileged-context teacher: the problem plus ``reference`` (solution or answer)."""
    text = PRIVILEGED_TEMPLATE.format(problem=problem, reference=reference, instruction=_instruction(style))
    return [{"role": "user", "content": text}]


def render(tokenizer, messages: list[dict[str, str]]) -> str:
    """Render chat ``messages`` with the model's chat template and the generation prompt appended.

    Raises:
        ValueError: the tokenizer has no chat template (base models need one set explicitly).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')} has no chat template")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
