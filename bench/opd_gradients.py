"""Why on-policy distillation learns less per sequence than SFT: its gradients on one real batch.

    python -m bench.opd_gradients --grad_layers 2 --resamples 4 --max_new_tokens 32 --prompts 2   # CPU (slow)
    python -m bench.opd_gradients --student DIR/start --teacher DIR/teacher --resamples 16           # one GPU

Student: ``--student`` (default the embedded SmolLM2-135M-Instruct; on the GPU, bench/learning.py's
``<out>/start`` and ``<out>/teacher``). Teacher: ``--teacher``, or by default the privileged self-teacher
(the frozen student reading the reference solution and the final answer). Problems: hard ladder
(``synth-hard:``), one per level from 1. Each of ``resamples`` rounds samples a fresh batch of
``prompts`` x ``G`` student completions (T = 1, the rollout setting) of the same prompts and takes, on
that batch, the gradient (over the top ``grad_layers`` decoder layers and the final norm, or all
parameters with 0) of:

- ``sampled``: trainers/losses.py ``sampled_token_loss`` (advantage -k1, w_kl = 1, w_reward = 0),
  normalised per token over the batch (the trainer's default);
- ``sampled/seq``: the same advantage, each sequence's token mean, averaged over sequences;
- ``full``: ``full_vocab_loss`` on the exact per-token reverse KL (TRL's chunked kernel, ``full_reverse_kl``);
- ``reward``: the reward term alone (``group_advantages`` of the grader's verdicts, std-normalised, eps 1e-4),
  and ``reward/one-right``: the same with one right sample per group (the case run 1 describes);
- ``sft``: cross-entropy (token mean) on teacher samples of the same prompts that the grader verified,
  as many sequences as the on-policy batch (topped up with reference solutions when too few verify;
  ``--sft_source reference``: the reference solutions alone, no teacher sampling).

The per-token objective of ``sampled`` and ``full`` is the same (sum over visited states of
KL(pi_theta || pi_T)), so the mean of ``sampled`` over resampled batches should approach the mean of
``full``: the table gives their cosine and relative error after R/4, R/2 and R rounds (an unbiased
estimator's error shrinks like 1/sqrt(R)). Variance: the norm of each estimator per batch, and the
cosine between estimates from independent batches (~ signal share ||E g||^2 / E||g||^2: what Adam
can follow). The gradient-clipping threshold of every arm is 1.0.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from trainers import losses  # noqa: E402
from trainers.offpolicy import solution_batch  # noqa: E402


def hidden(model, p_ids, p_mask, c_ids, c_mask):
    """``(B, K, H)`` last hidden states at the positions predicting the completion tokens."""
    ids, mask = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1)
    h = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    return h[:, p_ids.size(1) - 1 : -1]


def seq_logps(model, p_ids, p_mask, c_ids, c_mask):
    h = hidden(model, p_ids, p_mask, c_ids, c_mask)
    valid = c_mask.bool()
    lp, _ = losses.token_logprobs(h[valid], model.lm_head.weight, None, c_ids[valid])
    out = torch.zeros(c_ids.shape, dtype=lp.dtype, device=lp.device)
    out[valid] = lp
    return out


def sample(model, tok, prompts: list[str], *, max_new_tokens: int, temperature: float, seed: int):
    """One completion per prompt (HF generate): ``(prompt tensors, completion ids (B, K), mask, texts, truncated)``."""
    torch.manual_seed(seed)
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)  # one BOS
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature, top_k=0,
                             top_p=1.0, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    comp = out[:, enc.input_ids.size(1):]
    eos = tok.eos_token_id
    rows, trunc = [], []
    for r in comp.tolist():
        cut = next((j + 1 for j, t in enumerate(r) if t == eos), None)
        trunc.append(cut is None)
        rows.append(r[: cut or len(r)])
    K = max(map(len, rows))
    c_ids = torch.tensor([r + [tok.pad_token_id] * (K - len(r)) for r in rows], device=model.device)
    c_mask = torch.tensor([[1] * len(r) + [0] * (K - len(r)) for r in rows], device=model.device)
    texts = tok.batch_decode(rows, skip_special_tokens=True)
    return enc.input_ids, enc.attention_mask, c_ids, c_mask, texts, trunc


def flat_grad(loss, params, coords: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The exact gradient norm, and the gradient at ``coords`` (a fixed random sample of coordinates).

    Cosines are computed on the sample: keeping 6 full 135M-float vectors per batch would not fit the
    shared CPU machine, and a cosine over millions of uniformly sampled coordinates of dense gradients
    differs from the full one by well under 0.01.
    """
    g = torch.cat([x.reshape(-1) for x in torch.autograd.grad(loss, params, retain_graph=True)])
    return float(g.norm()), g[coords]


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()).clamp(min=1e-30))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=4, help="Distinct prompts per batch (one per ladder level from 1).")
    ap.add_argument("--G", type=int, default=4, help="Samples per prompt.")
    ap.add_argument("--resamples", type=int, default=8, help="R: independent batches of the same prompts.")
    ap.add_argument("--max_new_tokens", type=int, default=64, help="Completion cap (student and teacher).")
    ap.add_argument("--student", default="", help="HF directory of the student; empty = the embedded SmolLM2.")
    ap.add_argument("--teacher", default="", help="HF directory of the teacher; empty = privileged self-teacher.")
    ap.add_argument("--sft_source", default="teacher", choices=["teacher", "reference"],
                    help="SFT data: the teacher's verified samples (topped up with references) or the references.")
    ap.add_argument("--grad_layers", type=int, default=0,
                    help="Gradients over the top N decoder layers + final norm only (0 = all parameters): on a CPU the "
                         "backward passes then stop N layers down.")
    ap.add_argument("--coords", type=int, default=8_000_000, help="Sampled gradient coordinates for the cosines.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="", help="Also write every number here.")
    a = ap.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data_tools.grader import grade_batch
    from data_tools.models import resolve_model
    from data_tools.problems import load_problems
    from data_tools.prompts import privileged_messages, render, student_messages

    t0 = time.time()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    path = a.student or resolve_model(None)
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    student = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(dev).eval()
    teacher = (AutoModelForCausalLM.from_pretrained(a.teacher, dtype=torch.float32).to(dev) if a.teacher
               else copy.deepcopy(student)).eval().requires_grad_(False)
    train = load_problems("synth-hard:train:2000", seed=a.seed).rows

    by_level: dict[str, dict] = {}
    for r in train:
        by_level.setdefault(str(r["level"]), r)
    probs = [by_level[k] for k in sorted(by_level)][: a.prompts]
    prompts = [render(tok, student_messages(p["problem"], "reasoning")) for p in probs for _ in range(a.G)]
    t_prompts = prompts if a.teacher else [
        render(tok, privileged_messages(p["problem"], f"{p['solution']}\nThe final answer is {p['answer']}.", "reasoning"))
        for p in probs for _ in range(a.G)]
    golds = [p["answer"] for p in probs for _ in range(a.G)]
    if a.grad_layers:
        student.requires_grad_(False)
        for m in [*student.model.layers[-a.grad_layers:], student.model.norm]:
            m.requires_grad_(True)
    params = [p for p in student.parameters() if p.requires_grad]
    print(f"[grad] student {path}, teacher {a.teacher or 'privileged self-teacher'}, {len(params)} tensors / "
          f"{sum(p.numel() for p in params) / 1e6:.1f}M parameters with gradients, {dev}", flush=True)
    W = student.lm_head.weight
    total = sum(p.numel() for p in params)
    coords = torch.randint(total, (min(a.coords, total),), generator=torch.Generator().manual_seed(a.seed)).to(dev)

    names = ("sampled", "sampled/seq", "full", "reward", "reward/one-right", "sft")
    sums = {n: None for n in names}
    prev = {n: None for n in names}
    stat = {n: {"norm": [], "cos_prev": []} for n in names}
    within, bias, scale = [], {}, {"k1_abs": [], "k1_std": [], "k1_q01_q50_q99_min": [], "kl_full": [], "reward": [], "adv_abs": [],
                                   "tokens": [], "sft_verified": [], "groups_with_signal": []}
    one_right = losses.group_advantages(torch.tensor(([1.0] + [0.0] * (a.G - 1)) * a.prompts, device=dev), a.G)
    checkpoints = sorted({max(1, a.resamples // 4), max(1, a.resamples // 2), a.resamples})
    for r in range(a.resamples):
        p_ids, p_mask, c_ids, c_mask, texts, trunc = sample(student, tok, prompts, max_new_tokens=a.max_new_tokens,
                                                            temperature=1.0, seed=a.seed * 1000 + r)
        verdicts = grade_batch(texts, golds, truncated=trunc, answer_filter="numeric")
        rewards = torch.tensor([float(v.correct) for v in verdicts], device=dev)
        adv = losses.group_advantages(rewards, a.G)
        valid = c_mask.bool()
        N = valid.sum()
        hs = hidden(student, p_ids, p_mask, c_ids, c_mask)[valid]
        tp = tok(t_prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(dev)
        with torch.no_grad():
            ht = hidden(teacher, tp.input_ids, tp.attention_mask, c_ids, c_mask)[valid]
            t_lp, _ = losses.token_logprobs(ht, teacher.lm_head.weight, None, c_ids[valid])
        s_lp, _ = losses.token_logprobs(hs, W, None, c_ids[valid])
        kl, _ = losses.full_reverse_kl(hs, W, None, ht, teacher.lm_head.weight, None)
        tok_adv = lambda A: A.unsqueeze(1).expand_as(c_ids)[valid]  # noqa: E731
        zero = torch.zeros_like(s_lp)
        l_samp, parts = losses.sampled_token_loss(s_lp, s_lp.detach(), t_lp, zero, N, w_kl=1.0, w_reward=0.0)
        # per-sequence normalisation: sequence i's tokens weighted 1 / (n_i * B) instead of 1 / N
        n_i = valid.sum(1, keepdim=True).expand_as(c_ids)[valid].float()
        l_seq = ((s_lp.detach() - t_lp) * torch.exp(s_lp - s_lp.detach()) / (n_i * c_ids.size(0))).sum()
        l_full, _, _ = losses.full_vocab_loss(kl, s_lp, zero, N, w_kl=1.0, w_reward=0.0)
        l_rew = losses.full_vocab_loss(zero, s_lp, tok_adv(adv), N, w_kl=0.0, w_reward=1.0)[0]
        l_one = losses.full_vocab_loss(zero, s_lp, tok_adv(one_right), N, w_kl=0.0, w_reward=1.0)[0]
        grads = {"sampled": flat_grad(l_samp, params, coords), "sampled/seq": flat_grad(l_seq, params, coords),
                 "full": flat_grad(l_full, params, coords)}
        grads["reward"] = (flat_grad(l_rew, params, coords) if float(adv.abs().sum()) > 0
                           else (0.0, torch.zeros(len(coords), device=dev)))
        grads["reward/one-right"] = flat_grad(l_one, params, coords)
        del hs, kl, s_lp
        # SFT on the teacher's verified samples of the same prompts (T = 0.7, as stage one), same sequence count
        ok, t_texts = [], []
        if a.sft_source == "teacher":
            _, _, _, _, t_texts, t_trunc = sample(teacher, tok, t_prompts, max_new_tokens=a.max_new_tokens,
                                                  temperature=0.7, seed=a.seed * 1000 + 500 + r)
            tv = grade_batch(t_texts, golds, truncated=t_trunc, answer_filter="numeric")
            ok = [i for i, v in enumerate(tv) if v.correct and not t_trunc[i]]
        sols = [t_texts[i] for i in ok] + [probs[i // a.G]["solution"] for i in range(len(prompts)) if i not in ok]
        sp = [prompts[i] for i in ok] + [prompts[i] for i in range(len(prompts)) if i not in ok]
        b = solution_batch(tok, sp, sols, device=dev)
        lp_sft = seq_logps(student, b["sft_prompt_ids"], b["sft_prompt_mask"], b["sft_completion_ids"],
                           b["sft_completion_mask"])
        m = b["sft_completion_mask"].float()
        grads["sft"] = flat_grad(-(lp_sft * m).sum() / m.sum(), params, coords)

        within.append(cos(grads["sampled"][1], grads["full"][1]))
        k1 = parts.k1
        scale["k1_abs"].append(float(k1.abs().mean()))
        scale["k1_std"].append(float(k1.std()))
        q = torch.quantile(k1.float().cpu(), torch.tensor([0.01, 0.5, 0.99]))
        scale["k1_q01_q50_q99_min"].append([*map(float, q), float(k1.min())])
        scale["kl_full"].append(float(l_full.detach()))
        scale["reward"].append(float(rewards.mean()))
        scale["adv_abs"].append(float(adv.abs().mean()))
        scale["tokens"].append(float(N) / len(prompts))
        scale["sft_verified"].append(len(ok) / len(prompts))
        scale["groups_with_signal"].append(float((rewards.view(-1, a.G).std(1) > 0).float().mean()))
        for n, (norm, g) in grads.items():
            stat[n]["norm"].append(norm)
            if prev[n] is not None:
                stat[n]["cos_prev"].append(cos(g, prev[n]))
            prev[n] = g
            sums[n] = g.clone() if sums[n] is None else sums[n].add_(g)
        if r + 1 in checkpoints:
            ms, mf = sums["sampled"] / (r + 1), sums["full"] / (r + 1)
            bias[r + 1] = {"cos": cos(ms, mf), "rel_err": float((ms - mf).norm() / mf.norm())}
        print(f"[grad] batch {r + 1}/{a.resamples}: reward {rewards.mean():.2f}, |k1| {scale['k1_abs'][-1]:.3f}, "
              f"KL {scale['kl_full'][-1]:.3f}, cos(sampled, full) {within[-1]:.3f}, "
              f"teacher verified {len(ok)}/{len(prompts)}, {time.time() - t0:.0f}s", flush=True)
        del grads, lp_sft

    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    sd = lambda xs: math.sqrt(sum((x - mean(xs)) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else float("nan")  # noqa: E731
    # the mean's norm, scaled from the sampled coordinates to all of them
    norms = {n: float(sums[n].norm()) / a.resamples * math.sqrt(total / len(coords)) for n in names}
    print(f"\n## Gradients on {a.prompts} prompts x G={a.G} (levels 1-{a.prompts}), {a.resamples} resampled batches, "
          f"{mean(scale['tokens']):.1f} tokens per completion\n")
    print("| estimator | norm per batch (mean ± sd) | cos between independent batches | norm of the mean over R | "
          "cos with full's mean |")
    print("|---|---|---|---|---|")
    mf = sums["full"] / a.resamples
    for n in names:
        s = stat[n]
        print(f"| {n} | {mean(s['norm']):.4f} ± {sd(s['norm']):.4f} | {mean(s['cos_prev']):.3f} | {float(norms[n]):.4f} | "
              f"{cos(sums[n] / a.resamples, mf):.3f} |")
    print("\n(norm of the mean: from the sampled coordinates, scaled by sqrt(all / sampled); cosines on the sample)")
    print(f"\ncos(sampled, full) on the same batch: {mean(within):.3f} ± {sd(within):.3f}")
    print("mean of sampled vs mean of full: " + ", ".join(
        f"R={k}: cos {v['cos']:.3f}, rel. error {v['rel_err']:.3f}" for k, v in bias.items()))
    print(f"per token: |k1| {mean(scale['k1_abs']):.3f} (sd within batch {mean(scale['k1_std']):.3f}), "
          f"full KL {mean(scale['kl_full']):.3f} nats; reward {mean(scale['reward']):.3f}, groups with signal "
          f"{mean(scale['groups_with_signal']):.2f}, |A| {mean(scale['adv_abs']):.3f} (one-right pattern: "
          f"{float(one_right.abs().mean()):.3f}); teacher samples verified {mean(scale['sft_verified']):.2f}")
    qs = [sum(x[i] for x in scale["k1_q01_q50_q99_min"]) / a.resamples for i in range(4)]
    print(f"k1 quantiles (mean over batches): 1% {qs[0]:.2f}, median {qs[1]:.2f}, 99% {qs[2]:.2f}, min {qs[3]:.2f}")
    print(f"ratios of mean per-batch norms: sft / sampled {mean(stat['sft']['norm']) / mean(stat['sampled']['norm']):.2f}, "
          f"reward/one-right / sampled {mean(stat['reward/one-right']['norm']) / mean(stat['sampled']['norm']):.2f}")
    print(f"[grad] done in {time.time() - t0:.0f}s")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "stats": stat, "bias": bias, "within_cos": within,
                                            "scale": scale, "norm_of_mean": {n: float(v) for n, v in norms.items()}},
                                           indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
