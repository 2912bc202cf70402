"""Step benchmark: OPDTrainer vs trl.DistillationTrainer, same process, same GPU, alternating steps.

Qwen2.5-1.5B-shaped random student and teacher (bf16), a generated WordLevel tokenizer of the same
vocabulary size, prompts of random words (256 tokens), 1,024 new tokens (``min_new_tokens`` = max
for both trainers, so random EOS samples never end a completion early; ``--forced-lengths`` instead ends each
completion at a drawn length), gradient checkpointing on.

Phases, timed by wrapping the trainers' methods with CUDA-synchronised timers:
  generation  ``_generate_single_turn`` (TRL: HF generate; ours: the fast decoder, trainers.fast_generation)
  reward      ours only: the verifier grading (``data_tools.grader.grade_batch``)
  teacher     teacher backbone forward (``_get_last_hidden_state`` called with the teacher)
  update      rest of the step: student forward/backward, both heads / losses, optimizer step
  step        whole optimizer step (batch fetch to optimizer step done)
Peak memory: a trainer's resident tensors at step start + the peak rise during its step, so the
other trainer's weights in the same process are not counted.

usage:  python bench/opd_step_bench.py [--device cuda] [--steps 3] [--warmup 1] [--modes sampled,full]
        python bench/opd_step_bench.py --device cpu --tiny          (CPU smoke test of the same code)
        python bench/opd_step_bench.py --train-steps 3 --skip-bench  (OPDTrainer.train() for N steps)
        python bench/opd_step_bench.py --train-steps 80 --skip-bench --compiled-variant --forced-lengths
            --new-tokens 1024 --train-json /tmp/memv/train.json     (memory over steps of varying lengths;
                                                 then python -m bench.memory_steps /tmp/memv/opd_train --skip 30)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

import step_realism as sr  # noqa: E402

from data_tools.formal_models import R1_DISTILL_QWEN_1P5B, shape_kwargs  # noqa: E402

#: The formal student's shape (DeepSeek-R1-Distill-Qwen-1.5B: untied head, rope_theta 1e4), defined once in
#: data_tools/formal_models.py.
QWEN15 = shape_kwargs(R1_DISTILL_QWEN_1P5B)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=2048, tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=4096, rms_norm_eps=1e-6)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def word(i: int) -> str:
    """Letters-only token string (no digits, so the grader finds no numeric answer in random text)."""
    s = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        s = chr(97 + r) + s
    return "q" + s


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for i in range(vocab_size - len(SPECIALS)):
        vocab[word(i)] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                  unk_token="<|endoftext|>", additional_special_tokens=SPECIALS[1:],
                                  chat_template=CHAT_TEMPLATE, padding_side="left")
    assert len(tok) == vocab_size
    return tok


def build_model(shape: dict, tok, seed: int, device):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**shape, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=None, attn_implementation="sdpa", use_cache=True)
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            m = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    m.generation_config.eos_token_id = tok.eos_token_id
    m.generation_config.pad_token_id = tok.pad_token_id
    return m


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab - len(SPECIALS), (n, length), generator=g)
    return [" ".join(word(int(i)) for i in row) for row in ids]


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class PhaseTimer:
    """Wraps a trainer's methods; accumulates synchronised seconds per phase for the current step."""

    def __init__(self, trainer, teacher):
        self.t = defaultdict(float)
        self.trainer = trainer
        orig_gen = trainer._generate_single_turn
        orig_hidden = trainer._get_last_hidden_state
        teacher_ids = {id(teacher)}

        def gen(*a, **k):
            sync()
            t0 = time.perf_counter()
            out = orig_gen(*a, **k)
            sync()
            self.t["generation"] += time.perf_counter() - t0
            return out

        def hidden(model, *a, **k):
            if id(model) not in teacher_ids and id(getattr(model, "module", None)) not in teacher_ids:
                return orig_hidden(model, *a, **k)
            sync()
            t0 = time.perf_counter()
            out = orig_hidden(model, *a, **k)
            sync()
            self.t["teacher"] += time.perf_counter() - t0
            return out

        trainer._generate_single_turn = gen
        trainer._get_last_hidden_state = hidden

    def take(self) -> dict:
        d = dict(self.t)
        self.t.clear()
        return d


_REWARD_T = defaultdict(float)


def _patch_grader():
    import data_tools.grader as gr

    orig = gr.grade_batch

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            _REWARD_T["reward"] += time.perf_counter() - t0

    gr.grade_batch = timed


def resident_bytes(trainer, extra_modules=()) -> int:
    """Bytes of CUDA tensors this trainer keeps between steps (weights, grads, optimizer state, gen cache)."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if isinstance(t, torch.Tensor) and t.is_cuda:
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()

    for m in (trainer.model, trainer.teacher_model, *extra_modules):
        for p in m.parameters():
            add(p.data)
            add(p.grad)
        for b in m.buffers():
            add(b)
    if trainer.optimizer is not None:
        for st in trainer.optimizer.state.values():
            for v in st.values():
                add(v)
    g = getattr(trainer.model, "_opd_fast_generator", None)
    st = getattr(g, "_state", None)
    if st is not None:
        for v in vars(st).values():
            add(v)
        for layer in getattr(st.cache, "layers", []):
            add(getattr(layer, "keys", None))
            add(getattr(layer, "values", None))
    return total


class Driver:
    """Runs optimizer steps of a (TRL-based) trainer by hand, as transformers' training loop does."""

    def __init__(self, name, trainer, teacher):
        from transformers.trainer_callback import ProgressCallback

        self.name, self.tr = name, trainer
        trainer.remove_callback(ProgressCallback)
        a = trainer.args
        trainer.model.train()
        if a.gradient_checkpointing:
            trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=a.gradient_checkpointing_kwargs)
            trainer.model.config.use_cache = False
        trainer.create_optimizer_and_scheduler(num_training_steps=10**6)
        trainer.current_gradient_accumulation_steps = a.gradient_accumulation_steps
        self.it = iter(trainer.get_train_dataloader())
        self.timer = PhaseTimer(trainer, teacher)
        self.rows: list[dict] = []

    def step(self, tokens_expected: int) -> dict:
        tr, a = self.tr, self.tr.args
        sync()
        base = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        resident = resident_bytes(tr) if torch.cuda.is_available() else 0
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        _REWARD_T.clear()
        self.timer.take()
        t0 = time.perf_counter()
        tr.callback_handler.on_step_begin(a, tr.state, tr.control)
        loss = 0.0  # one generation call feeds the gradient_accumulation_steps micro-batches (TRL's buffering)
        for _ in range(a.gradient_accumulation_steps):
            loss += float(tr.training_step(tr.model, next(self.it), None))
        gn = 0.0
        if a.max_grad_norm:
            gn = torch.nn.utils.clip_grad_norm_(tr.model.parameters(), a.max_grad_norm)
        tr.callback_handler.on_pre_optimizer_step(a, tr.state, tr.control)
        tr.optimizer.step()
        tr.lr_scheduler.step()
        tr.model.zero_grad(set_to_none=True)
        tr.state.global_step += 1
        tr.callback_handler.on_step_end(a, tr.state, tr.control)
        sync()
        step_s = time.perf_counter() - t0
        ph = self.timer.take()
        peak = (torch.cuda.max_memory_allocated() - base + resident) if torch.cuda.is_available() else 0
        row = {"step": step_s, "generation": ph.get("generation", 0.0), "teacher": ph.get("teacher", 0.0),
               "reward": _REWARD_T.get("reward", 0.0), "loss": float(loss), "grad_norm": float(gn),
               "peak_gib": peak / 2**30, "resident_gib": resident / 2**30,
               "raw_peak_gib": (torch.cuda.max_memory_allocated() / 2**30) if torch.cuda.is_available() else 0.0,
               "tokens": tokens_expected}
        row["update_incl_teacher"] = row["step"] - row["generation"] - row["reward"]
        row["update"] = row["update_incl_teacher"] - row["teacher"]
        return row


def matmul_tflops(device) -> float:
    if device != "cuda":
        return float("nan")
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        s.record()
        a @ b
        e.record()
        sync()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n**3 / statistics.median(times) / 1e12


def opd_subclass():
    """OPDTrainer routed through trainers.fast_generation (unless the trainer already has a fast-path flag)."""
    from trainers import fast_generation as generation
    from trainers.opd_config import OPDConfig
    from trainers.opd_trainer import OPDTrainer

    if "fast_generation" in OPDConfig.__dataclass_fields__:
        return OPDTrainer, True

    class FastGenOPDTrainer(OPDTrainer):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, has_tool_images=False):
            if not self.use_vllm and images is None and not multimodal_fields:
                out = generation.fast_generate_single_turn(self, prompt_ids)
                if out is not None:
                    return out
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, has_tool_images)

    return FastGenOPDTrainer, False


def build_trainers(opts, tok, student, teacher, prompts, out_dir):
    from datasets import Dataset
    from trl import DistillationConfig, DistillationTrainer

    from trainers.opd_config import OPDConfig

    N, B, G = opts.new_tokens, opts.prompts, opts.G
    common = dict(per_device_train_batch_size=B, gradient_accumulation_steps=1, max_completion_length=N,
                  gradient_checkpointing=True, bf16=opts.device == "cuda", learning_rate=1e-6, temperature=1.0,
                  generation_kwargs={"min_new_tokens": N}, report_to=[], logging_steps=1, save_strategy="no",
                  dataloader_num_workers=0, seed=0, use_cpu=opts.device == "cpu", max_grad_norm=1.0)
    trl_tr = None
    if not opts.skip_trl:
        trl_args = DistillationConfig(output_dir=str(out_dir / "trl"), beta=1.0, max_steps=10**6, **common)
        trl_ds = Dataset.from_dict({"prompt": prompts * 50})
        trl_tr = DistillationTrainer(model=copy.deepcopy(student), teacher_model=copy.deepcopy(teacher),
                                     args=trl_args, train_dataset=trl_ds, processing_class=tok)
    cls, native = opd_subclass()
    extra = {"fast_generation": True} if native else {}
    if "compile_layers" in OPDConfig.__dataclass_fields__:
        extra["compile_layers"] = False  # "ours" = eager layers; "ours+compiled" turns the trainer's flag on
    opd_args = OPDConfig(output_dir=str(out_dir / "opd"), num_generations=G, kl_mode=opts.modes[0],
                         teacher_context="teacher", w_kl=1.0, w_reward=1.0, model_dtype="bfloat16",
                         save_rollouts=False, ckpt_every_minutes=0, resume=False, max_wall_time_seconds=10**7,
                         deadline_reserve_seconds=0, grader_workers=opts.grader_workers, **common, **extra)
    P = B // G
    rows = {"prompt": [], "teacher_prompt": [], "answer": [], "problem_id": [], "bucket": [], "curriculum_index": []}
    for i, p in enumerate(prompts[:P] * 50):  # ours: B // G prompts x G samples = B completions per step
        rows["prompt"].append(p)
        rows["teacher_prompt"].append(p)
        rows["answer"].append("42")
        rows["problem_id"].append(f"p{i}")
        rows["bucket"].append(0)
        rows["curriculum_index"].append(i)
    opd_tr = cls(model=copy.deepcopy(student), teacher_model=copy.deepcopy(teacher), args=opd_args,
                 train_dataset=Dataset.from_dict(rows), processing_class=tok, teacher_processing_class=tok)
    variants = {"ours": opd_tr}
    if opts.compiled_variant:
        c_args = copy.deepcopy(opd_args)
        c_args.compile_layers = True
        opd_c = cls(model=copy.deepcopy(student), teacher_model=copy.deepcopy(teacher), args=c_args,
                    train_dataset=Dataset.from_dict(rows), processing_class=tok, teacher_processing_class=tok)
        variants["ours+compiled"] = opd_c
    return trl_tr, variants, cls.__name__ + (" (trainer flag)" if native else " (bench subclass)")


def median_row(rows: list[dict]) -> dict:
    keys = [k for k in rows[0] if isinstance(rows[0][k], (int, float))]
    return {k: statistics.median(r[k] for r in rows) for k in keys}


def report(results: dict, tflops: float, n_params: int, tokens_proc: int) -> str:
    lines = []
    for (mode, res), var in ((mr, v) for mr in results["modes"].items() for v in results["variants"]):
        ours, trl = res[var], res.get("trl")
        lines.append(f"\n### {var}, kl_mode={mode}  (median of {len(res[var + '_rows'])} steps; TRL: "
                     f"{len(res.get('trl_rows', []))} steps)\n")
        lines.append("| phase | ours s | TRL s | ours tok/s | TRL tok/s | tok/s ours/TRL |")
        lines.append("|---|---|---|---|---|---|")
        for ph in ("generation", "reward", "teacher", "update", "update_incl_teacher", "step"):
            o = ours[ph]
            t = trl[ph] if trl else float("nan")
            tok = ours["tokens"]
            ot = tok / o if o > 0 else float("nan")
            tt = tok / t if trl and t > 0 else float("nan")
            lines.append(f"| {ph} | {o:.3f} | {t:.3f} | {ot:,.0f} | {tt:,.0f} | {ot / tt if tt == tt and tt else float('nan'):.2f} |")
        tp = trl["peak_gib"] if trl else float("nan")
        pr = ours["peak_gib"] / tp if tp else float("nan")
        lines.append(f"| peak GiB (own tensors) | {ours['peak_gib']:.2f} | {tp:.2f} | | | ratio {pr:.2f} |")
        for who, r in ((var, ours), ("TRL", trl)):
            if not r:
                continue
            if not tflops == tflops:
                continue
            mfu = 6 * n_params * tokens_proc / r["update_incl_teacher"] / (tflops * 1e12)
            hfu = (10 * n_params * tokens_proc) / r["update_incl_teacher"] / (tflops * 1e12)
            lines.append(f"\n{who}: update MFU (6 x params x {tokens_proc} tokens / update incl. teacher) = {mfu:.1%}; "
                         f"counting recompute + teacher forward (10 x params x tokens) = {hfu:.1%}")
    return "\n".join(lines)


def run_bench(opts):
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    dev = opts.device
    shape = TINY if opts.tiny else QWEN15
    tok = build_tokenizer(shape["vocab_size"])
    tflops = matmul_tflops(dev)
    print(f"bf16 matmul 8192^3: {tflops:.0f} TFLOP/s", flush=True)
    student = build_model(shape, tok, 1, dev)
    teacher = build_model(shape, tok, 2, dev)
    n_params = sum(p.numel() for p in student.parameters())
    prompts = make_prompts(opts.prompts, opts.prompt_len, shape["vocab_size"], 0)
    out_dir = Path(tempfile.mkdtemp(prefix="opd_bench_"))
    _patch_grader()
    trl_tr, variants, opd_name = build_trainers(opts, tok, student, teacher, prompts, out_dir)
    opd_tr = variants["ours"]
    del student, teacher
    drivers = {}
    if trl_tr is not None:
        drivers["trl"] = Driver("trl", trl_tr, trl_tr.teacher_model)
    for name, tr in variants.items():
        drivers[name] = Driver(name, tr, tr.teacher_model)
    tokens = opts.prompts * opts.new_tokens
    tokens_proc = opts.prompts * (opts.prompt_len + opts.new_tokens)
    results = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
               "torch": torch.__version__, "transformers": __import__("transformers").__version__,
               "trl": __import__("trl").__version__, "opd_trainer": opd_name, "matmul_tflops": tflops,
               "student_params": n_params, "argv": sys.argv[1:], "variants": list(variants), "modes": {}}
    for mi, mode in enumerate(opts.modes):
        for tr in variants.values():
            tr.args.kl_mode = mode
        res = {f"{w}_rows": [] for w in drivers}
        trl_steps = opts.steps if (mi == 0 or opts.trl_each_mode) else 0
        warm_trl = opts.warmup if mi == 0 else 0
        n = opts.warmup + opts.steps
        for i in range(n):
            for who, d in drivers.items():
                if who == "trl" and (i < opts.warmup - warm_trl or i >= opts.warmup + trl_steps):
                    continue
                r = d.step(tokens)
                tag = "warm-up" if i < opts.warmup else "timed"
                print(f"[{mode}] {who} step {i} ({tag}): " + ", ".join(
                    f"{k}={v:.3f}" for k, v in r.items() if isinstance(v, float)), flush=True)
                if i >= opts.warmup:
                    res[f"{who}_rows"].append(r)
        for w in variants:
            res[w] = median_row(res[f"{w}_rows"])
        if res.get("trl_rows"):
            res["trl"] = median_row(res["trl_rows"])
        elif "sampled" in results["modes"] and results["modes"]["sampled"].get("trl"):
            res["trl"] = results["modes"]["sampled"]["trl"]  # TRL has one (full-vocab) mode
            res["trl_rows"] = results["modes"]["sampled"]["trl_rows"]
        results["modes"][mode] = res
        if opts.json:  # partial results survive a later failure or a time limit
            Path(opts.json).write_text(json.dumps(results, indent=1, default=str))
    g = getattr(opd_tr.model, "_opd_fast_generator", None)
    results["fast_generator_stats"] = dict(g.stats) if g else None
    table = report(results, tflops, n_params, tokens_proc)
    results["table"] = table
    print(f"\n## {results['date']}  {results['gpu']}  torch {results['torch']}  transformers "
          f"{results['transformers']}  trl {results['trl']}  ours: {opd_name}")
    print(f"student params {n_params / 1e9:.3f}B, {opts.prompts} completions x {opts.new_tokens} new tokens, "
          f"prompt {opts.prompt_len}, G={opts.G} (ours {opts.prompts // opts.G} prompts x G), bf16 matmul "
          f"{tflops:.0f} TFLOP/s")
    print(table, flush=True)
    if opts.json:
        Path(opts.json).write_text(json.dumps(results, indent=1, default=str))
    return results


def run_trainer(opts):
    """OPDTrainer.train() for a few steps on the 1.5B shape; step time and peak memory from its metrics."""
    from datasets import Dataset
    from transformers.utils import logging as hf_logging

    from trainers.opd_config import OPDConfig

    hf_logging.set_verbosity_error()
    shape = TINY if opts.tiny else QWEN15
    tok = build_tokenizer(shape["vocab_size"])
    student = build_model(shape, tok, 1, opts.device)
    teacher = build_model(shape, tok, 2, opts.device)
    prompts = make_prompts(opts.prompts // opts.G, opts.prompt_len, shape["vocab_size"], 1)
    rows = {"prompt": prompts * 20, "teacher_prompt": prompts * 20, "answer": ["42"] * (20 * len(prompts)),
            "problem_id": [f"p{i}" for i in range(20 * len(prompts))], "bucket": [0] * (20 * len(prompts)),
            "curriculum_index": list(range(20 * len(prompts)))}
    out = Path(opts.train_json).parent / "opd_train" if opts.train_json else Path(tempfile.mkdtemp(prefix="opd_train_"))
    cls, native = opd_subclass()
    extra = {"fast_generation": True} if native else {}
    if "compile_layers" in OPDConfig.__dataclass_fields__:
        extra["compile_layers"] = bool(opts.compiled_variant)  # --compiled-variant: the shipped default on CUDA
    if opts.async_generation:
        extra["async_generation"] = True  # lever (a): decode of step k+1 overlaps step k's update
    args = OPDConfig(output_dir=str(out), num_generations=opts.G, kl_mode=opts.modes[0], teacher_context="teacher",
                     model_dtype="bfloat16", per_device_train_batch_size=opts.prompts, gradient_accumulation_steps=1,
                     max_completion_length=opts.new_tokens,
                     generation_kwargs={} if opts.forced_lengths else {"min_new_tokens": opts.new_tokens},
                     gradient_checkpointing=True, bf16=opts.device == "cuda", report_to=[], debug_max_steps=opts.train_steps,
                     ckpt_every_minutes=0, resume=False, max_wall_time_seconds=3600, deadline_reserve_seconds=60,
                     use_cpu=opts.device == "cpu", grader_workers=opts.grader_workers, **extra)
    tr = cls(model=student, teacher_model=teacher, args=args, train_dataset=Dataset.from_dict(rows),
             processing_class=tok, teacher_processing_class=tok)
    forced, hook = None, contextlib.nullcontext()
    if opts.forced_lengths:  # each step's completions end at lengths drawn as the realistic bench's (step_realism)
        forced = sr.ForcedLengths(opts.new_tokens, tok.eos_token_id, seed=0, clip_rate=opts.clip_rate)
        sr.install_forced(tr, forced)
        hook = sr.fast_generator_hook()
    t0 = time.perf_counter()
    with hook:
        tr.train()
    wall = time.perf_counter() - t0
    lines = [json.loads(x) for x in args.metrics_path.read_text().splitlines() if x.strip()]
    keys = ("step", "time/step", "time/generation", "time/reward", "time/teacher", "time/update",
            "throughput/tokens_per_s", "memory/peak_gib", "memory/step_peak_gib", "memory/allocated_gib",
            "completions/mean_length", "loss", "engine", "async/staleness", "async/overlap_s",
            "async/wait_s", "async/generate_s", "sampling/importance_sampling_ratio/mean",
            "sampling/sampling_logp_difference/mean")
    summary = {"trainer": cls.__name__ + (" (flag)" if native else " (bench subclass)"), "wall_s": wall,
               "steps": [{k: r.get(k) for k in keys} for r in lines],
               "checkpoints": sorted(p.name for p in Path(args.ckpt_dir).glob("checkpoint-*")),
               "forced_lengths": forced.calls if forced else None}  # per generation call: batch, tokens, mismatched
    print(json.dumps(summary, indent=1), flush=True)
    if opts.train_json:
        Path(opts.train_json).write_text(json.dumps(summary, indent=1))
    return summary


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny model/vocab (CPU smoke test)")
    ap.add_argument("--prompts", type=int, default=32, help="completions per step (TRL: prompts; ours: prompts/G x G)")
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per trainer (median reported)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--modes", default="sampled,full")
    ap.add_argument("--trl-each-mode", action="store_true", help="re-time TRL for every mode (it has only one)")
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--compiled-variant", action="store_true",
                    help="also time OPDTrainer with torch.compile'd decoder layers (student: training only; teacher); "
                         "with --train-steps: train with them")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--train-steps", type=int, default=0, help=">0: also run OPDTrainer.train() for this many steps")
    ap.add_argument("--grader-workers", type=int, default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--train-json", default=None)
    ap.add_argument("--async-generation", action="store_true",
                    help="--train-steps only: OPDConfig.async_generation=True (one-step off-policy decode)")
    ap.add_argument("--forced-lengths", action="store_true",
                    help="--train-steps only: completions end at lengths drawn per row and step (a log-normal capped "
                         "at --new-tokens, bench/step_realism.py) instead of all at --new-tokens: the varying shapes "
                         "of a real run, for memory over many steps")
    ap.add_argument("--clip-rate", type=float, default=0.0645,
                    help="--forced-lengths: the share of completions drawn past the cap (they stop at it)")
    opts = ap.parse_args(argv)
    opts.modes = [m for m in opts.modes.split(",") if m]
    if opts.forced_lengths and (not opts.train_steps or opts.async_generation):
        ap.error("--forced-lengths needs --train-steps and no --async-generation (the forcing hook is the decoder's, "
                 "one call at a time)")
    if opts.clip_rate != ap.get_default("clip_rate") and not opts.forced_lengths:
        ap.error("--clip-rate is the drawn lengths' share past the cap: it needs --forced-lengths")
    if not 0.0 < opts.clip_rate < 1.0:
        ap.error(f"--clip-rate must lie in (0, 1), got {opts.clip_rate}")
    if opts.tiny and opts.device == "cpu":
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    res = None
    if not opts.skip_bench:
        res = run_bench(opts)
    if opts.train_steps:
        res = run_trainer(opts)
    return res


if __name__ == "__main__":
    main()
