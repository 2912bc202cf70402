"""Learning efficacy: which stage-two recipe makes a small student better per GPU second.

    python -m bench.learning --out DIR                       # the GPU experiment (all arms, defaults below)
    python -m bench.learning --out DIR --preset cpu_smoke    # seconds-long budgets, to check the plumbing on a CPU
    python -m bench.learning --out DIR --start_sft_steps 60 --arms d,d@3e-5,f,f@3e-5 --seeds 0,1 --deadline_s 460
                                         # regime (i) start, an lr sweep, two seeds; re-run until nothing is left

An orchestrator of the product's stages: every arm is a recipe, a ``stages.train`` config written to
``arms/<run>/train.yaml`` (``python -m stages.train --config`` runs it, less the marks); stage one of the
off-policy arms is a ``stages.curate`` config (``stage_one/curate.yaml``), evaluation a ``stages.evaluate``
protocol (``protocol.yaml``). Student: SmolLM2-135M-Instruct (embedded default, float32). Every arm gets
the same *training* seconds on its own clock (``bench.learning_clock.MarkClock``: exports at the marks pause it) and is
evaluated at the same marks on the same held-out problems:

    a  reward only              w_kl = 0, w_reward = 1 (GRPO-style group advantage)
    b  distillation only        w_kl = 1, w_reward = 0, the stronger teacher
    c  distillation + reward    w_kl = 1, w_reward = 1, the stronger teacher
    d  off-policy fine-tuning   stage one (the teacher samples the train problems; the grader keeps the verified
                                solutions), then SFT on them (every step off-policy); the sampling is on d's clock
    e  self-distillation        as c, the teacher is the frozen initial student reading the reference (OPSD)
    f  combined recipe          w_kl = 1, w_reward = 1, w_sft x cross-entropy on stage one's verified solutions
                                (the curriculum's teacher_solution column) and a share of off-policy seconds
                                scheduled over the arm's clock (trainers.offpolicy); stage one on f's clock
    g  self-distillation, hint  as e, the context holding the reference solution and the final answer stated
    h  combined, full KL        as f with the full-vocabulary reverse KL (kl_mode full)
    i  combined, hint teacher   as f with g's teacher: off-policy verified solutions early, then on-policy
                                distillation from the self-teacher that reads the solution and the stated answer
    j  sequential               SFT on stage one's verified solutions for sft_max_epochs passes,
                                then distillation + reward for the rest of the clock

An arm runs at ``learning_rate`` unless ``--arm_lr`` or an ``x@lr`` entry of ``--arms`` says otherwise, once per
``--seeds`` entry; the run's name (``f@3e-05-s1``) names its files. The start is the raw student, or with
``start_sft_s`` / ``start_sft_steps`` a mid-trained one; the teacher is the start plus more SFT on the
reference solutions (of ``teacher_n_train`` problems when set: the arms' training problems and more that no arm
sees). With ``deadline_s`` a command runs the arm runs that fit and stops; the same command
again continues (finished pieces, the start and the teacher are kept). Each arm runs in its own process.
Every evaluation sample is graded under both grader answer filters (``correct_numeric``, ``correct_math``);
the tables use ``report_filter``. Arm comparisons use paired standard errors over the same problems, at the
last mark and on the late mean (the last ``late_marks`` marks pooled); with >= 2 seeds also one between runs.
A sequential arm (j, k, l) is also evaluated at its hand-over, after its last off-policy step (``mark_s`` =
``HANDOVER_MARK`` = -1, its ``train_s`` and ``step`` say when): the report gives last mark − hand-over per run, what
the on-policy steps did to the model they started from.

Regime (iii) (bench/learning/run-3-plan.md; ``--preset regime3``): ``--student_layers N`` cuts the student to
N of its decoder layers (``bench.learning_setup``) and the start's SFT heals it, the teacher is the whole model + SFT,
``--train_data`` / ``--unseen_arm_problems`` give the arms problems neither saw, ``--kl_probe_problems`` measures the
start's per-token reverse KL under the teacher, and the setup's lines (teacher − start, on the problems the start
fails, the KL) print before any arm; ``--gate_lead`` stops the command there (exit 3) when the teacher leads by less.
Run names may add ``+kl<w>`` (the KL weight beside the reward's 1) and ``+ep<n>`` (passes before the hand-over).

Outputs under DIR: settings.json, protocol.yaml; data/{train,test,curriculum}.parquet (and
data/teacher_curriculum.parquet under teacher_n_train, data/start_curriculum.parquet under fresh_arm_problems or
unseen_arm_problems), data/stage_one.parquet (the teacher's samples with verdicts), data/setup_kl.json (the KL probe);
cut_student/ (student_layers), start/, teacher/; evals/<name>.parquet (one row per mark x problem x
sample); arms/<run>/ (train.yaml, metrics/train.jsonl, rollouts/, eval/<run>-<mark|handover>/); results.{json,md},
learning.png. Query with duckdb, e.g.
``SELECT name, mark_s, avg(correct_numeric::INT) FROM 'DIR/evals/*.parquet' GROUP BY ALL ORDER BY ALL``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

log = logging.getLogger("bench.learning")

from bench.learning_report import report, summarize_mark  # noqa: E402 - after the sys.path line

from bench.learning_clock import _free, train  # noqa: E402
from bench.learning_config import (  # noqa: E402,F401 - ARMS: re-exported
    ARM_SPECS, ARMS, HANDOVER_MARK, PRESETS, SFT_REFERENCE, LearningConfig, check_given_models, has_weights,
    merge_settings, refuse_renamed_flags, upgrade_settings)
from bench.learning_data import _yaml, build_data, check_disjoint, read_rows, start_path  # noqa: E402,F401 - re-exported
from bench.learning_stage_one import (  # noqa: E402,F401 - re-exported
    NothingToTrain, arm_curriculum, formal_stage_one_filter, stage_one_cached, stage_one_filtered, stage_one_meta,
    stage_one_seconds)

# ------------------------------------------------------------------------------------------- recipes


def train_recipe(cfg: LearningConfig, arm: str, *, student: str, curriculum: Path, out_dir: Path,
                 learning_rate: float, seed: int, options: dict | None = None, window_s: float | None = None,
                 arm_schedule: bool = True) -> dict:
    """The ``stages.train`` config (``OPDConfig`` fields) of an arm (``ARM_SPECS``); ``arm="sft"`` is SFT only on
    the reference solutions (``SFT_REFERENCE``: the start, the teacher).

    SFT (arm d, the start, the teacher) is ``OPDTrainer`` with every step off-policy (``sft_share_* = 1``,
    ``w_kl = w_reward = 0``): TRL SFTTrainer's completion-only cross-entropy on the curriculum's
    ``teacher_solution`` column, ``sft_batch_size`` solutions a step, no generation, no teacher.
    ``options``: a run name's ``+kl`` / ``+ep`` / ``+bs`` / ``+spg`` (``LearningConfig.run_options``). ``window_s``: the arm's training
    seconds (budget_s less stage one's), over which a time schedule's ``lr_warmup_s`` becomes ``lr_warmup_time``'s
    share (the bench's clock feeds the trainer that window's fraction: ``bench.learning_clock.clock_fraction``).
    ``arm_schedule=False``: the start's and the teacher's fine-tuning (``fine_tune``), whose steps are not an arm's
    window: a constant rate (after ``warmup_steps``) whatever ``lr_scheduler_type`` the arms run on. (A time schedule
    there decayed an RL-made teacher's rate to 0 over ``teacher_sft_s`` while its ``teacher_sft_steps`` went on.)
    """
    options = options or {}
    import torch

    spec = SFT_REFERENCE if arm == "sft" else ARM_SPECS[arm]
    r = dict(student_model=student, teacher_model=str(cfg.dir / "teacher") if spec.teacher == "trained" else None,
             curriculum_path=str(curriculum), output_dir=str(out_dir), experiment_name=f"learning-{out_dir.name}",
             teacher_context="privileged" if spec.teacher == "self" else "teacher", kl_mode=spec.kl_mode,
             w_kl=spec.w_kl, w_reward=spec.w_reward, num_generations=cfg.num_generations,
             per_device_train_batch_size=cfg.per_device_train_batch_size, gradient_accumulation_steps=1,
             learning_rate=learning_rate, lr_scheduler_type="constant", max_completion_length=cfg.max_completion_length,
             temperature=cfg.temperature,
             prompt_style=cfg.prompt_style, curriculum="shuffled", seed=seed, model_dtype="float32",
             answer_filter=cfg.answer_filter, grader_profile=cfg.grader_profile or None,
             sft_batch_size=cfg.sft_batch_size, max_grad_norm=1.0,
             # the arm's own clock (MarkClock) ends training; the product's deadline never fires
             max_wall_time_seconds=10**7, deadline_reserve_seconds=0, ckpt_every_minutes=0, ckpt_every_steps=0,
             ckpt_hedge_fractions=[], resume=False, save_rollouts=True, fast_generation=cfg.fast_generation,
             compile_layers=False, report_to="none", dataloader_num_workers=0)
    if spec.off_policy == "sft":
        r.update(sft_share_start=1.0, sft_share_end=1.0)
    if cfg.warmup_steps and arm != "sft":  # the start and the teacher are built as before, for every experiment alike
        r.update(lr_scheduler_type="constant_with_warmup", warmup_steps=cfg.warmup_steps)
    if cfg.lr_scheduler_type != "constant" and arm != "sft" and arm_schedule and not options.get("const"):
        window = cfg.budget_s if window_s is None else window_s
        r.update(lr_scheduler_type=cfg.lr_scheduler_type, lr_final_ratio=0.0,
                 lr_warmup_time=min(cfg.lr_warmup_s / window, 0.99) if window > 0 else 0.0)
    if "w_kl" in options:
        r["w_kl"] = options["w_kl"]
    if "batch" in options or "spg" in options:  # +bs / +spg: the rollout batch, and the updates it is split into
        spg = int(options.get("spg", 1))
        r.update(per_device_train_batch_size=int(options.get("batch", cfg.per_device_train_batch_size)) // spg,
                 steps_per_generation=spg)
    if cfg.micro_batch:  # the same steps in micro-batches of at most micro_batch rows (GSM8K-length answers)
        r["sft_micro_batch_size"] = cfg.micro_batch  # an SFT step in slices, whatever its accumulation steps
        if arm != "sft" and spec.off_policy != "sft":  # on-policy steps: their accumulation steps
            step = r["per_device_train_batch_size"]
            ga = cfg.accumulation_steps(step, with_sft=bool(spec.off_policy))
            r.update(per_device_train_batch_size=step // ga, gradient_accumulation_steps=ga)
    if spec.off_policy == "mix":
        r.update(w_sft=cfg.w_sft, sft_share_start=cfg.sft_share_start, sft_share_end=cfg.sft_share_end)
    if spec.off_policy == "seq":  # SFT steps until the cap, then on-policy (the cap ends the off-policy steps)
        r.update(sft_share_start=1.0, sft_share_end=1.0, sft_max_epochs=options.get("sft_max_epochs", cfg.sft_max_epochs),
                 sft_learning_rate=cfg.sft_learning_rate or None, sft_handover_reset=cfg.sft_handover_reset or None)
    if not torch.cuda.is_available():
        r["use_cpu"] = True
    return {k: v for k, v in r.items() if v is not None}


def protocol(cfg: LearningConfig) -> Path:
    """``<out>/protocol.yaml``: the ``stages.evaluate`` protocol of every mark (held-out problems, k samples,
    temperature, cap, prompt, grader filter). One seed for every arm run (common random numbers)."""
    n = len(read_rows(cfg.dir / "data" / "test.parquet"))
    return _yaml(dict(protocol="learning_heldout", version=1, description=f"bench/learning.py held-out set ({cfg.data_name})",
                      eval_data=str(cfg.dir / "data" / "test.parquet"), n_samples=cfg.eval_samples,
                      max_tokens=cfg.max_completion_length, temperature=cfg.eval_temperature, top_p=1.0, seed=cfg.seed + 7919,
                      prompt_style=cfg.prompt_style, n_problems=n, answer_filter=f"opd_{cfg.answer_filter}_grader"),
                 cfg.dir / "protocol.yaml")


# ------------------------------------------------------------------------------------------- evaluation


def evaluate(cfg: LearningConfig, model: str, *, name: str, mark_s: float, train_s: float, step: int,
             out_dir: Path) -> list[dict]:
    """``stages.evaluate`` of ``model`` under ``protocol(cfg)`` -> rows of ``evals/<name>.parquet``.

    Results land in ``out_dir/eval/<name>-<mark>/`` (``<name>-handover`` for ``HANDOVER_MARK``; samples.parquet,
    summary.json); the returned rows add the
    arm's ``name``, ``mark_s``, ``train_s`` and ``step`` to each sample and keep both grader filters'
    verdicts (``correct_numeric``, ``correct_math``); ``correct`` is the one of ``cfg.answer_filter``.
    """
    import pyarrow.parquet as pq

    from stages.evaluate import EvalConfig, run as evaluate_stage

    mark = "handover" if mark_s == HANDOVER_MARK else f"{mark_s:g}"
    ecfg = EvalConfig(protocol=str(cfg.dir / "protocol.yaml"), model=model, output_dir=str(out_dir),
                      label=f"{name}-{mark}", engine=cfg.engine, dtype="float32", grade_all_filters=True,
                      chunk_size=max(1, cfg.eval_batch // cfg.eval_samples))
    (summary,) = evaluate_stage(ecfg)
    _free()
    keep = ("problem_id", "level", "sample_index", "completion", "extracted", "n_tokens", "finish_reason",
            "correct_numeric", "correct_math", "correct")
    return [dict(name=name, mark_s=float(mark_s), train_s=float(train_s), step=int(step), **{k: r[k] for k in keep})
            for r in pq.read_table(summary["files"]["samples"]).to_pylist()]


def grade_rows(rows: list[dict], answers: dict[str, str], primary: str) -> list[dict]:
    """Grade evaluation rows in place under both answer filters (``--stage regrade`` of old runs).

    Raises:
        KeyError: a row's problem_id has no answer.
    """
    from data_tools.grader import ANSWER_FILTERS, grade_batch

    golds = [answers[r["problem_id"]] for r in rows]
    trunc = [r["finish_reason"] == "length" for r in rows]
    for f in ANSWER_FILTERS:
        for r, v in zip(rows, grade_batch([r["completion"] for r in rows], golds, truncated=trunc, answer_filter=f)):
            r[f"correct_{f}"] = bool(v.correct)
            if f == primary:
                r["extracted"] = v.extracted
    for r in rows:
        r["correct"] = r[f"correct_{primary}"]
    return rows


#: Column types of ``evals/*.parquet`` (explicit, so an all-null column such as ``extracted`` of a model
#: that never answers still reads as text when duckdb scans ``evals/*.parquet`` together).
EVAL_TYPES = {"name": "string", "mark_s": "float64", "train_s": "float64", "step": "int64", "problem_id": "string",
              "level": "string", "sample_index": "int64", "completion": "string", "n_tokens": "int64",
              "finish_reason": "string", "extracted": "string", "correct_numeric": "bool", "correct_math": "bool",
              "correct": "bool", "correct_recorded": "bool"}


def _write_evals(rows: list[dict], name: str, cfg: LearningConfig) -> Path:
    import pyarrow as pa

    from data_tools.runio import write_parquet

    cols = [c for c in EVAL_TYPES if rows and c in rows[0]]
    schema = pa.schema([(c, pa.type_for_alias(EVAL_TYPES[c])) for c in cols])
    return write_parquet(pa.Table.from_pylist([{c: r.get(c) for c in cols} for r in rows], schema=schema),
                         cfg.dir / "evals" / f"{name}.parquet")


def _line(cfg: LearningConfig, rows: list[dict]) -> str:
    s = summarize_mark(rows)
    return (f"avg@{cfg.eval_samples} {s['avg_at_k']:.3f} ± {s['stderr']:.3f} at {s['train_s']:.0f}s (step {s['step']}), "
            f"clip {s['clip_rate']:.2f}, tokens {s['mean_tokens']:.1f}")


# ------------------------------------------------------------------------------------------- steps


def fine_tune(cfg: LearningConfig, src: str, data: dict[str, Path], *, dest_name: str, eval_name: str,
              seconds: float, steps: int = 0, curriculum: str = "curriculum", objective: str = "sft") -> Path:
    """SFT of ``src`` on the reference solutions of ``data[curriculum]``'s problems (the training problems; the
    teacher's wider set under ``--teacher_n_train``, the start's own under ``--fresh_arm_problems``) for
    ``seconds`` (or ``steps`` optimizer steps when > 0) through ``stages.train``
    (``work/<dest_name>_sft/train.yaml``) at ``teacher_lr`` (the start: ``start_lr`` when set) -> ``<out>/<dest_name>``;
    its evaluation -> ``evals/<eval_name>.parquet``. The teacher and a mid-trained (or, cut, healed) start.
    ``objective="rl"``: reward only on the same problems instead (arm a's objective; the RL-made teacher)."""
    import shutil

    from data_tools.runio import write_parquet

    dest = cfg.dir / dest_name
    if (dest / "config.json").exists() and (cfg.dir / "evals" / f"{eval_name}.parquet").exists():
        return dest
    work = cfg.dir / "work" / f"{dest_name}_sft"
    shutil.rmtree(work, ignore_errors=True)
    cur = [{**r, "teacher_solution": r["reference"]} for r in read_rows(data[curriculum])]
    lr = cfg.start_lr if dest_name == "start" and cfg.start_lr else cfg.teacher_lr
    recipe = train_recipe(cfg, "sft" if objective == "sft" else "a", student=src,
                          curriculum=write_parquet(cur, work / "curriculum.parquet"), out_dir=work, learning_rate=lr,
                          seed=cfg.seed, arm_schedule=False)
    t0 = time.time()
    (s,) = train(cfg, _yaml(recipe, work / "train.yaml"), [seconds], max_steps=steps)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(s["path"], dest)
    rows = evaluate(cfg, str(dest), name=eval_name, mark_s=s["mark_s"], train_s=s["train_s"], step=s["step"],
                    out_dir=work)
    _write_evals(rows, eval_name, cfg)
    print(f"[learning] {dest_name}: {'SFT' if objective == 'sft' else 'RL (reward only)'} "
          f"(wall {time.time() - t0:.0f}s) -> {_line(cfg, rows)}", flush=True)
    return dest


def teacher_source(cfg: LearningConfig, student_path: str, start: str) -> str:
    """The model a built teacher's fine-tuning starts from: ``--teacher_init`` (an earlier link's teacher, so a long
    RL runs in links of at most ten minutes, each gated against this run's start), else with a cut start (regime
    (iii)) the whole model, else the start."""
    return cfg.teacher_init or (student_path if cfg.student_layers else start)


def adopt_model(cfg: LearningConfig, src: str, *, dest_name: str, eval_name: str) -> Path:
    """``--start_model`` / ``--teacher_model``: copy the model folder ``src`` to ``<out>/<dest_name>`` (atomically,
    once) and evaluate it into ``evals/<eval_name>.parquet`` at mark 0, as a built start or teacher would be.
    The copy keeps the run directory whole when ``src`` (often another run's folder under /tmp) goes away."""
    import shutil

    dest = cfg.dir / dest_name
    if not has_weights(dest):  # the same test check_given_models applies to the source
        tmp = cfg.dir / f".{dest_name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("optimizer*", "scheduler*", "rng_state*"))
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    if not (cfg.dir / "evals" / f"{eval_name}.parquet").exists():
        rows = evaluate(cfg, str(dest), name=eval_name, mark_s=0.0, train_s=0.0, step=0, out_dir=cfg.dir / "work")
        _write_evals(rows, eval_name, cfg)
        print(f"[learning] {dest_name}: {src} -> {_line(cfg, rows)}", flush=True)
    return dest


def eval_student(cfg: LearningConfig, student_path: str) -> None:
    """Mark 0 of every arm: the initial student on the held-out problems."""
    if not (cfg.dir / "evals" / "student.parquet").exists():
        rows = evaluate(cfg, student_path, name="student", mark_s=0.0, train_s=0.0, step=0, out_dir=cfg.dir / "work")
        _write_evals(rows, "student", cfg)
        print(f"[learning] student at 0 s: {_line(cfg, rows)}", flush=True)


def check_fast_generation(cfg: LearningConfig, student_path: str) -> bool:
    """Greedy completions from the fast path equal HF ``generate``'s on a few prompts (else fall back)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data_tools.prompts import render, student_messages
    from data_tools.generation.fast_decoder import SamplingParams, generator_for

    tok = AutoTokenizer.from_pretrained(student_path)
    model = AutoModelForCausalLM.from_pretrained(student_path, dtype=torch.float32)
    model = model.cuda() if torch.cuda.is_available() else model
    probs = ["What is 3 + 4 x 5?", "What is 47 x 6?", "What is 1/2 + 1/3?"]
    enc = [tok(render(tok, student_messages(p, cfg.prompt_style)), add_special_tokens=False).input_ids for p in probs]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id  # as ``generate`` does
    try:
        fast = generator_for(model, pad, [tok.eos_token_id]).generate(
            model, enc, SamplingParams(max_new_tokens=24, do_sample=False))
    except Exception as e:  # noqa: BLE001 - any failure means: use HF generate
        log.warning("fast generation failed (%s): falling back to HF generate", e)
        return False
    ok = True
    for e, f in zip(enc, fast):
        ids = torch.tensor([e], device=next(model.parameters()).device)
        with torch.no_grad():
            ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                 pad_token_id=pad, eos_token_id=tok.eos_token_id)[0, len(e):].tolist()
        cut = next((j + 1 for j, t in enumerate(ref) if t == tok.eos_token_id), len(ref))
        # float32 kernels differ between the paths; a late divergence on a near-tie is not an error
        ok &= sum(1 for x, y in zip(ref[:cut], f) if x == y) >= min(8, cut)
    return ok


def run_arm(cfg: LearningConfig, name: str) -> None:
    """Train one arm run for ``budget_s`` training seconds, evaluating at the marks -> ``evals/<name>.parquet``.

    ``name`` is an ``ARM_RUN`` name: its arm, learning rate and seed. The recipe is
    ``arms/<name>/train.yaml`` (``python -m stages.train --config`` runs it, without the marks).
    """
    import shutil

    from data_tools.runio import write_text

    arm, lr, seed = cfg.parse_run(name)
    cfg = dataclasses.replace(cfg, learning_rate=lr, seed=seed)
    student_path = start_path(cfg)
    out = cfg.dir / "arms" / name
    shutil.rmtree(out, ignore_errors=True)  # a run cut short starts again
    t_wall, offset, verified = time.time(), 0.0, None
    if ARM_SPECS[arm].off_policy:  # stage one's teacher sampling is on their clock
        s1 = stage_one_cached(cfg)
        offset = stage_one_seconds(cfg, name)
        verified = [r for r in s1 if r["correct"] or cfg.sft_filter == "none"]
        rows = (f", {len(stage_one_meta(cfg)['kept'])} problems kept by its filter"
                if stage_one_filtered(cfg, name) else "")
        print(f"[learning] arm {name}: stage one {len(s1)} teacher samples, {sum(r['correct'] for r in s1)} verified, "
              f"{len(verified)} kept (sft_filter={cfg.sft_filter}){rows}, {offset:.1f}s (counted in its budget)",
              flush=True)
        if not verified:
            raise NothingToTrain("the teacher produced no verified solution in stage one; nothing to fine-tune on")
    arm_curriculum(cfg, arm, name, verified)
    recipe = _yaml(arm_recipe(cfg, name), out / "train.yaml")
    print(f"[learning] arm {name}: stages.train recipe {recipe}", flush=True)
    if offset >= cfg.mark_list[-1]:  # stage one used the whole budget: the start is every mark's model
        print(f"[learning] arm {name}: stage one used the whole budget, no training step", flush=True)
        saved = [dict(mark_s=m, train_s=offset, step=0, path=student_path) for m in cfg.mark_list]
        write_text("", out / "metrics" / "train.jsonl")
    else:
        saved = train(cfg, recipe, cfg.mark_list, offset_s=offset, budget_s=cfg.budget_s)
    evals, done = [], {}
    for s in saved:  # marks passed within one step share its export: evaluated once (same model, same seed)
        if s["path"] not in done:
            done[s["path"]] = evaluate(cfg, s["path"], name=name, mark_s=s["mark_s"], train_s=s["train_s"],
                                       step=s["step"], out_dir=out)
        evals += [{**r, "mark_s": s["mark_s"], "train_s": s["train_s"]} for r in done[s["path"]]]
    if saved and saved[0]["path"] != student_path:
        if cfg.keep_final:  # e.g. a teacher for another experiment (--teacher_model)
            os.replace(saved[-1]["path"], out / "final")
        shutil.rmtree(out / "marks", ignore_errors=True)  # weights are not kept; the evaluations are
    elif cfg.keep_final:  # no training step: the arm's model is the start
        shutil.copytree(student_path, out / "final")
        print(f"[learning] arm {name}: no training step; final = a copy of the start", flush=True)
    _write_evals(evals, name, cfg)
    last = [r for r in evals if r["mark_s"] == cfg.mark_list[-1]]
    print(f"[learning] arm {name} ({cfg.label(name)}): {_line(cfg, last)}, wall {time.time() - t_wall:.0f}s", flush=True)


def arm_recipe(cfg: LearningConfig, name: str) -> dict:
    """The ``stages.train`` recipe of arm run ``name`` (``train_recipe`` at its rate, seed and ``+kl`` / ``+ep``, on
    its curriculum; a time schedule's warm-up over its training window: ``budget_s`` less stage one's recorded
    seconds for an off-policy arm)."""
    arm, lr, seed = cfg.parse_run(name)
    student = start_path(cfg)
    own = ARM_SPECS[arm].off_policy or ARM_SPECS[arm].stated_answer
    cur = cfg.dir / "arms" / name / "curriculum.parquet" if own else cfg.dir / "data" / "curriculum.parquet"
    offset = stage_one_seconds(cfg, name)
    recipe = train_recipe(cfg, arm, student=student, curriculum=cur, out_dir=cfg.dir / "arms" / name,
                          learning_rate=lr, seed=seed, options=cfg.run_options(name), window_s=cfg.budget_s - offset)
    if stage_one_filtered(cfg, name):  # the filtered stage one's order over its kept rows (curriculum: ordered)
        recipe["curriculum"] = "ordered"
    return recipe


# ------------------------------------------------------------------------------------------- report


def regrade(cfg: LearningConfig) -> None:
    """Re-grade every ``evals/*.parquet`` under both answer filters (``grade_rows``), atomically per file.

    For runs whose rows predate ``correct_numeric`` / ``correct_math``; the held-out answers come from
    ``data/test.parquet`` (rebuilt from the settings when absent: the data are deterministic).
    """
    import pyarrow.parquet as pq

    answers = {r["problem_id"]: r["answer"] for r in read_rows(build_data(cfg)["test"])}
    for p in sorted((cfg.dir / "evals").glob("*.parquet")):
        rows = pq.read_table(p).to_pylist()
        if "correct" in rows[0] and "correct_math" not in rows[0]:
            for r in rows:  # keep the verdict the run itself recorded
                r["correct_recorded"] = r["correct"]
        _write_evals(grade_rows(rows, answers, cfg.answer_filter), p.stem, cfg)
        n = len(rows)
        print(f"[learning] regraded {p.name}: numeric {sum(r['correct_numeric'] for r in rows) / n:.3f}, "
              f"math {sum(r['correct_math'] for r in rows) / n:.3f} over {n} samples", flush=True)


# ------------------------------------------------------------------------------------------- main


def _parse(argv):
    from transformers import HfArgumentParser

    parser = HfArgumentParser(LearningConfig)
    parser.add_argument("--stage", default="all",
                        choices=["all", "setup", "arm", "recipe", "report", "regrade", "pool"],
                        help="all: data, start, teacher, baseline, every arm (each in a subprocess), report. setup: "
                             "all but the arms. recipe: print --arm's stages.train YAML. report: redraw from evals/. "
                             "regrade: grade evals/ again under both answer filters. pool: copy --pool_from's arm "
                             "runs into --out (after checking both ran the same setup: bench/learning_pool.py), "
                             "then report.")
    parser.add_argument("--arm", default=None, help="--stage arm / recipe: which arm run (e.g. f@3e-05-s1).")
    parser.add_argument("--pool_from", default="",
                        help="--stage pool: comma-separated run directories (e.g. packed tables of a later lease) "
                             "whose arm runs join --out's.")
    refuse_renamed_flags(argv)
    argv, preset = _take_preset(argv)
    if preset:  # the preset's values become the flags' defaults: a flag given wins, also at its plain default
        parser.set_defaults(**PRESETS[preset])
    cfg, extra = parser.parse_args_into_dataclasses(args=argv)
    return cfg, extra


def _take_preset(argv: list[str]) -> tuple[list[str], str]:
    """``argv`` without its ``--preset NAME`` / ``--preset=NAME`` (argparse's own reading), and the name ("" = none).

    Raises:
        ValueError: an unknown preset, or ``--preset`` without a name.
    """
    import argparse

    names = sorted(p for p in PRESETS if p)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    pre.add_argument("--preset", default="")
    try:
        known, rest = pre.parse_known_args(argv)
    except argparse.ArgumentError:
        raise ValueError("--preset needs a name: " + ", ".join(names)) from None
    if not known.preset and any(a.startswith("--preset") for a in argv):
        raise ValueError("--preset needs a name: " + ", ".join(names))
    if known.preset and known.preset not in PRESETS:
        raise ValueError(f"preset must be one of {names}, got {known.preset!r}")
    return rest, known.preset


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("OPD_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg, extra = _parse(argv if argv is not None else sys.argv[1:])
    except ValueError as e:
        print(f"bench.learning: {e}", file=sys.stderr)
        return 2
    import torch

    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True  # float32 weights (docs/design.md section 8), TF32 matmuls
        torch.backends.cudnn.allow_tf32 = True
    sources = [x.strip() for x in (extra.pool_from or "").split(",") if x.strip()]
    if extra.stage == "pool" and not sources:
        print("bench.learning: --stage pool needs --pool_from DIR[,DIR...]", file=sys.stderr)
        return 2
    if extra.pool_from and extra.stage != "pool":  # with the default stage it would start an experiment in --out
        print(f"bench.learning: --pool_from is read by --stage pool only (this command's stage: {extra.stage})",
              file=sys.stderr)
        return 2
    if extra.stage in ("arm", "recipe", "report", "regrade", "pool"):
        saved = cfg.dir / "settings.json"
        if not saved.exists():
            print(f"bench.learning: {saved} not found: run --stage setup (or the experiment) on this --out first: "
                  "the settings it records define every arm's recipe", file=sys.stderr)
            return 2
        names = {f.name for f in dataclasses.fields(LearningConfig)} - {"preset"}
        try:
            kept = json.loads(saved.read_text())
        except (OSError, ValueError) as e:
            kept = e
        if not isinstance(kept, dict):
            print(f"bench.learning: {saved} cannot be read as the run's settings (a JSON object): {kept}",
                  file=sys.stderr)
            return 2
        try:
            kept = upgrade_settings(kept, saved)  # a run recorded under the settings' old names
        except ValueError as e:
            print(f"bench.learning: {e}", file=sys.stderr)
            return 2
        # runs made before these settings existed graded rewards with math-verify equivalence only
        kept.setdefault("answer_filter", "math")
        kept["fast_generation"] = kept.get("fast_generation_used", kept.get("fast_generation", True))
        kept = {k: v for k, v in kept.items() if k in names}
        kept["report_filter"] = cfg.report_filter  # a report chooses its filter and late marks on its own command line
        kept["late_marks"] = cfg.late_marks
        kept["contrasts"] = cfg.contrasts
        kept["out"] = str(cfg.dir)  # the directory may have moved since (e.g. copied back from a GPU machine)
        try:
            cfg = LearningConfig(**kept)
            if extra.stage in ("arm", "recipe"):
                cfg.parse_run(extra.arm or "")
                if extra.stage == "recipe":
                    import yaml

                    recipe = arm_recipe(cfg, extra.arm)  # refused (one line) before any of the header is printed
                    print(f"# {extra.arm}: the stages.train recipe bench/learning.py runs for this arm, from {saved}'s "
                          "settings (other flags on this command are not applied).\n# The arm's budget_s, its marks and "
                          "its off-policy share schedule run on bench/learning.py's own clock (a trainer hook), not "
                          "in this file:\n# alone through stages.train it would train until max_wall_time_seconds. An "
                          "arm with its own curriculum (d, f, g, h, i, j)\n# writes it when it runs; on a machine without "
                          "CUDA the recipe adds use_cpu: true.")
                    print(yaml.safe_dump(recipe, sort_keys=False), end="")
                else:
                    try:
                        run_arm(cfg, extra.arm)
                    except NothingToTrain as e:  # said in one line; the command goes on to the next arm
                        print(f"[learning] arm {extra.arm}: not run: {e}", flush=True)
                        return 1
                return 0
            if extra.stage == "regrade":
                regrade(cfg)
            if extra.stage == "pool":
                return _pool_stage(cfg, sources)
            report(cfg)
        except (ValueError, FileNotFoundError) as e:
            print(f"bench.learning: {e}", file=sys.stderr)
            return 2
        print((cfg.dir / "results.md").read_text(), end="")
        return 0
    try:
        from data_tools.runio import EXIT_LOCKED, LockHeld, check_outside_repo, run_lock

        check_outside_repo(cfg.dir, "--out")
        cfg.dir.mkdir(parents=True, exist_ok=True)
        with run_lock(cfg.dir):  # one experiment per directory (the arms run under this lock)
            return run_all(cfg, setup_only=extra.stage == "setup")
    except LockHeld as e:
        print(f"bench.learning: {e}", file=sys.stderr)
        return EXIT_LOCKED
    except (ValueError, FileNotFoundError) as e:
        print(f"bench.learning: {e}", file=sys.stderr)
        return 2


def _pool_stage(cfg: LearningConfig, sources: list[str]) -> int:
    """``--stage pool``: check every source, then copy (``bench.learning_pool``), then report; under the run lock."""
    from bench.learning_pool import apply, plan
    from data_tools.runio import EXIT_IO, EXIT_LOCKED, LockHeld, run_lock

    phase = "checking the sources: nothing was copied"
    try:
        with run_lock(cfg.dir):  # not while an experiment (or another pool) writes here
            defaults = {f.name: f.default for f in dataclasses.fields(LearningConfig)
                        if f.default is not dataclasses.MISSING}

            def canonical(run: str) -> None:  # "j@3e-6-s2" would be read as a second arm beside "j@3e-06-s2"
                name = cfg.canonical(run)
                if name != run:
                    raise ValueError(f"run {run!r} is named {name!r} by this experiment's settings: rename its "
                                     "evals/<run>.parquet (and the name column) and arms/<run>/ to pool it")

            def handover(run: str) -> set[float]:  # a sequential run (j, k, l) may hold its hand-over's evaluation
                return {HANDOVER_MARK} if ARM_SPECS[cfg.parse_run(run)[0]].off_policy == "seq" else set()

            plans = []
            for s in sources:  # every source checked before anything is copied
                plans.append(plan(cfg.dir, Path(s), valid_name=canonical, defaults=defaults, earlier=plans,
                                  marks=set(cfg.mark_list), optional_marks=handover))
            for p in plans:
                new = p.copy + p.arms_only
                print(f"[learning] pool {p.src}: checked {', '.join(p.checked)}; copying {', '.join(new) or 'nothing'}"
                      + (f"; already here: {', '.join(p.skip)}" if p.skip else ""), flush=True)
            phase = ("copying: pooled.json lists the runs now whole here, and a run whose copy was cut short was "
                     "taken away again; results.md was not redrawn")
            try:
                apply(cfg.dir, plans)
            except OSError as e:
                print(f"bench.learning: {e} (pooled.json lists what was pooled before it; the report was not redrawn: "
                      "run --stage pool again, or --stage report)", file=sys.stderr)
                return EXIT_IO
            phase = "drawing the report: every run is pooled (pooled.json); run --stage report"
            try:
                report(cfg)
            except (OSError, ValueError, KeyError) as e:
                print(f"bench.learning: the runs are pooled (pooled.json), but the report failed: "
                      f"{type(e).__name__}: {e}; run --stage report once that is fixed", file=sys.stderr)
                return EXIT_IO if isinstance(e, OSError) else 2
    except LockHeld as e:
        print(f"bench.learning: {e}", file=sys.stderr)
        return EXIT_LOCKED
    except KeyboardInterrupt:
        print(f"bench.learning: pool interrupted while {phase}. The same --stage pool again completes it",
              file=sys.stderr)
        return 130
    print((cfg.dir / "results.md").read_text(), end="")
    return 0


def gate_passes(lead: float, start: float, gate_lead: float, gate_rel_lead: float) -> bool:
    """The setup's gate: the teacher's lead over the start at least ``gate_lead`` (absolute) and at least
    ``gate_rel_lead`` of the start's own score (relative; a start at 0 passes any relative gate the lead passes)."""
    return lead >= gate_lead and (lead >= gate_rel_lead * start)


def run_all(cfg: LearningConfig, setup_only: bool = False) -> int:
    from data_tools.models import resolve_model
    from data_tools.runio import write_json

    t_start = time.time()
    check_given_models(cfg)
    settings_path = cfg.dir / "settings.json"
    student_path = resolve_model(cfg.student_model)
    start = (str(cfg.dir / "start") if cfg.start_model or cfg.start_sft_s > 0 or cfg.start_sft_steps
             else student_path)
    # out resolved, as start_path is: a moved directory is recognised by it (start_path() below); runs: what this
    # command asks for, merged with earlier commands' (the report's "not run" list)
    settings = {**dataclasses.asdict(cfg), "preset": "", "out": str(cfg.dir), "student_path": student_path,
                "start_path": start, "runs": [] if setup_only else cfg.instances}
    old = json.loads(settings_path.read_text()) if settings_path.exists() else None
    settings = merge_settings(old, settings, cfg.arm_list)
    if old is None and cfg.fast_generation and not check_fast_generation(cfg, student_path):
        print("[learning] fast generation disagrees with HF generate here: using HF generate for every arm", flush=True)
        settings["fast_generation_used"] = False
    data = build_data(cfg)  # before settings.json: a run refused for its data can be run again with other flags
    protocol(cfg)
    write_json(settings, settings_path)
    print(f"[learning] data: {len(read_rows(data['train']))} train / {len(read_rows(data['test']))} test ({cfg.data_name}); "
          f"out {cfg.dir}", flush=True)
    if "teacher_curriculum" in data:  # the ladder's levels run out unevenly past 18,000 problems: say the mix
        from collections import Counter

        mix = Counter(r["bucket"] for r in read_rows(data["teacher_curriculum"]))
        print(f"[learning] teacher data: {sum(mix.values())} problems, by level {dict(sorted(mix.items()))}", flush=True)
    if "start_curriculum" in data and cfg.unseen_arm_problems:
        n_seen = max(cfg.n_train, cfg.teacher_n_train)
        print(f"[learning] unseen arm problems: the start and the teacher train on problems 1-{n_seen}, the arms on "
              f"{n_seen + 1}-{n_seen + cfg.n_train}", flush=True)
    elif "start_curriculum" in data:
        print(f"[learning] fresh arm problems: the start trains on problems 1-{cfg.n_train} of the teacher's, the "
              f"arms on {cfg.n_train + 1}-{2 * cfg.n_train}", flush=True)
    if cfg.student_layers:  # regime (iii): the student cut, then healed into the start below
        from bench.learning_setup import cut_student

        cut_student(cfg, student_path)
    if cfg.start_model:  # a given start (e.g. an earlier run's): its evaluation is every arm's mark 0
        adopt_model(cfg, cfg.start_model, dest_name="start", eval_name="student")
    elif start != student_path:  # a mid-trained (or a cut and healed) start: its evaluation is every arm's mark 0
        fine_tune(cfg, str(cfg.dir / "cut_student") if cfg.student_layers else student_path, data, dest_name="start",
                  eval_name="student", seconds=cfg.start_sft_s, steps=cfg.start_sft_steps,
                  curriculum="start_curriculum" if "start_curriculum" in data else "curriculum")
    else:
        eval_student(cfg, student_path)
    if cfg.teacher_model:
        adopt_model(cfg, cfg.teacher_model, dest_name="teacher", eval_name="teacher")
    elif setup_only or any(ARM_SPECS[cfg.parse_run(n)[0]].needs_teacher for n in cfg.instances):
        fine_tune(cfg, teacher_source(cfg, student_path, start), data, dest_name="teacher", eval_name="teacher",
                  seconds=cfg.teacher_sft_s, steps=cfg.teacher_sft_steps, objective=cfg.teacher_objective,
                  curriculum="teacher_curriculum" if "teacher_curriculum" in data else "curriculum")
    if cfg.kl_probe_problems and has_weights(cfg.dir / "teacher") and not (cfg.dir / "data" / "setup_kl.json").exists():
        from bench.learning_setup import probe_kl

        probe_kl(cfg, start)
    lead = gate_ok = None
    if (cfg.dir / "evals" / "teacher.parquet").exists():  # the setup's measurement, before any arm
        from bench.learning_report import setup_lines, setup_measures

        measured = setup_measures(cfg, cfg.report_filter)
        lead = measured["lead"]
        for line in setup_lines(measured, cfg):
            print(f"[learning] setup: {line}", flush=True)
        if cfg.gate_lead or cfg.gate_rel_lead:
            gate_ok = gate_passes(lead, measured["start"], cfg.gate_lead, cfg.gate_rel_lead)
            rel = (f"{lead / measured['start']:+.0%} of the start's {measured['start']:.3f}" if measured["start"] > 0
                   else "the start at 0")
            print(f"[learning] setup: gate {'passed' if gate_ok else 'FAILED'}: the teacher leads the start by "
                  f"{lead:+.3f} ({rel}) on the held-out problems; "
                  f"gate_lead {cfg.gate_lead:+.3f}, gate_rel_lead {cfg.gate_rel_lead:+.0%}", flush=True)
    if setup_only:
        print(f"[learning] setup done in {time.time() - t_start:.0f}s: {cfg.dir}", flush=True)
        return 0
    if gate_ok is False:
        print("[learning] no arm run: the regime lacks the teacher lead it exists to test (rebuild it, or set "
              "--gate_lead 0 --gate_rel_lead 0 to run the arms anyway)", flush=True)
        return 3
    skipped, overhead = {}, cfg.arm_overhead_s
    for arm in cfg.instances:
        if (cfg.dir / "evals" / f"{arm}.parquet").exists():
            lost = cfg.keep_final and not (cfg.dir / "arms" / arm / "final" / "config.json").exists()
            print(f"[learning] arm {arm}: already done" + (" (without --keep_final: no final export kept; another "
                  "--out runs it again)" if lost else ""), flush=True)
            continue
        if cfg.deadline_s and time.time() - t_start + cfg.budget_s + overhead > cfg.deadline_s:
            skipped[arm] = f"not enough time left in deadline_s={cfg.deadline_s:.0f}"
            print(f"[learning] arm {arm}: skipped ({skipped[arm]})", flush=True)
            continue
        cmd = [sys.executable, "-m", "bench.learning", "--out", str(cfg.dir), "--stage", "arm", "--arm", arm]
        t_arm = time.time()
        rc = subprocess.call(cmd, cwd=str(ROOT))
        overhead = max(overhead, time.time() - t_arm - cfg.budget_s)  # measured: the next arm's estimate
        if rc != 0:
            skipped[arm] = f"failed with exit code {rc}"
            print(f"[learning] arm {arm}: FAILED (exit {rc})", flush=True)
    write_json(skipped, cfg.dir / "skipped.json")
    if any("deadline" in w for w in skipped.values()):
        print(f"[learning] {sum('deadline' in w for w in skipped.values())} arm run(s) left: run the same command "
              "again to continue (finished pieces are kept)", flush=True)
    report(cfg)
    print((cfg.dir / "results.md").read_text(), flush=True)
    print(f"[learning] done in {time.time() - t_start:.0f}s: {cfg.dir}/results.md, learning.png", flush=True)
    return 0 if not any("failed" in w for w in skipped.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
