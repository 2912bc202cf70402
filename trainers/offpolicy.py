"""OPDTrainer's off-policy signal: cross-entropy on stage one's verified teacher solutions, mixed over the clock.

Stage one (``stages.curate``) writes the shortest verified teacher solution of each kept problem to the
curriculum's ``teacher_solution`` column; ``build_train_dataset`` carries it to stage two. It enters the
objective two ways (issue 13, run 2 of bench/LEARNING.md):

- ``w_sft``: in an on-policy step, the cross-entropy of the teacher's solution of each prompt in the
  batch (once per prompt, not per sample), sum over its tokens / the global count of such tokens:
  loss = on-policy terms + w_sft * CE. Rows without a verified solution add nothing.
- off-policy steps: a share s(f) of the *training time* goes to steps that are cross-entropy only
  (TRL ``SFTTrainer``'s completion-only loss on ``sft_batch_size`` teacher solutions; no generation, no
  teacher forward), so the cheap signal gets the clock early and the on-policy one late. s(f) runs
  linearly from ``sft_share_start`` to ``sft_share_end`` over ``OPDTrainer.time_fraction()`` f; the step
  type is chosen by error diffusion on measured step seconds (``TimeShare``), so the share holds even
  though an off-policy step is ~10x cheaper than an on-policy one.

GKD (Agarwal et al. 2024, arXiv:2306.13649) mixes teacher-written and student-written sequences by a
per-step coin with probability lambda; here the mix is over seconds rather than steps because the
arms of bench/learning.py are compared at equal training seconds.
"""

from __future__ import annotations

import torch


def sft_share(fraction: float, start: float, end: float) -> float:
    """Share of training time given to off-policy steps at time fraction ``fraction`` (clamped to [0, 1]).

    Linear from ``start`` (f = 0) to ``end`` (f = 1); both in [0, 1].
    """
    f = min(1.0, max(0.0, float(fraction)))
    return start + (end - start) * f


class TimeShare:
    """Chooses each optimizer step's kind so that off-policy steps take a share ``s`` of the measured seconds.

    Error diffusion: ``credit`` accumulates ``(s - [step was off-policy]) * seconds`` after every step;
    the next step is off-policy while the credit is >= 0 and ``s > 0``. With a constant s the
    off-policy share of seconds stays within one step's duration of s; s = 1 gives only off-policy
    steps, s = 0 none.
    """

    def __init__(self) -> None:
        self.credit = 0.0

    def choose(self, share: float) -> bool:
        return share >= 1.0 or (share > 0.0 and self.credit >= 0.0)

    def record(self, share: float, off_policy: bool, seconds: float) -> None:
        self.credit += (share - (1.0 if off_policy else 0.0)) * max(seconds, 0.0)


def solution_batch(tokenizer, prompts: list[str], solutions: list[str | None], *, device) -> dict[str, torch.Tensor]:
    """Tokenise (prompt, teacher solution) pairs in the trainer's layout: left-padded prompts, right-padded completions.

    The prompt is tokenised as TRL tokenises string prompts (``tokenizer(text=...)``), the solution
    without special tokens and followed by EOS (the end of an assistant turn, as in the student's own
    rollouts; TRL ``SFTTrainer`` appends EOS the same way). A row whose solution is None or empty
    gets an all-zero completion mask: it contributes no token.

    Returns:
        ``sft_prompt_ids``/``sft_prompt_mask`` ``(n, P)``, ``sft_completion_ids``/``sft_completion_mask``
        ``(n, K)``, int64, on ``device``.
    """
    from trl.trainer.utils import pad

    eos = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    p_ids = [torch.tensor(x) for x in tokenizer(text=list(prompts))["input_ids"]]
    c_ids, c_mask = [], []
    for s in solutions:
        ids = tokenizer(s, add_special_tokens=False)["input_ids"] + [eos] if s else [pad_id]
        c_ids.append(torch.tensor(ids))
        c_mask.append(torch.full((len(ids),), 1 if s else 0))
    return {
        "sft_prompt_ids": pad(p_ids, padding_value=pad_id, padding_side="left").to(device),
        "sft_prompt_mask": pad([torch.ones_like(t) for t in p_ids], padding_value=0, padding_side="left").to(device),
        "sft_completion_ids": pad(c_ids, padding_value=pad_id, padding_side="right").to(device),
        "sft_completion_mask": pad(c_mask, padding_value=0, padding_side="right").to(device),
    }
