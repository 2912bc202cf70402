"""Regime (iii)'s setup pieces of bench/learning.py: a student cut from the full model, and the per-token
reverse KL of the start's samples under the teacher.

- :func:`kept_layers` / :func:`cut_layers` / :func:`cut_model`: a causal LM keeping N of its decoder layers, saved as
  a Hugging Face folder (weights, config, tokenizer) that every stage loads like any other model;
  ``--student_layers`` makes it the start, which the start's SFT then heals.
- :func:`reverse_kl_probe`: the start samples problems once at the on-policy arms' temperature and cap; each sampled
  token's ``log p_start - log p_teacher`` (the sampled-token estimate the trainer's ``kl_mode: sampled`` uses) and the
  exact full-vocabulary reverse KL at each of those positions, averaged per token (:func:`reverse_kl_sums`).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.learning_config import LearningConfig


def kept_layers(total: int, keep: int, choice: str = "even") -> list[int]:
    """Indices of the decoder layers a cut model keeps, in order.

    ``even``: ``round(i * (total - 1) / (keep - 1))`` for i = 0 .. keep-1, so the first and the last layer are kept
    (the last one's output is what the final norm and the tied head were trained to read) and the rest spread evenly
    between them, as DistilBERT initialised its student from every other layer of its teacher. ``first``: 0 .. keep-1
    (the cut model's last layer is then one whose output the head never read, which the healing SFT must fix).

    Raises:
        ValueError: ``keep`` not in 1 .. total, or an unknown ``choice``.
    """
    if not 1 <= keep <= total:
        raise ValueError(f"a cut model keeps 1 to {total} layers, not {keep}")
    if choice == "first":
        return list(range(keep))
    if choice != "even":
        raise ValueError(f"layer choice must be 'even' or 'first', got {choice!r}")
    if keep == 1:
        return [total - 1]
    return [int(math.floor(i * (total - 1) / (keep - 1) + 0.5)) for i in range(keep)]


def cut_layers(model, keep: int, choice: str = "even") -> list[int]:
    """Cut ``model`` (a loaded HF causal LM with a ``model.layers`` list) in place to ``kept_layers(n, keep, choice)``
    of its n decoder layers; returns the kept indices. Each kept layer's attention is renumbered to its new place
    (``layer_idx``, which the KV cache indexes by), and the config says the new count (``num_hidden_layers``, a
    per-layer ``layer_types``) and where the layers came from (``cut_from_layers``), so ``generate`` and a save work.

    Raises:
        ValueError: the model has no ``model.layers`` list, or ``keep`` is out of range.
    """
    import torch

    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: no model.layers list of decoder layers to cut")
    keep_idx = kept_layers(len(layers), keep, choice)
    model.model.layers = torch.nn.ModuleList(layers[i] for i in keep_idx)
    for new, layer in enumerate(model.model.layers):
        attn = getattr(layer, "self_attn", None)
        if attn is not None and hasattr(attn, "layer_idx"):
            attn.layer_idx = new
        if hasattr(layer, "layer_idx"):
            layer.layer_idx = new
    c = model.config
    if getattr(c, "layer_types", None):
        c.layer_types = [c.layer_types[i] for i in keep_idx]
    c.num_hidden_layers = len(keep_idx)
    c.cut_from_layers = [int(i) for i in keep_idx]
    return keep_idx


def cut_model(src: str | Path, dest: str | Path, keep: int, choice: str = "even") -> list[int]:
    """Save ``src`` (a local HF causal-LM folder) with only ``kept_layers(n, keep, choice)`` of its n decoder layers
    (:func:`cut_layers`) to ``dest``, float32, with its tokenizer; returns the kept indices (also in ``dest``'s
    config as ``cut_from_layers``).

    Raises:
        ValueError: the model has no ``model.layers`` list, or ``keep`` is out of range.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    keep_idx = cut_layers(model, keep, choice)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    AutoTokenizer.from_pretrained(src).save_pretrained(dest)
    return keep_idx


def reverse_kl_sums(student, teacher, sequences, prompt_mask, eos_ids: set[int],
                    temperature: float = 1.0) -> tuple[float, float, int]:
    """Over the completion tokens of ``sequences`` (a [B, P + T] tensor: left-padded prompts, their attention mask
    ``prompt_mask`` [B, P], then the student's samples; each completion ends at its first EOS, which counts, and what
    follows is padding): the sum of ``log p_s(y_t) - log p_t(y_t)`` (sampled-token estimate), the sum of the exact
    ``KL(p_s || p_t)`` at each position, and the token count. Both models read the logits divided by ``temperature``
    (the sampling distribution)."""
    import torch

    prompt_len = prompt_mask.shape[1]
    attn = torch.ones_like(sequences)
    attn[:, :prompt_len] = prompt_mask
    comp = sequences[:, prompt_len:]
    keep = torch.ones_like(comp, dtype=torch.bool)
    for b in range(comp.shape[0]):
        ends = [t for t, tok in enumerate(comp[b].tolist()) if tok in eos_ids]
        if ends:
            keep[b, ends[0] + 1:] = False
    attn[:, prompt_len:] = keep.long()
    pos = (attn.cumsum(-1) - 1).clamp(min=0)  # left padding: positions count real tokens, as generate's
    with torch.no_grad():
        out = []
        for m in (student, teacher):
            logits = m(input_ids=sequences, attention_mask=attn, position_ids=pos).logits[:, prompt_len - 1:-1]
            out.append(torch.log_softmax(logits.float() / temperature, dim=-1))
    lp_s, lp_t = out
    tok_s = lp_s.gather(-1, comp.unsqueeze(-1)).squeeze(-1)
    tok_t = lp_t.gather(-1, comp.unsqueeze(-1)).squeeze(-1)
    full = (lp_s.exp() * (lp_s - lp_t)).sum(-1)
    k = keep.float()
    return float(((tok_s - tok_t) * k).sum()), float((full * k).sum()), int(k.sum())


def reverse_kl_probe(student_dir: str, teacher_dir: str, problems: list[str], *, prompt_style: str, temperature: float,
                     max_new_tokens: int, seed: int, batch: int = 64) -> dict:
    """The start (``student_dir``) samples each of ``problems`` once (HF ``generate``, ``temperature``, top-p 1,
    ``max_new_tokens``); returns the per-token reverse KL of those samples under the teacher: ``kl_sampled`` (mean of
    ``log p_s - log p_t`` over sampled tokens, nats) and ``kl_full`` (the mean exact KL at those positions), with the
    counts (``problems``, ``tokens``, ``clipped``: samples that hit the cap) and the settings."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data_tools.prompts import render, student_messages

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(student_dir, padding_side="left")
    if tok.pad_token is None:  # as generate pads
        tok.pad_token = tok.eos_token
    pad = tok.pad_token_id
    eos = {tok.eos_token_id}
    s = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32).to(dev).eval()
    t = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).to(dev).eval()
    torch.manual_seed(seed)
    sums, clipped = [0.0, 0.0, 0], 0
    for i in range(0, len(problems), batch):
        texts = [render(tok, student_messages(p, prompt_style)) for p in problems[i:i + batch]]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(dev)
        with torch.no_grad():
            seqs = s.generate(**enc, do_sample=True, temperature=temperature, top_p=1.0, top_k=0,
                              max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=tok.eos_token_id)
        comp = seqs[:, enc.input_ids.shape[1]:]
        clipped += sum(not any(x in eos for x in row) for row in comp.tolist())
        for j, v in enumerate(reverse_kl_sums(s, t, seqs, enc.attention_mask, eos, temperature)):
            sums[j] += v
    return dict(problems=len(problems), tokens=sums[2], clipped=clipped, temperature=temperature,
                max_new_tokens=max_new_tokens, kl_sampled=sums[0] / max(sums[2], 1),
                kl_full=sums[1] / max(sums[2], 1))


def cut_student(cfg: LearningConfig, student_path: str) -> Path:
    """``<out>/cut_student``: ``student_path`` cut to ``cfg.student_layers`` layers (:func:`cut_model`), written
    under a temporary name and renamed, once; the start's SFT heals it (``bench.learning.run_all``)."""
    import shutil

    from bench.learning_config import has_weights

    cut, tmp = cfg.dir / "cut_student", cfg.dir / ".cut_student.tmp"
    if not has_weights(cut):
        shutil.rmtree(tmp, ignore_errors=True)
        kept = cut_model(student_path, tmp, cfg.student_layers, cfg.student_layer_choice)
        shutil.rmtree(cut, ignore_errors=True)
        os.replace(tmp, cut)
        print(f"[learning] cut student: layers {kept} of {student_path} -> {cut}", flush=True)
    return cut


def probe_kl(cfg: LearningConfig, start: str) -> dict:
    """``data/setup_kl.json``: the per-token reverse KL of the start's samples under ``<out>/teacher`` on the first
    ``kl_probe_problems`` of the arms' problems (:func:`reverse_kl_probe`, at the on-policy arms' temperature and
    cap)."""
    from bench.learning_clock import _free
    from bench.learning_data import read_rows
    from data_tools.runio import write_json

    problems = [r["problem"] for r in read_rows(cfg.dir / "data" / "train.parquet")[:cfg.kl_probe_problems]]
    t0 = time.time()
    out = reverse_kl_probe(start, str(cfg.dir / "teacher"), problems, prompt_style=cfg.prompt_style,
                           temperature=cfg.temperature, max_new_tokens=cfg.max_completion_length, seed=cfg.seed + 31)
    out["seconds"] = round(time.time() - t0, 1)
    write_json(out, cfg.dir / "data" / "setup_kl.json")
    _free()
    return out
