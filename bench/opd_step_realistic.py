"""Realistic stage-two step bench: OPDTrainer (per lever) vs trl.DistillationTrainer on the formal batch.

``--case realistic`` (default): the formal recipe's batch, 32 prompts x G = 4 = 128 completions, cap 8,192 new
tokens, completion lengths drawn per sample from a long-tailed log-normal with EOS forced at the drawn length for
every generator alike (``bench/step_realism.py`` states the distribution and its source: 6.45% clip at the cap);
a Qwen2.5-1.5B-shaped student (151,936 rows, tied) and a Qwen2.5-7B-shaped teacher (hidden 3584, 28 layers, 28 heads,
4 KV heads, intermediate 18944, **152,064** rows, untied), random bf16 weights, prompts of 256 random words. The formal
teacher (JustRL-DeepSeek-1.5B) has the student's shape; the 7B-shaped teacher here is the heavier, stress case.
``--case short``: today's 32 x 1,024 forced bench (``bench/opd_step_bench.py``, its flags after ``--``).

Both trainers: ``per_device_train_batch_size`` = ``--micro-batch`` (8) and gradient accumulation 128 / 8 = 16, so
one generation call of 128 completions and 16 micro-batches of 8 through the update; gradient checkpointing,
bf16 autocast, AdamW, lr 1e-6, grad clip 1.0. TRL ``beta = 1``; ours sampled-token reverse KL + verifier reward.

TRL and the 152,064-row teacher: ``DistillationTrainer.__init__`` raises unless student and teacher
``config.vocab_size`` are equal. TRL gets the same teacher with its embedding and head cut to the student's 151,936
rows (``resize_token_embeddings``), what a TRL user has to do by hand; ours slices the heads to the shared range
itself (``OPDTrainer.shared_vocab``). The 128 rows dropped are 0.08% of the teacher head's work.

Pieces (``--pieces``), each written to ``--json`` as soon as measured (a cut run still reports), in this order:
  ours/<var>   OPDTrainer optimizer steps (``--warmup`` + ``--steps``; ``--warmup-micro N``: a warm-up is only the
               generation and N micro-steps, enough to compile the update's shapes) per variant;
               ``--variant-mode generation`` times only the generation call of the same batches (``<var>@gen``).
  trl_update   TRL optimizer step on the same batch: its generation phase hands back the completions ours decoded
               for that batch (same process) or runs the fast decoder (``trainers.fast_generation``) on TRL's trainer, with the same drawn
               lengths; so TRL's teacher / update phases are measured on the exact realistic batch.
  trl_gen      TRL's own HF generate over the same batch, cut after ``--trl-gen-budget-s`` (``max_time``); the
               rest is extrapolated from its step-time trace (a + b x step, fitted: the dynamic cache grows by one
               token a step), flagged ``extrapolated``. TRL's step = trl_gen + trl_update's step - its generation.
Batch k has the same drawn lengths in every trainer and every call (seeded), so pieces of separate calls combine:
``--merge a.json b.json`` prints the combined table.
Variants (``--variants base,compact,compile,grow,async,liger,all``, or levers joined by '+'): OPDConfig overrides;
``base`` = every lever field present off (the static decoder; otherwise fast generation, compiled layers);
``compact`` = ``decode_compaction`` alone (the KV cache at full size: as shipped before RESULTS run 9); ``grow`` =
``decode_kv_growth`` (the KV cache sized to the window; it needs ``compact``: ``compact+grow``, the trainer as shipped
since run 9 and the default variant); a variant whose
field does not exist in this checkout is skipped with a note, one that fails (to build or to run) is recorded
with its error and the next one runs. ``async``: this bench steps the trainer by hand, outside ``Trainer.train()``,
where the prefetch lives, so it shows no overlap; time async with ``opd_step_bench.py --train-steps N
--async-generation``. Floor: ``step_realism.decode_floor`` at the bandwidth measured in the
run (device-to-device copy); generation/floor per generation measured. Each variant's ``decode_kv`` (printed): the
decoder KV cache of its last generation call, measured (``DecodeKV.peak_bytes``) and expected (``kv_cache.window_path``
on that batch's lengths), against its full size B x L.

usage: python bench/opd_step_realistic.py --variants base --warmup 1 --warmup-micro 1 --pieces ours --json a.json
       python bench/opd_step_realistic.py --variants compact,compact+grow --warmup 1 --warmup-micro 1 --pieces ours
       python bench/opd_step_realistic.py --pieces trl_update,trl_gen --warmup 1 --json b.json
       python bench/opd_step_realistic.py --merge a.json b.json
       python bench/opd_step_realistic.py --device cpu --tiny --steps 1 --warmup 0      (CPU smoke test)
       python bench/opd_step_realistic.py --case short -- --steps 2 --modes sampled --compiled-variant
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import gc
import json
import math
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

import opd_step_bench as sb  # noqa: E402
import step_realism as sr  # noqa: E402

from data_tools.formal_models import QWEN25_7B_INSTRUCT, shape_kwargs  # noqa: E402

QWEN7B = shape_kwargs(QWEN25_7B_INSTRUCT)
TINY_TEACHER = dict(hidden_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=192, vocab_size=sb.TINY["vocab_size"] + 128, tie_word_embeddings=False,
                    rope_theta=1e6, max_position_embeddings=4096, rms_norm_eps=1e-6)

#: --pair: (student shape, teacher shape). The formal pair is one shape twice (JustRL-DeepSeek-1.5B is the student
#: after RL); qwen25-7b puts a Qwen2.5-7B-shaped teacher beside it (the stress case).
PAIRS = {"formal": (sb.QWEN15, sb.QWEN15), "qwen25-7b": (sb.QWEN15, QWEN7B)}
#: ``spgN`` in a variant: the rollout batch updated in N optimizer steps (``steps_per_generation`` N, its
#: gradient_accumulation_steps divided by N), timed as one row: the generation and all N updates.
SPG = re.compile(r"spg(\d+)")
#: lever -> (OPDConfig field, value when on, value when off); names fixed by the bench's plan (bench/RESULTS.md).
LEVERS = {"compact": ("decode_compaction", True, False), "compile": ("decode_compile", True, False),
          "grow": ("decode_kv_growth", True, False), "async": ("async_generation", True, False),
          "liger": ("head_kernel", "liger", "trl")}


def variant_overrides(names: list[str]) -> tuple[dict[str, dict], list[str]]:
    """``{variant: OPDConfig overrides}`` for the requested names, and notes for the skipped ones."""
    from trainers.opd_config import OPDConfig

    fields = OPDConfig.__dataclass_fields__
    off = {f: v_off for f, _, v_off in LEVERS.values() if f in fields}
    out, notes = {}, []
    for name in names:
        if name == "base":
            out[name] = dict(off)
        elif name == "all":
            on = {f: v_on for f, v_on, _ in LEVERS.values() if f in fields}
            if on:
                out[name] = {**off, **on}
            else:
                notes.append("all: skipped, no lever field exists in OPDConfig")
        elif all(part in LEVERS or SPG.fullmatch(part) for part in name.split("+")):  # levers joined by '+'
            parts = name.split("+")
            levers = [LEVERS[part] for part in parts if part in LEVERS]
            spg = [int(SPG.fullmatch(part).group(1)) for part in parts if SPG.fullmatch(part)]
            missing = [f for f, _, _ in levers if f not in fields] + (
                ["steps_per_generation"] if spg and "steps_per_generation" not in fields else [])
            if missing:
                notes.append(f"{name}: skipped, OPDConfig has no field {missing!r} in this checkout")
            else:
                out[name] = {**off, **{f: v_on for f, v_on, _ in levers},
                             **({"steps_per_generation": spg[-1]} if spg else {})}
        else:
            raise SystemExit(f"unknown variant {name!r}: choose from base, {', '.join(LEVERS)}, spgN (or several "
                             "joined by '+', e.g. compact+compile, compact+grow+compile+spg4), all")
    return out, notes


class GADriver(sb.Driver):
    """``opd_step_bench.Driver`` (whose step runs the gradient_accumulation_steps micro-batches of one generation)
    with a partial warm-up, and a rollout batch of several optimizer steps."""

    def rollout(self, tokens_expected: int) -> dict:
        """One rollout batch: ``steps_per_generation`` optimizer steps (the first generates). Seconds summed over
        them, peaks their maximum, each step's seconds in ``update_steps_s``."""
        k = getattr(self.tr.args, "steps_per_generation", 1)
        rows = [self.step(tokens_expected) for _ in range(k)]
        r = dict(rows[0])
        for key in ("step", "generation", "teacher", "reward", "loss", "update_incl_teacher", "update"):
            r[key] = sum(x[key] for x in rows)
        for key in ("peak_gib", "raw_peak_gib"):
            r[key] = max(x[key] for x in rows)
        r["grad_norm"] = rows[-1]["grad_norm"]
        r["updates"], r["update_steps_s"] = k, [x["step"] for x in rows]
        return r

    def partial_warmup(self, micro: int) -> float:
        """Warm-up of ``micro`` micro-steps (the generation, compilation of the update's shapes) and no optimizer
        step; the trainer's micro-step counter and buffered batch are reset so the next step generates anew.
        Returns its seconds."""
        tr = self.tr
        t0 = time.perf_counter()
        for _ in range(micro):
            tr.training_step(tr.model, next(self.it), None)
        tr.model.zero_grad(set_to_none=True)
        tr._step, tr._buffered_inputs = 0, None
        sb.sync()
        self.timer.take()
        return time.perf_counter() - t0



def common_args(opts) -> dict:
    ga = opts.completions // opts.micro_batch
    if ga * opts.micro_batch != opts.completions:
        raise SystemExit(f"--micro-batch {opts.micro_batch} must divide {opts.completions} completions")
    return dict(per_device_train_batch_size=opts.micro_batch, gradient_accumulation_steps=ga,
                max_completion_length=opts.cap, gradient_checkpointing=True, bf16=opts.device == "cuda",
                learning_rate=1e-6, temperature=1.0, generation_kwargs={"min_new_tokens": opts.cap}, report_to=[],
                logging_steps=1, save_strategy="no", dataloader_num_workers=0, seed=0, use_cpu=opts.device == "cpu",
                max_grad_norm=1.0)


def build_trl(opts, tok, student, teacher, prompts, out_dir):
    """TRL trainer on a teacher cut to the student's rows (TRL refuses unequal vocab sizes); generation switchable."""
    from datasets import Dataset
    from trl import DistillationConfig, DistillationTrainer

    from trainers.fast_generation import fast_generate_single_turn

    t = copy.deepcopy(teacher)
    t.resize_token_embeddings(student.config.vocab_size, mean_resizing=False)
    args = DistillationConfig(output_dir=str(out_dir / "trl"), beta=1.0, max_steps=10**6, **common_args(opts))
    tr = DistillationTrainer(model=copy.deepcopy(student), teacher_model=t, args=args,
                             train_dataset=Dataset.from_dict({"prompt": prompts * 20}), processing_class=tok)
    tr._bench_fast = False
    tr._bench_replay = None  # completions to hand back instead of generating (ours' of the same batch)

    def gen(prompt_ids, images, multimodal_fields, has_tool_images=False):
        if tr._bench_replay is not None:
            return [list(c) for c in tr._bench_replay]
        if tr._bench_fast:
            return fast_generate_single_turn(tr, prompt_ids)
        return DistillationTrainer._generate_single_turn(tr, prompt_ids, images, multimodal_fields, has_tool_images)

    tr._generate_single_turn = gen
    return tr


def build_ours(opts, tok, student, teacher, prompts, out_dir, overrides: dict):
    from datasets import Dataset

    from trainers.opd_config import OPDConfig
    from trainers.opd_trainer import OPDTrainer

    P = opts.completions // opts.G
    rows = {"prompt": [], "teacher_prompt": [], "answer": [], "problem_id": [], "bucket": [], "curriculum_index": []}
    for i, p in enumerate(prompts[:P] * 20):
        rows["prompt"].append(p)
        rows["teacher_prompt"].append(p)
        rows["answer"].append("42")
        rows["problem_id"].append(f"p{i}")
        rows["bucket"].append(0)
        rows["curriculum_index"].append(i)
    common = common_args(opts)
    spg = overrides.get("steps_per_generation", 1)
    if common["gradient_accumulation_steps"] % spg:
        raise SystemExit(f"spg{spg}: {opts.completions} completions in micro-batches of {opts.micro_batch} do not "
                         f"split into {spg} optimizer steps")
    common["gradient_accumulation_steps"] //= spg
    args = OPDConfig(output_dir=str(out_dir / "opd"), num_generations=opts.G, kl_mode="sampled",
                     teacher_context="teacher", w_kl=1.0, w_reward=1.0, model_dtype="bfloat16", save_rollouts=False,
                     ckpt_every_minutes=0, resume=False, max_wall_time_seconds=10**7, deadline_reserve_seconds=0,
                     fast_generation=True, grader_workers=opts.grader_workers, **common, **overrides)
    return OPDTrainer(model=copy.deepcopy(student), teacher_model=teacher, args=args,
                      train_dataset=Dataset.from_dict(rows), processing_class=tok, teacher_processing_class=tok)


def fit_extrapolate(trace: list[tuple[int, float]], total_steps: int) -> float:
    """Seconds to decode ``total_steps`` from a (step, seconds-since-start) trace: least-squares step time a + b t
    over the trace's intervals, integrated over [0, total_steps).

    Intervals of fewer than 32 steps (the tail cut by ``max_time``) are left out when longer ones exist, and so is the first one when
    others remain (it carries the first steps' one-off costs). A dynamic KV cache grows by one token a step, so
    the step time cannot fall with t: a fitted b < 0 is warm-up noise, and then b = 0 with a = the kept
    intervals' mean step time, a lower bound of the true time (``fit_is_lower_bound``).
    """
    return _fit(trace, total_steps)[0]


def fit_is_lower_bound(trace: list[tuple[int, float]], total_steps: int) -> bool:
    """True when ``fit_extrapolate`` had to clamp a falling step time (its result is then a lower bound)."""
    return _fit(trace, total_steps)[1]


def _fit(trace, total_steps) -> tuple[float, bool]:
    every = [(s0, s1, (t1 - t0) / (s1 - s0)) for (s0, t0), (s1, t1) in zip(trace, trace[1:]) if s1 > s0]
    pts = [p for p in every if p[1] - p[0] >= 32] or every  # a short trace (CPU smoke) keeps what it has
    if len(pts) > 1:
        pts = pts[1:]
    if not pts:
        return float("nan"), False
    xs = [(a + b) / 2 for a, b, _ in pts]
    ys = [y for _, _, y in pts]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else 0.0
    a = my - b * mx
    clamped = b < 0
    if clamped:
        a, b = my, 0.0
    s_end, t_end = trace[-1]
    return t_end + a * (total_steps - s_end) + b * (total_steps**2 - s_end**2) / 2, clamped


class TracingProcessor:
    """HF logits processor recording (new-token index, seconds) every ``every`` steps (host clock: HF generate
    synchronises every step on its stopping check)."""

    def __init__(self, every: int = 256):
        self.every, self.p0, self.t0, self.trace = every, None, None, []

    def __call__(self, input_ids, scores):
        if self.p0 is None:
            self.p0, self.t0 = input_ids.shape[1], time.perf_counter()
        t = input_ids.shape[1] - self.p0
        now = time.perf_counter() - self.t0
        if t % self.every == 0:
            self.trace.append((t, now))
        self.last = (t, now)
        return scores

    def full_trace(self) -> list[tuple[int, float]]:
        """The trace with the last step seen appended (where a cut generation stopped)."""
        last = getattr(self, "last", None)
        return self.trace + ([last] if last and (not self.trace or last[0] > self.trace[-1][0]) else [])


def record(trainer, store: dict, forced: sr.ForcedLengths) -> None:
    """Keep each batch's completions of ``trainer`` in ``store[batch_id]`` (outside the timed region)."""
    inner = trainer._generate_single_turn

    def wrapped(prompt_ids, *a, **k):
        out = inner(prompt_ids, *a, **k)
        store[forced.calls[-1]["batch"]] = [list(c) for c in out]
        return out

    trainer._generate_single_turn = wrapped


def measure_generation(trainer, timer, prompt_ids, forced: sr.ForcedLengths, batch_id: int) -> dict:
    """Time one generation call of batch ``batch_id``; peak GiB = resident tensors + the rise during the call."""
    cuda = torch.cuda.is_available()
    forced.batch_id = batch_id
    sb.sync()
    base = torch.cuda.memory_allocated() if cuda else 0
    resident = sb.resident_bytes(trainer) if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    timer.take()
    out = trainer._generate_single_turn(prompt_ids, None, {})
    ph = timer.take()
    call = forced.calls[-1]
    peak = (torch.cuda.max_memory_allocated() - base + resident) / 2**30 if cuda else 0.0
    return {"generation": ph.get("generation", 0.0), "tokens": call["tokens"], "mismatched": call["mismatched"],
            "rows": len(out), "peak_gib": peak}


def decode_kv_report(gen, lengths: list[int], prompt_len: int, cap: int, kv_tok: int) -> dict | None:
    """The decoder KV cache of ``gen``'s last call (a batch of ``lengths``, prompts left-padded to ``prompt_len``).

    ``peak_gib``: ``DecodeKV.peak_bytes`` (a reallocation's transient included); ``expected_gib``: the steady
    peak ``window_path`` gives for these lengths with ``gen``'s buckets (``max(b x cap)`` with growth, ``B x L``
    without); ``full_gib``: B x L, the cache without growth. None if ``gen`` made no call (e.g. async variants).
    """
    from data_tools.generation.kv_cache import kv_peak_bytes, window_path

    last = getattr(gen, "last", None) or {}
    if "kv_peak_bytes" not in last:
        return None
    B = len(lengths)
    L = math.ceil((prompt_len + cap) / gen.len_bucket) * gen.len_bucket
    growth = gen.kv_growth and gen.compaction
    expected = B * L * kv_tok
    if gen.compaction:
        path = window_path(prompt_len, lengths, cap, L, check_every=gen.check_every, attn_bucket=gen.attn_bucket,
                           min_batch_bucket=gen.min_batch_bucket, growth=growth)
        expected = kv_peak_bytes(path, B, growth, kv_tok)
    return {"growth": growth, "peak_gib": last["kv_peak_bytes"] / 2**30, "expected_gib": expected / 2**30,
            "full_gib": B * L * kv_tok / 2**30, "reallocations": last.get("reallocations", 0),
            "windows": [list(w) for w in last.get("windows", [])]}


def summarize(rows: list[dict]) -> dict:
    return sb.median_row(rows) if rows else {}


def run_realistic(opts) -> dict:
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return _run_realistic(opts)
    finally:  # a caller in the same process (the tests) keeps transformers' warnings
        hf_logging.set_verbosity(verbosity)


def _run_realistic(opts) -> dict:
    dev, cuda = opts.device, opts.device == "cuda"
    s_shape, t_shape = (sb.TINY, TINY_TEACHER) if opts.tiny else PAIRS[opts.pair]
    variants, notes = variant_overrides([v for v in opts.variants.split(",") if v])
    for n in notes:
        print("variant " + n, flush=True)
    tok = sb.build_tokenizer(s_shape["vocab_size"])
    tflops, bw = sb.matmul_tflops(dev), sr.hbm_bandwidth(dev)
    print(f"bf16 matmul {tflops:.0f} TFLOP/s, HBM copy {bw / 1e12:.2f} TB/s", flush=True)
    student = sb.build_model(s_shape, tok, 1, dev)
    teacher = sb.build_model(t_shape, tok, 2, dev)
    n_s = sum(p.numel() for p in student.parameters())
    n_t = sum(p.numel() for p in teacher.parameters())
    prompts = sb.make_prompts(opts.completions, opts.prompt_len, s_shape["vocab_size"], 0)
    out_dir = Path(tempfile.mkdtemp(prefix="opd_real_"))  # trainers' output dirs (nothing kept): removed at the end
    try:
        return _run(opts, dev, cuda, variants, notes, tok, tflops, bw, student, teacher, n_s, n_t, prompts, out_dir)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def _run(opts, dev, cuda, variants, notes, tok, tflops, bw, student, teacher, n_s, n_t, prompts, out_dir) -> dict:
    sb._patch_grader()
    eos = tok.eos_token_id
    w_bytes, kv_tok = sr.weight_bytes(student), sr.kv_bytes_per_token(student.config)
    res = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "transformers": __import__("transformers").__version__, "trl": __import__("trl").__version__,
           "argv": sys.argv[1:], "matmul_tflops": tflops, "hbm_bytes_per_s": bw, "student_params": n_s,
           "teacher_params": n_t, "student_rows": student.config.vocab_size, "teacher_rows": teacher.config.vocab_size,
           "batch": {"completions": opts.completions, "G": opts.G, "cap": opts.cap, "prompt_len": opts.prompt_len,
                     "micro_batch": opts.micro_batch, "grad_accum": opts.completions // opts.micro_batch},
           "lengths": {"distribution": f"log-normal, sigma {opts.sigma}, mu solved for P(L > cap) = {opts.clip_rate}",
                       "source": "docs/design.md section 1: 6.45% of MATH-500 samples clipped at a 12,288 cap, scaled to "
                                 "the bench cap; sigma assumed (bench/step_realism.py)", "seed": opts.seed},
           "variant_notes": notes, "pieces": {}, "floor": {}, "timed_batch": opts.warmup}

    def save():
        if opts.json:
            Path(opts.json).write_text(json.dumps(res, indent=1, default=str))

    def batch_stats(batch_id):
        lens, clip = sr.draw_lengths(opts.completions, opts.cap, opts.seed, batch_id, opts.clip_rate, opts.sigma)
        return lens, clip

    def floor_for(batch_id, prompt_lens):
        lens, clip = batch_stats(batch_id)
        f = sr.decode_floor(lens, prompt_lens, w_bytes, kv_tok, bw)  # NaN seconds off CUDA
        f.update(completion_tokens=sum(lens), clipped=sum(clip), max_len=max(lens),
                 mean_len=sum(lens) / len(lens))
        res["floor"][str(batch_id)] = f
        return f

    def mfu(row, batch_id, prompt_lens):
        if not (tflops == tflops) or not row:
            return {}
        lens, _ = batch_stats(batch_id)
        useful = sum(lens) + sum(prompt_lens)
        padded = len(lens) * (max(prompt_lens) + max(lens))
        flops = (6 * n_s + 2 * n_t)
        t = row["update_incl_teacher"]
        return {"mfu_useful": flops * useful / t / (tflops * 1e12), "mfu_padded": flops * padded / t / (tflops * 1e12)}

    pieces = set(opts.pieces.split(","))
    if not pieces or not pieces <= {"ours", "trl_update", "trl_gen"}:
        raise SystemExit(f"--pieces: comma-separated of ours, trl_update, trl_gen; got {opts.pieces!r}")
    forced_cls = lambda: sr.ForcedLengths(opts.cap, eos, opts.seed, opts.clip_rate, opts.sigma)  # noqa: E731
    tokens_of = lambda b: sum(batch_stats(b)[0])  # noqa: E731
    with sr.fast_generator_hook():
        # ---- TRL (built first: its teacher is copied before ours compiles the shared one's layers) ----
        trl = None
        if not opts.skip_trl and ({"trl_update", "trl_gen"} & pieces):
            trl = build_trl(opts, tok, student, teacher, prompts, out_dir)
            d_trl = GADriver("trl", trl, trl.teacher_model)
            f_trl = forced_cls()
            sr.install_forced(trl, f_trl)
            trl_prompt_ids = trl._tokenize_prompts(prompts[: opts.completions])[0]
        # ---- ours, per variant ----
        res["pieces"]["ours"] = {}
        ours_prompt_lens = None
        replay: dict[int, list[list[int]]] = {}  # batch id -> completions of the first variant (for TRL's update)
        for name, ov in (variants.items() if "ours" in pieces else ()):
            t_build = time.perf_counter()
            try:
                tr = build_ours(opts, tok, student, teacher, prompts, out_dir, ov)
            except Exception as e:  # noqa: BLE001 - e.g. head_kernel=liger without liger_kernel: recorded, next variant
                if opts.fail_fast:
                    raise
                res["pieces"]["ours"][name if opts.variant_mode == "step" else name + "@gen"] = {
                    "overrides": ov, "mode": opts.variant_mode, "error": f"{type(e).__name__}: {e}", "rows": [],
                    "median": {}}
                print(f"ours/{name} could not be built: {type(e).__name__}: {e}", flush=True)
                save()
                continue
            d = GADriver(name, tr, tr.teacher_model)
            f = forced_cls()
            sr.install_forced(tr, f)
            if not replay:
                record(tr, replay, f)
            pids = tr._tokenize_prompts([p for p in prompts[: opts.completions // opts.G] for _ in range(opts.G)])[0]
            ours_prompt_lens = [len(p) for p in pids]
            piece = {"overrides": ov, "mode": opts.variant_mode, "build_s": time.perf_counter() - t_build, "rows": []}
            key = name if opts.variant_mode == "step" else name + "@gen"
            res["pieces"]["ours"][key] = piece
            try:  # a variant that fails (e.g. a lever's decoder the forcing hook cannot follow) is reported
                for i in range(opts.warmup + opts.steps):
                    if i < opts.warmup and opts.warmup_micro and opts.variant_mode == "step":
                        n0 = len(f.calls)
                        w = d.partial_warmup(opts.warmup_micro)
                        piece["rows"].append({"batch": i, "warmup": True, "partial_warmup_s": w,
                                              "micro_steps": opts.warmup_micro,
                                              "mismatched": sum(c["mismatched"] for c in f.calls[n0:])})
                        print(f"ours/{name} batch {i}: partial warm-up ({opts.warmup_micro} micro-steps) {w:.1f} s",
                              flush=True)
                        save()
                        continue
                    if opts.variant_mode == "generation":
                        r = measure_generation(tr, d.timer, pids, f, i)
                    else:
                        n0 = len(f.calls)
                        r = d.rollout(tokens_of(i))  # batch i (f.batch_id advances per generation call)
                        r["mismatched"] = sum(c["mismatched"] for c in f.calls[n0:])
                        r["generation_calls"] = [c["batch"] for c in f.calls[n0:]]
                    r["batch"], r["warmup"] = i, i < opts.warmup
                    fl = floor_for(i, ours_prompt_lens)
                    r["gen_over_floor"] = r["generation"] / fl["seconds"] if fl["seconds"] else float("nan")
                    if opts.variant_mode == "step":
                        r.update(mfu(r, i, ours_prompt_lens))
                    piece["rows"].append(r)
                    print(f"ours/{name} batch {i} ({'warm-up' if i < opts.warmup else 'timed'}): " + ", ".join(
                        f"{k2}={v:.3f}" for k2, v in r.items() if isinstance(v, float)), flush=True)
                    save()
            except Exception as e:  # noqa: BLE001 - recorded in the JSON, the next variant still runs
                import traceback

                piece["error"] = f"{type(e).__name__}: {e}"
                piece["traceback"] = traceback.format_exc()[-4000:]
                print(f"ours/{name} failed: {piece['error']}", flush=True)
                if opts.fail_fast:
                    raise
            piece["median"] = summarize([r for r in piece["rows"] if not r["warmup"]])
            g = getattr(tr.model, "_opd_fast_generator", None)
            piece["fast_generator_stats"] = dict(g.stats) if g else None
            if g is not None and f.calls and ours_prompt_lens:
                tok_bytes = sr.kv_bytes_per_token(tr.model.config, next(tr.model.parameters()).element_size())
                kvr = decode_kv_report(g, batch_stats(f.calls[-1]["batch"])[0], max(ours_prompt_lens), opts.cap,
                                       tok_bytes)
                piece["decode_kv"] = kvr
                if kvr:
                    print(f"ours/{name} decode KV cache (batch {f.calls[-1]['batch']}): "
                          f"peak {kvr['peak_gib']:.2f} GiB, expected {kvr['expected_gib']:.2f}, "
                          f"full size {kvr['full_gib']:.2f}, {kvr['reallocations']} reallocations", flush=True)
            # Free this variant's student, grads and optimizer state even if a cache (dynamo guards, closures)
            # still references the trainer; the teacher is shared and stays.
            if tr.optimizer is not None:
                tr.optimizer.state.clear()
            for prm in tr.model.parameters():
                prm.grad = None
                prm.data = torch.empty(0, dtype=prm.dtype, device=prm.device)
            del tr, d
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            piece["allocated_after_gib"] = torch.cuda.memory_allocated() / 2**30 if cuda else 0.0
            save()
        # ---- TRL's update on the same batches (their completions replayed, or decoded by the fast decoder) -------
        if trl is not None and "trl_update" in pieces:
            rows = []
            for k in range(opts.trl_update_steps):
                b = opts.warmup + k  # the batches of ours' timed steps
                f_trl.batch_id = b
                trl._bench_replay = replay.get(b)
                trl._bench_fast = trl._bench_replay is None
                r = d_trl.step(tokens_of(b))
                trl._bench_replay, trl._bench_fast = None, False
                r["mismatched"] = f_trl.calls[-1]["mismatched"]
                r["batch"], r["generation_source"] = b, "replay of ours" if b in replay else "trainers.fast_generation"
                rows.append(r)
                print("trl_update step: " + ", ".join(f"{k2}={v:.3f}" for k2, v in r.items()
                                                      if isinstance(v, float)), flush=True)
            med = summarize(rows)
            med.update(mfu(med, opts.warmup, [len(p) for p in trl_prompt_ids]))
            res["pieces"]["trl_update"] = {"rows": rows, "median": med,
                                           "note": "TRL's teacher / update phases on the realistic batch; its "
                                                   "generation phase here is a replay or our decoder, not TRL's"}
            save()
        # ---- TRL's own generation (budgeted) ----
        if trl is not None and "trl_gen" in pieces and opts.trl_gen_budget_s > 0:
            gcfg = trl.generation_config
            old_max_time = getattr(gcfg, "max_time", None)
            gcfg.max_time = opts.trl_gen_budget_s
            tracer = TracingProcessor()
            trl._bench_processors = [tracer]  # install_forced's generate wrapper adds it after the forcing one
            try:
                r = measure_generation(trl, d_trl.timer, trl_prompt_ids, f_trl, opts.warmup)
            finally:
                gcfg.max_time = old_max_time
                trl._bench_processors = None
            steps_needed = max(batch_stats(opts.warmup)[0])
            trace = tracer.full_trace()
            done = trace[-1][0] + 1 if trace else 0  # tokens decoded when it stopped
            cut = r["mismatched"] > 0
            r.update(trace=trace, extrapolated=cut, steps_needed=steps_needed, steps_done=done)
            if cut:  # measured time to the cut + the fitted time of the steps it did not decode
                r["generation_measured"] = r["generation"]
                r["peak_gib_at_cut"] = r["peak_gib"]
                fit = fit_extrapolate(trace, steps_needed)
                if math.isnan(fit):  # cut before a second traced step: the measured mean step time (prefill in it)
                    r["generation"] += r["generation_measured"] / max(done, 1) * (steps_needed - done)
                    r["extrapolation"] = "measured mean step time (fewer than two traced steps)"
                else:
                    r["generation"] += fit - trace[-1][1]
                    r["extrapolation"] = "fitted step time"
                r["extrapolation_is_lower_bound"] = fit_is_lower_bound(trace, steps_needed)
            fl = floor_for(opts.warmup, [len(p) for p in trl_prompt_ids])
            r["gen_over_floor"] = r["generation"] / fl["seconds"] if fl["seconds"] else float("nan")
            res["pieces"]["trl_gen"] = r
            save()
    finish(res)
    save()
    print("\n" + res["table"], flush=True)
    return res


def finish(res: dict) -> dict:
    """TRL's composite step (its own generation + its update on the same batch) and the table, from ``res`` alone."""
    p = res["pieces"]
    if "trl_update" in p:
        upd = p["trl_update"]["median"]
        g = p.get("trl_gen", {})
        gen = g.get("generation", float("nan"))
        res["trl_step_composite"] = {
            "generation": gen, "teacher": upd["teacher"], "update": upd["update"],
            "update_incl_teacher": upd["update_incl_teacher"], "reward": upd["reward"],
            "step": gen + upd["step"] - upd["generation"],
            "peak_gib": max(upd["peak_gib"], g.get("peak_gib", 0.0)),
            **{k: upd[k] for k in ("mfu_useful", "mfu_padded") if k in upd}}
    res["table"] = table(res)
    return res


def merge(paths: list[str]) -> dict:
    """One result from the JSONs of several calls (pieces of later files win), with its table."""
    out = None
    for path in paths:
        r = json.loads(Path(path).read_text())
        if out is None:
            out = r
            continue
        for k, v in r["pieces"].items():
            if k == "ours":
                out["pieces"].setdefault("ours", {}).update(v)
            else:
                out["pieces"][k] = v
        out["floor"].update(r.get("floor", {}))
        out["variant_notes"] = sorted(set(out.get("variant_notes", [])) | set(r.get("variant_notes", [])))
        out.setdefault("merged_argv", [out["argv"]]).append(r["argv"])
    return finish(out)


def table(res: dict) -> str:
    """Markdown: one row per trainer / variant (medians of timed rows)."""
    fl = res["floor"].get(str(res.get("timed_batch", 0)), {})
    lines = [f"realistic step: {res['batch']['completions']} completions, cap {res['batch']['cap']}, "
             f"micro-batch {res['batch']['micro_batch']} x GA {res['batch']['grad_accum']}; floor of the first "
             f"batch {fl.get('seconds', float('nan')):.2f} s ({fl.get('completion_tokens', 0):,} completion tokens, "
             f"{fl.get('clipped', 0)} clipped); HBM {res['hbm_bytes_per_s'] / 1e12:.2f} TB/s", "",
             "| trainer | generation s | teacher s | update s | update+teacher s | step s | step tok/s | gen / floor "
             "| peak GiB | MFU (useful / padded) | lengths ok | TRL step / this step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    trl_step = res.get("trl_step_composite", {}).get("step")

    def fmt(x, spec=".2f"):
        return "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

    def row(name, m, tokens, floor_s, ok):
        step = m.get("step")
        tps = tokens / step if step else None
        mf = f"{fmt(m.get('mfu_useful'), '.1%')} / {fmt(m.get('mfu_padded'), '.1%')}" if "mfu_useful" in m else ""
        gof = m.get("gen_over_floor")
        if gof is None and floor_s and m.get("generation"):
            gof = m["generation"] / floor_s
        ratio = trl_step / step if trl_step and step else None
        lines.append(f"| {name} | {fmt(m.get('generation'))} | {fmt(m.get('teacher'))} | {fmt(m.get('update'))} | "
                     f"{fmt(m.get('update_incl_teacher'))} | {fmt(step)} | {fmt(tps, ',.0f')} | {fmt(gof)} | "
                     f"{fmt(m.get('peak_gib'))} | {mf} | {ok} | {fmt(ratio)} |")

    tok = fl.get("completion_tokens", 0)
    fs = fl.get("seconds")
    if "trl_step_composite" in res:
        g = res["pieces"].get("trl_gen", {})
        if g.get("gen_over_floor") is not None:
            res["trl_step_composite"]["gen_over_floor"] = g["gen_over_floor"]
        ok = "cut, extrapolated" if g.get("extrapolated") else ("yes" if g else "")
        row("TRL (own generate + update)", res["trl_step_composite"], tok, fs, ok)
    for name, p in res["pieces"].get("ours", {}).items():
        m = p.get("median", {})
        ok = "yes" if all(r.get("mismatched", 0) == 0 for r in p["rows"]) else "NO"
        if p.get("error"):
            ok = "failed: " + p["error"][:60]
        row(f"ours/{name} ({p['mode']})", m, tok, fs, ok)
    for n in res.get("variant_notes", []):
        lines.append(f"\n{n}")
    return "\n".join(lines)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=("realistic", "short"), default="realistic")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny student / teacher / vocab (CPU test of the same code)")
    ap.add_argument("--pair", choices=sorted(PAIRS), default="formal",
                    help="formal: student and teacher both of DeepSeek-R1-Distill-Qwen-1.5B's shape (the formal pair: "
                         "the teacher is the student after RL); qwen25-7b: a tied Qwen2.5-1.5B student and a "
                         "Qwen2.5-7B-shaped teacher (the stress case of RESULTS run 10)")
    ap.add_argument("--completions", type=int, default=128, help="completions per rollout batch (ours: /G prompts x G)")
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--cap", type=int, default=8192, help="max new tokens")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=8, help="per_device_train_batch_size, both trainers")
    ap.add_argument("--clip-rate", type=float, default=sr.CLIP_RATE)
    ap.add_argument("--sigma", type=float, default=sr.SIGMA)
    ap.add_argument("--seed", type=int, default=0, help="seed of the drawn lengths")
    ap.add_argument("--variants", default="compact+grow",
                    help="comma-separated: base (every lever off), compact, compile, grow, async, liger, all, "
                         "or levers joined by '+' (compact+grow: as shipped; compact+grow+compile: the formal recipe)")
    ap.add_argument("--variant-mode", choices=("step", "generation"), default="step",
                    help="ours: whole optimizer steps, or only the generation call of the same batches")
    ap.add_argument("--warmup", type=int, default=1, help="ours: warm-up batches per variant")
    ap.add_argument("--steps", type=int, default=1, help="ours: timed batches per variant")
    ap.add_argument("--warmup-micro", type=int, default=0,
                    help="step mode: a warm-up is only this many micro-steps (generation + compilation, no "
                         "optimizer step); 0 = whole steps. Not for async_generation.")
    ap.add_argument("--trl-update-steps", type=int, default=1, help="TRL steps with the fast decoder (trainers.fast_generation)")
    ap.add_argument("--trl-gen-budget-s", type=float, default=240.0,
                    help="TRL's own generate: stop after this many seconds and extrapolate (0 = skip)")
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--pieces", default="ours,trl_update,trl_gen",
                    help="what to measure, in this order: ours (variants), trl_update, trl_gen")
    ap.add_argument("--grader-workers", type=int, default=None)
    ap.add_argument("--fail-fast", action="store_true", help="re-raise a variant's error (tests)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--merge", nargs="+", default=None, help="JSONs of earlier calls: print their combined table")
    opts = ap.parse_args(argv)
    if opts.merge:
        res = merge(opts.merge)
        if opts.json:
            Path(opts.json).write_text(json.dumps(res, indent=1, default=str))
        print(res["table"])
        return res
    if opts.case == "short":
        return sb.main(rest + (["--json", opts.json] if opts.json and "--json" not in rest else []))
    if opts.tiny and opts.cap == 8192:
        opts.cap = 64
    return run_realistic(opts)


if __name__ == "__main__":
    main()
