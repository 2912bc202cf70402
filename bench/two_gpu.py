"""Two-GPU run of OPDTrainer: same-batch loss check and weak-scaling throughput, 1 vs N processes.

Launch (one process per GPU; the same script and config for the 1-GPU reference):

    CUDA_VISIBLE_DEVICES=0 accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 1 \
        bench/two_gpu.py --json one.json
    accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 2 bench/two_gpu.py --json two.json
    python bench/two_gpu.py --compare one.json two.json          (prints the table)

CPU smoke test of the same code (gloo, DDP-like MULTI_CPU; accelerate has no FSDP on CPU):

    torchrun --nproc_per_node 2 bench/two_gpu.py --tiny --device cpu --json /tmp/two.json

What it does, on the Qwen2.5-1.5B-shaped random student and teacher of ``bench/opd_step_bench.py``:

1. **Loss check** (``on_train_begin``, model already wrapped by accelerate, initial weights): a fixed global
   batch of ``--check-completions`` completions (prompts x G, completion ids drawn from a fixed seed, every
   completion ``--new-tokens`` long, no EOS) is split across the processes by rank; generation is bypassed
   (``_generate_single_turn`` returns the fixed ids), everything else is the trainer's own path
   (``_generate_and_score_completions``: grading, group advantages over the gathered rewards, teacher
   inputs; then ``compute_loss`` through the FSDP wrapper, forward only). Each process's loss is normalised by
   the *global* completion-token count / world size (TRL's convention), so the global loss is the mean over
   ranks; it is reported for ``kl_mode`` sampled and full. Same number on 1 and N GPUs up to bf16 rounding.
2. **Throughput**: ``OPDTrainer.train()`` for ``--warmup`` + ``--steps`` optimizer steps, each process
   generating ``--prompts`` completions (``--new-tokens`` new tokens, ``min_new_tokens`` = max so every step
   has the same token count), i.e. the global batch grows with the GPU count (weak scaling). Reported per
   step from the trainer's own metrics: ``time/step`` (rank 0, whole optimizer step), ``time/generation``,
   global completion tokens / step seconds. Generation takes the trainer's fast path on a GPU (engine
   ``hf-generate-fast`` in the JSON): under FSDP2 ``trainers.fast_generation.fsdp2_full_weights`` all-gathers the
   student once per generation call and decodes with a static KV cache and a CUDA-graph step on the whole
   weights, with FSDP's per-layer hooks detached for the call. ``--fast-generation false`` measures TRL's HF
   generate on the sharded student instead (bench/RESULTS.md run 4: every layer all-gathered at every
   decode token).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402


def build(opts):
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging

    from opd_step_bench import QWEN15, SPECIALS, TINY, build_model, build_tokenizer, make_prompts
    from trainers.opd_config import OPDConfig
    from trainers.opd_trainer import OPDTrainer

    hf_logging.set_verbosity_error()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    cuda = opts.device == "cuda"
    dev = f"cuda:{local}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(local)
    shape = TINY if opts.tiny else QWEN15
    V = shape["vocab_size"]
    tok = build_tokenizer(V)
    student = build_model(shape, tok, 1, dev)
    teacher = build_model(shape, tok, 2, dev)
    G, P, N = opts.G, opts.prompts, opts.new_tokens
    steps = opts.warmup + opts.steps
    per_step_prompts = P * world // G
    prompts = make_prompts(max(per_step_prompts * (steps + 1), opts.check_completions // G), opts.prompt_len, V, 0)
    rows = {"prompt": prompts, "teacher_prompt": prompts, "answer": ["42"] * len(prompts),
            "problem_id": [f"p{i}" for i in range(len(prompts))], "bucket": [0] * len(prompts),
            "curriculum_index": list(range(len(prompts)))}
    out_dir = Path(opts.output_dir or tempfile.mkdtemp(prefix="opd_two_gpu_"))
    args = OPDConfig(output_dir=str(out_dir), num_generations=G, kl_mode="sampled", teacher_context="teacher",
                     w_kl=1.0, w_reward=1.0, model_dtype="bfloat16", per_device_train_batch_size=P,
                     gradient_accumulation_steps=1, max_completion_length=N, temperature=1.0,
                     generation_kwargs={"min_new_tokens": N}, gradient_checkpointing=True, bf16=cuda,
                     learning_rate=opts.lr, max_grad_norm=1.0, report_to=[], logging_steps=1,
                     debug_max_steps=steps, ckpt_every_minutes=0, resume=False, save_rollouts=False,
                     max_wall_time_seconds=10**7, deadline_reserve_seconds=0, use_cpu=not cuda, seed=0,
                     dataloader_num_workers=0, grader_workers=opts.grader_workers,
                     fast_generation=opts.fast_generation, curriculum_shuffle_within_bucket=False)

    result = {"world_size": world, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "transformers": __import__("transformers").__version__,
              "trl": __import__("trl").__version__, "argv": sys.argv[1:],
              "per_device_completions": P, "global_completions": P * world, "new_tokens": N,
              "prompt_len": opts.prompt_len, "G": G, "steps": []}

    class LossCheck(TrainerCallback):
        """Same global batch on every world size: the loss of the initial weights, forward only."""

        def on_train_begin(self, a, state, control, **kw):
            tr = self.trainer
            L = opts.check_completions
            assert L % (G * world) == 0 or L % world == 0, "check batch must split over the processes"
            g = torch.Generator().manual_seed(1234)
            comp = torch.randint(len(SPECIALS), V, (L, N), generator=g)  # no special tokens: no EOS, full length
            grows = [{"prompt": prompts[i // G], "teacher_prompt": prompts[i // G], "answer": "42",
                      "problem_id": f"p{i // G}", "bucket": 0, "curriculum_index": i // G} for i in range(L)]
            lo, hi = rank * L // world, (rank + 1) * L // world
            local_rows, local_comp = grows[lo:hi], comp[lo:hi].tolist()
            tr._generate_single_turn = lambda *a_, **k_: [list(c) for c in local_comp]
            try:
                tr.model.train()
                inputs = tr._generate_and_score_completions(local_rows)
            finally:
                del tr._generate_single_turn  # back to the class method
            res = {"completions": L, "tokens": int(inputs["num_items_in_batch"].item())}
            for mode in ("sampled", "full"):
                tr.args.kl_mode = mode
                with torch.no_grad():
                    loss = tr.compute_loss(tr.model_wrapped, inputs).detach().float().reshape(1)
                per_rank = tr.accelerator.gather(loss).cpu().tolist()
                res[mode] = {"loss": sum(per_rank) / len(per_rank), "per_rank": per_rank}
            tr.args.kl_mode = opts.kl_mode
            tr.steps.acc.clear()
            tr.steps.timers.clear()
            tr._pending_rollouts = None
            for m in tr._metrics.values():
                m.clear()
            result["loss_check"] = res
            if rank == 0:
                print(f"[loss-check] world={world} " + json.dumps(res), flush=True)

    class StepLog(TrainerCallback):
        """Collects the trainer's per-step logs (rank 0); at the step cap: stop without the final export."""

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "time/step" in logs:
                row = {k: v for k, v in logs.items() if isinstance(v, (int, float))}
                row["step"] = state.global_step
                result["steps"].append(row)
                result["fast_generator_stats"] = fast_generator_stats(tr)
                result["summary"] = summarise(result, opts.warmup)  # partial results survive a time limit
                if rank == 0:
                    print("[step] " + json.dumps(row), flush=True)
                    if opts.json:
                        Path(opts.json).write_text(json.dumps(result, indent=1))

        def on_step_end(self, a, state, control, **kw):
            if state.global_step >= steps:
                control.should_training_stop = True
                control.should_save = bool(opts.save)

    tr = OPDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=Dataset.from_dict(rows),
                    processing_class=tok, teacher_processing_class=tok)
    lc, sl = LossCheck(), StepLog()
    lc.trainer = tr
    tr.add_callback(lc)
    tr.add_callback(sl)
    result["distributed_type"] = str(tr.accelerator.distributed_type)
    result["engine"] = tr.rollouts.name
    return tr, result


def fast_generator_stats(tr) -> dict | None:
    """Proof that the fast path ran: the student's ``FastGenerator`` stats (``captures`` = decode states built,
    one per generation call with ``keep_cache`` off); None if every call fell back to TRL's generate (e.g. FSDP2's
    hooks not recognised by ``trainers.fast_generation.fsdp2_full_weights``: it logs a warning)."""
    g = getattr(tr.accelerator.unwrap_model(tr.model), "_opd_fast_generator", None)
    return dict(g.stats) if g else None


def summarise(result: dict, warmup: int) -> dict:
    timed = [r for r in result["steps"] if r["step"] > warmup]
    if not timed:
        return {}
    tokens = result["global_completions"] * result["new_tokens"]
    med = lambda k: statistics.median(r.get(k, float("nan")) for r in timed)  # noqa: E731
    s = {"timed_steps": len(timed), "step_s": med("time/step"), "generation_s": med("time/generation"),
         "teacher_s": med("time/teacher"), "update_s": med("time/update"), "reward_s": med("time/reward"),
         "tokens_per_step": tokens, "peak_gib": max(r.get("memory/peak_gib", 0.0) for r in timed)}
    s["tokens_per_s"] = tokens / s["step_s"]
    s["generation_tokens_per_s"] = tokens / s["generation_s"] if s["generation_s"] else float("nan")
    upd = s["step_s"] - s["generation_s"] - s["reward_s"]
    s["update_incl_teacher_s"] = upd
    s["update_tokens_per_s"] = tokens / upd if upd > 0 else float("nan")
    return s


def compare(one_path: str, two_path: str) -> str:
    one, two = (json.loads(Path(p).read_text()) for p in (one_path, two_path))
    lines = [f"engine: 1 GPU {one.get('engine')} (fast generator {one.get('fast_generator_stats')}), "
             f"2 GPUs {two.get('engine')} (fast generator {two.get('fast_generator_stats')})"]
    lc1, lc2 = one.get("loss_check", {}), two.get("loss_check", {})
    lines.append(f"loss check: {lc1.get('completions')} completions x {one['new_tokens']} tokens "
                 f"({lc1.get('tokens')} / {lc2.get('tokens')} tokens counted)")
    lines.append("| kl_mode | 1 GPU loss | 2 GPU loss (mean of ranks) | per rank | abs diff | rel diff |")
    lines.append("|---|---|---|---|---|---|")
    for mode in ("sampled", "full"):
        a, b = lc1.get(mode, {}).get("loss", float("nan")), lc2.get(mode, {}).get("loss", float("nan"))
        pr = ", ".join(f"{x:.6f}" for x in lc2.get(mode, {}).get("per_rank", []))
        lines.append(f"| {mode} | {a:.6f} | {b:.6f} | {pr} | {abs(a - b):.2e} | {abs(a - b) / max(abs(a), 1e-12):.2e} |")
    s1, s2 = one.get("summary", {}), two.get("summary", {})
    lines.append("")
    lines.append("| | 1 GPU | 2 GPUs | 2 / 1 |")
    lines.append("|---|---|---|---|")
    for k, lab in (("global_completions", "completions per step (global)"), ("step_s", "step s (median)"),
                   ("generation_s", "generation s"), ("update_incl_teacher_s", "update + teacher s"),
                   ("tokens_per_s", "**completion tok/s, whole step**"),
                   ("generation_tokens_per_s", "generation tok/s"), ("update_tokens_per_s", "update tok/s"),
                   ("peak_gib", "peak GiB per GPU")):
        a = s1.get(k, one.get(k, float("nan")))
        b = s2.get(k, two.get(k, float("nan")))
        lines.append(f"| {lab} | {a:,.3f} | {b:,.3f} | {b / a if a else float('nan'):.2f}× |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--prompts", type=int, default=32, help="completions per process per step")
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--check-completions", type=int, default=32, help="global batch of the loss check")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--kl-mode", default="sampled")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--fast-generation", type=lambda s: s.lower() in ("1", "true", "yes"), default=None,
                    help="trainer's fast_generation (default: the trainer's own, on with CUDA; false = TRL's generate)")
    ap.add_argument("--grader-workers", type=int, default=None)
    ap.add_argument("--save", action="store_true", help="keep the final checkpoint export at the step cap")
    ap.add_argument("--output-dir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--compare", nargs=2, metavar=("ONE", "TWO"))
    opts = ap.parse_args(argv)
    if opts.compare:
        print(compare(*opts.compare))
        return
    t0 = time.perf_counter()
    tr, result = build(opts)
    tr.args.kl_mode = opts.kl_mode
    result["build_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    tr.train()
    result["train_wall_s"] = time.perf_counter() - t1
    result["summary"] = summarise(result, opts.warmup)
    result["fast_generator_stats"] = fast_generator_stats(tr)
    if int(os.environ.get("RANK", 0)) == 0:
        print("[summary] " + json.dumps(result["summary"]), flush=True)
        print(f"[engine] {result['engine']} fast_generator_stats={result['fast_generator_stats']}", flush=True)
        if opts.json:
            Path(opts.json).write_text(json.dumps(result, indent=1))
    tr.accelerator.wait_for_everyone()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
