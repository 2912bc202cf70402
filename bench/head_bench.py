"""Head-kernel benchmark (the realistic step's lever d): time and peak memory of the vocabulary terms, naive vs TRL vs Liger.

Shapes of the realistic step's micro-batch head: n = 8,192 completion tokens, a Qwen2.5-1.5B-shaped
student head (151,936 rows x 1,536, tied embedding: the weight gets a gradient) and a 7B-shaped
teacher head (152,064 rows x 3,584, no grad) sliced to the shared 151,936 rows, bf16 weights and
hidden states, random values (weights N(0, 1/H), so logits have unit scale), temperature 1.

Modes (each forward + backward of one micro-batch loss, as ``OPDTrainer._compute_loss`` forms it):
  sampled  student log-probs of the sampled tokens (grad) + entropy (metric) + teacher log-probs (no
           grad); loss = -sum_t (A_t - k1_t) log pi(y_t) / n, k1 detached
  full     the same plus the full reverse KL per token (grad); loss = sum_t KL_t / n - sum_t A_t log pi / n
Variants:
  naive    full (n, V) fp32 logits of both models, torch log_softmax (what a plain implementation builds)
  trl      trainers.heads kernel="trl": TRL 1.16's ChunkedLogProbFunction / ChunkedDivergenceFunction
  liger    trainers.heads kernel="liger": Liger 0.8.5 fused linear cross-entropy / fused linear JSD (beta 1)
Reported per (mode, variant): median wall time of forward + backward (CUDA-synchronised), the peak
memory rise above the resident inputs and weights (torch.cuda.max_memory_allocated), and the
relative error of the loss, entropy and hidden-state / weight gradients against naive (bf16 GEMM, fp32 softmax).

Optional ``--order`` part: a 1.5B-shaped student and a 7B-shaped teacher, random bf16, gradient
checkpointing on (``--no-order-gc``: off), one micro-batch of ``--order-batch`` x (256 + ``--tokens``)
tokens: peak memory of one loss forward + backward with the teacher's forward after the student's
(the old order) and before it (the new order in ``OPDTrainer._compute_loss``).

usage:  python bench/head_bench.py --json $OUT/head_bench.json [--order [--no-heads] [--no-order-gc]]
        python bench/head_bench.py --device cpu --tokens 64 --vocab 500 --hidden 32 --teacher-hidden 48  (smoke)
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from trainers import heads  # noqa: E402

GiB = 2**30


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mem(device) -> float:
    return torch.cuda.memory_allocated(device) / GiB if device.type == "cuda" else 0.0


def make_inputs(o, device):
    g = torch.Generator(device=device).manual_seed(o.seed)
    dt = getattr(torch, o.dtype)
    n, Hs, Ht, V, Vt = o.tokens, o.hidden, o.teacher_hidden, o.vocab, o.vocab + o.extra_teacher_rows
    x = dict(
        hs=torch.randn(n, Hs, device=device, generator=g).to(dt),
        ws=(torch.randn(V, Hs, device=device, generator=g) / Hs**0.5).to(dt),
        ht=torch.randn(n, Ht, device=device, generator=g).to(dt),
        wt=(torch.randn(Vt, Ht, device=device, generator=g) / Ht**0.5).to(dt),
        y=torch.randint(0, V, (n,), device=device, generator=g),
        A=torch.randn(n, device=device, generator=g).clamp(-2, 2),
    )
    # the sampled tokens are drawn from the student, so make them likely: its argmax half the time
    with torch.no_grad():
        top = torch.cat([(x["hs"][s : s + 1024].float() @ x["ws"].float().t()).argmax(-1) for s in range(0, n, 1024)])
    x["y"] = torch.where(torch.rand(n, device=device, generator=g) < 0.5, top, x["y"])
    return x


def naive_terms(hs, ws, ht, wt, y, full):
    V = ws.shape[0]
    zs = (hs @ ws.t()).float()
    ls = torch.log_softmax(zs, -1)
    lp = ls.gather(-1, y[:, None]).squeeze(-1)
    with torch.no_grad():
        ent = -(ls.exp() * ls).sum(-1)
        lt_all = torch.log_softmax((ht @ wt[:V].t()).float(), -1)
        lt = lt_all.gather(-1, y[:, None]).squeeze(-1)
    kl = (ls.exp() * (ls - lt_all)).sum(-1) if full else None
    return lp, ent, lt, kl


def kernel_terms(kernel, hs, ws, ht, wt, y, full):
    V = ws.shape[0]
    with torch.no_grad():
        lt, _ = heads.token_logprobs(ht, wt[:V], None, y, kernel=kernel)
    lp, ent = heads.token_logprobs(hs, ws, None, y, kernel=kernel, with_entropy=True)
    kl = heads.reverse_kl(hs, ws, None, ht, wt[:V], None, kernel=kernel) if full else None
    return lp, ent, lt, kl


def one_step(variant, mode, x, hs, ws):
    full = mode == "full"
    if variant == "naive":
        lp, ent, lt, kl = naive_terms(hs, ws, x["ht"], x["wt"], x["y"], full)
    else:
        lp, ent, lt, kl = kernel_terms(variant, hs, ws, x["ht"], x["wt"], x["y"], full)
    n = lp.shape[0]
    if full:
        loss = kl.sum() / n - (x["A"] * lp).sum() / n
    else:
        k1 = lp.detach() - lt
        loss = -((x["A"] - k1) * lp).sum() / n
    loss.backward()
    return loss.detach().float(), ent.detach().sum().float()


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def run_heads(o, device, variants):
    x = make_inputs(o, device)
    out = []
    for mode in o.modes.split(","):
        ref = None
        for variant in variants:
            hs = x["hs"].clone().requires_grad_()
            ws = x["ws"].clone().requires_grad_()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            base = mem(device)
            rec = dict(mode=mode, variant=variant, tokens=o.tokens, vocab=o.vocab, hidden=o.hidden,
                       teacher_hidden=o.teacher_hidden, dtype=o.dtype)
            try:
                times = []
                for i in range(o.warmup + o.iters):
                    hs.grad = ws.grad = None
                    sync(device)
                    t0 = time.perf_counter()
                    loss, ent = one_step(variant, mode, x, hs, ws)
                    sync(device)
                    if i >= o.warmup:
                        times.append(time.perf_counter() - t0)
                rec["time_ms"] = 1e3 * statistics.median(times)
                rec["time_ms_all"] = [round(1e3 * t, 2) for t in times]
                rec["peak_rise_gib"] = (torch.cuda.max_memory_allocated(device) / GiB - base
                                        if device.type == "cuda" else None)
                rec["loss"], rec["entropy_mean"] = float(loss), float(ent) / o.tokens
                if ref is None:  # the first variant (naive) is the reference
                    ref = dict(loss=loss, ent=ent, gh=hs.grad.float().clone(), gw=ws.grad.float().clone())
                else:
                    rec["rel_err_loss"] = rel(loss, ref["loss"])
                    rec["rel_err_entropy"] = rel(ent, ref["ent"])
                    rec["rel_err_grad_hidden"] = rel(hs.grad, ref["gh"])
                    rec["rel_err_grad_weight"] = rel(ws.grad, ref["gw"])
            except Exception as e:  # one variant failing (OOM, a kernel missing) must not lose the others
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            hs.grad = ws.grad = None
            del hs, ws
            print(json.dumps(rec), flush=True)
            out.append(rec)
        del ref
    del x
    return out


def run_order(o, device):
    """Peak memory of one micro-batch loss with the teacher forward after vs before the student's."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from data_tools.formal_models import QWEN25_7B_INSTRUCT, R1_DISTILL_QWEN_1P5B, shape_kwargs

    common = dict(max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, attn_implementation="sdpa")
    # the formal student's shape and the 7B stress teacher, as defined once in data_tools/formal_models.py
    s_cfg = Qwen2Config(**shape_kwargs(R1_DISTILL_QWEN_1P5B), attn_implementation="sdpa")
    t_cfg = Qwen2Config(**shape_kwargs(QWEN25_7B_INSTRUCT), attn_implementation="sdpa")
    if o.order_tiny:
        s_cfg = Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                            intermediate_size=64, vocab_size=o.vocab, tie_word_embeddings=True, **common)
        t_cfg = Qwen2Config(hidden_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                            intermediate_size=96, vocab_size=o.vocab + 8, tie_word_embeddings=False, **common)
    torch.manual_seed(o.seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            student, teacher = Qwen2ForCausalLM(s_cfg), Qwen2ForCausalLM(t_cfg)
    finally:
        torch.set_default_dtype(prev)
    teacher.eval().requires_grad_(False)
    student.train()
    if o.order_gc:  # the formal recipe's setting; without it the student's saved activations dominate the peak
        student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    B, P, K = o.order_batch, 256, o.tokens
    g = torch.Generator(device=device).manual_seed(o.seed)
    ids = torch.randint(0, s_cfg.vocab_size, (B, P + K), device=device, generator=g)
    mask = torch.ones_like(ids)
    V = s_cfg.vocab_size
    ws, wt = student.get_output_embeddings().weight, teacher.get_output_embeddings().weight[:V]
    y = ids[:, P:].reshape(-1)
    A = torch.randn(B * K, device=device, generator=g)

    def hidden(m):  # as TRL's _get_last_hidden_state: backbone, drop the last position, keep K
        return m.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state[:, :-1][:, -K:]

    def step(teacher_first: bool):
        if teacher_first:
            with torch.no_grad():
                ht = hidden(teacher).reshape(B * K, -1)
                lt, _ = heads.token_logprobs(ht, wt, None, y, kernel=o.order_kernel)
            hs = hidden(student).reshape(B * K, -1)
        else:
            hs = hidden(student).reshape(B * K, -1)
            with torch.no_grad():
                ht = hidden(teacher).reshape(B * K, -1)
                lt, _ = heads.token_logprobs(ht, wt, None, y, kernel=o.order_kernel)
        lp, _ = heads.token_logprobs(hs, ws, None, y, kernel=o.order_kernel, with_entropy=True)
        loss = -((A - (lp.detach() - lt)) * lp).sum() / lp.numel()
        loss.backward()
        return float(loss.detach())

    out = []
    for teacher_first in (False, True, False, True):  # twice each: the first call also pays allocator warm-up
        student.zero_grad(set_to_none=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        base = mem(device)
        sync(device)
        t0 = time.perf_counter()
        loss = step(teacher_first)
        sync(device)
        rec = dict(part="order", teacher_first=teacher_first, gradient_checkpointing=o.order_gc, batch=B, tokens_per_seq=P + K, kernel=o.order_kernel,
                   time_s=time.perf_counter() - t0, loss=loss, resident_gib=base,
                   peak_rise_gib=(torch.cuda.max_memory_allocated(device) / GiB - base) if device.type == "cuda"
                   else None)
        print(json.dumps(rec), flush=True)
        out.append(rec)
    student.zero_grad(set_to_none=True)
    del student, teacher
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=151936, help="shared rows (the student's head)")
    ap.add_argument("--extra-teacher-rows", type=int, default=128, help="teacher rows beyond the shared range")
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--teacher-hidden", type=int, default=3584)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--modes", default="sampled,full")
    ap.add_argument("--variants", default="naive,trl,liger", help="naive first: it is the accuracy reference")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--order", action="store_true", help="also the teacher-before-student peak-memory part")
    ap.add_argument("--no-heads", dest="heads", action="store_false", help="skip the head-kernel part")
    ap.add_argument("--order-batch", type=int, default=2)
    ap.add_argument("--order-kernel", default="trl")
    ap.add_argument("--no-order-gc", dest="order_gc", action="store_false",
                    help="order part without gradient checkpointing (the student's activations all saved)")
    ap.add_argument("--order-tiny", action="store_true", help="tiny models for the order part (smoke test)")
    ap.add_argument("--json", default="", help="write the results here")
    o = ap.parse_args(argv)
    device = torch.device(o.device)
    variants = o.variants.split(",")
    if not variants or not set(variants) <= {"naive", "trl", "liger"}:
        ap.error(f"--variants: comma-separated of naive, trl, liger; got {o.variants!r}")
    why = heads.liger_unavailable()
    if "liger" in variants and why:
        print(f"skipping liger: {why}", flush=True)
        variants.remove("liger")
    res = dict(started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), device=str(device),
               gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None, torch=torch.__version__,
               options=vars(o), liger_unavailable=why)
    try:
        import liger_kernel
        import trl

        res["versions"] = dict(trl=trl.__version__, liger_kernel=getattr(liger_kernel, "__version__", "?"))
    except Exception:
        pass
    t0 = time.perf_counter()
    res["heads"] = run_heads(o, device, variants) if o.heads else []
    if o.json:  # partial results survive a later failure
        Path(o.json).write_text(json.dumps(res, indent=1))
    if o.order:
        res["order"] = run_order(o, device)
    res["wall_s"] = time.perf_counter() - t0
    if o.json:
        Path(o.json).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k not in ("heads", "order")}), flush=True)


if __name__ == "__main__":
    main()
