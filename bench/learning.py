"""Learning efficacy (issue 7): which stage-two objective makes a small student better per GPU minute.

    python -m bench.learning --out DIR                       # the GPU experiment (all arms, defaults below)
    python -m bench.learning --out DIR --task gsm8k          # the same on GSM8K (needs ../shared/data)
    python -m bench.learning --out DIR --preset cpu_smoke    # seconds-long budgets, to check the plumbing on a CPU

Student: SmolLM2-135M-Instruct (the embedded default, float32). One task, one set of held-out
problems, one seed; every arm is given the same *training* seconds (its own clock, evaluation paused)
and is evaluated at the same marks on that clock:

    a  reward only              OPDTrainer, w_kl = 0, w_reward = 1 (GRPO-style group advantage)
    b  distillation only        OPDTrainer, w_kl = 1, w_reward = 0, the stronger teacher
    c  distillation + reward    OPDTrainer, w_kl = 1, w_reward = 1, the stronger teacher
    d  off-policy fine-tuning   stage one (the teacher samples the train problems; the grader keeps the
                                verified solutions) then TRL SFTTrainer on them; the sampling is on d's clock
    e  self-distillation        as c, but the teacher is the frozen initial student reading the
                                reference solution (privileged context, OPSD)

The stronger same-tokenizer teacher is the student fine-tuned (TRL ``SFTTrainer``) on the reference
worked solutions of the training problems for ``teacher_sft_s`` seconds; its own score is measured on
the same held-out problems. Each arm runs in its own process (fresh CUDA context and compile caches).

Evaluation (``evaluate``): the held-out problems x ``eval_samples`` samples at ``eval_temperature``,
``max_new_tokens`` cap, the prompt and grader of stages.evaluate; avg@k with its standard error over
problems (``data_tools.evalstats``), clip rate, mean completion tokens. Every sample is graded under both
grader answer filters (``correct_numeric``: the answer must be a number; ``correct_math``: any
mathematically equal expression, so "41 * 74" counts): the tables use ``report_filter`` (numeric), and
the other shows reward hacking (bench/LEARNING.md). Arm comparisons use the paired standard error of the
per-problem difference (same problems for every arm).

Outputs under DIR (resumable: finished pieces are skipped on a re-run with the same settings):
    settings.json                   every setting of the run
    data/{train,test,curriculum}.parquet, data/stage_one.parquet (d's teacher samples, with verdicts)
    teacher/                        the fine-tuned teacher (HF directory)
    evals/<name>.parquet            one row per (mark, problem, sample): completion, correct_numeric, correct_math, ...
    arms/<arm>/                     the trainer's run directory (metrics/train.jsonl, rollouts/*.parquet)
    results.json, results.md, learning.png

The numbers in bench/LEARNING.md come from this script; query the tables with duckdb, e.g.
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
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

log = logging.getLogger("bench.learning")

ARMS = {
    "a": "reward only (w_kl=0)",
    "b": "OPD only (w_reward=0)",
    "c": "OPD + reward",
    "d": "off-policy SFT on teacher's verified solutions",
    "e": "OPD + reward, privileged self-teacher",
}
TASKS = ("ladder", "gsm8k")
#: Named sets of settings. cpu_smoke: toy sizes to run every piece on a CPU in minutes; its teacher
#: (4 s of SFT, 16-token cap) verifies nothing, so arm d fine-tunes on all of its samples.
PRESETS: dict[str, dict] = {
    "": {},
    "cpu_smoke": dict(n_train=48, n_test=6, budget_s=6.0, marks="3,6", teacher_sft_s=4.0, completions_per_step=8,
                      num_generations=4, max_new_tokens=16, eval_samples=2, stage_one_problems=16, sft_batch_size=8,
                      eval_batch=64, sft_filter="none"),
}
SHARED = Path(os.environ.get("OPD_SHARED_DIR", ROOT.parent / "shared"))


@dataclass
class LearningConfig:
    """Settings of one learning-efficacy run (written to ``<out>/settings.json``; arms re-read it)."""

    out: str = field(default="", metadata={"help": "Run directory (outside the repo). Required."})
    task: str = field(default="ladder", metadata={"help": "ladder: data_tools.synth hard ladder; gsm8k: GSM8K."})
    arms: str = field(default="a,b,c,d,e", metadata={"help": "Comma-separated arms to run, in this order (see ARMS)."})
    student_model: str | None = field(default=None, metadata={"help": "Local HF dir; empty = embedded SmolLM2-135M-Instruct."})
    n_train: int = field(default=6000, metadata={"help": "Training problems (the teacher's SFT data and every arm's prompts)."})
    n_test: int = field(default=300, metadata={"help": "Held-out problems evaluated at every mark."})
    gsm8k_dir: str = field(default=str(SHARED / "data"), metadata={"help": "Folder of gsm8k_{train,test}.jsonl."})
    budget_s: float = field(default=150.0, metadata={"help": "Training seconds per arm (its own clock, evals paused)."})
    marks: str = field(default="15,30,60,100,150", metadata={
        "help": "Training-clock seconds at which each arm is evaluated (the last one ends the arm; <= budget_s)."})
    teacher_sft_s: float = field(default=90.0, metadata={"help": "Training seconds of the teacher's fine-tuning."})
    teacher_lr: float = field(default=5e-5, metadata={"help": "Learning rate of the teacher's fine-tuning."})
    lr: float = field(default=1e-5, metadata={"help": "Learning rate of every arm (AdamW, constant)."})
    sft_batch_size: int = field(default=64, metadata={"help": "Sequences per optimizer step for SFT (teacher and arm d)."})
    num_generations: int = field(default=8, metadata={"help": "G: samples per prompt for arms a, b, c, e."})
    completions_per_step: int = field(default=128, metadata={"help": "Completions per optimizer step (a, b, c, e)."})
    train_temperature: float = field(default=1.0, metadata={"help": "Sampling temperature of on-policy rollouts."})
    max_new_tokens: int = field(default=96, metadata={"help": "Completion cap in training rollouts, stage one and evaluation."})
    eval_samples: int = field(default=4, metadata={"help": "k of avg@k."})
    eval_temperature: float = field(default=0.7, metadata={"help": "Sampling temperature of evaluation and stage one."})
    eval_batch: int = field(default=1200, metadata={"help": "Sequences per generation call in evaluation / stage one."})
    stage_one_problems: int = field(default=6000, metadata={"help": "Arm d: training problems the teacher samples."})
    stage_one_samples: int = field(default=1, metadata={"help": "Arm d: teacher samples per problem."})
    sft_filter: str = field(default="verified", metadata={
        "help": "Arm d: verified = fine-tune only on graded-correct, finished, distinct teacher samples (the "
                "classical recipe); none = on every teacher sample (an ablation; lets the CPU smoke test run arm d "
                "with a teacher that solves nothing)."})
    prompt_style: str = field(default="reasoning", metadata={"help": "data_tools.prompts style of every prompt."})
    answer_filter: str = field(default="numeric", metadata={
        "help": "Grader answer filter of the training reward and stage one's verification (data_tools.grader): "
                "numeric = the answer must be a number (arithmetic tasks); math = any equal expression."})
    report_filter: str = field(default="numeric", metadata={
        "help": "Answer filter of the reported avg@k (both are stored per sample: correct_numeric, correct_math)."})
    seed: int = field(default=0, metadata={"help": "Seed of every arm (data order, sampling, evaluation)."})
    fast_generation: bool = field(default=True, metadata={
        "help": "trainers.generation's static-cache / CUDA-graph generation for rollouts and evaluation."})
    deadline_s: float = field(default=0.0, metadata={
        "help": "Whole-run wall-clock limit (0 = none): an arm that cannot finish before it is skipped and reported."})
    arm_overhead_s: float = field(default=45.0, metadata={
        "help": "Estimated seconds an arm spends outside its budget (start-up, evaluations), for deadline_s."})
    preset: str = field(default="", metadata={
        "help": "cpu_smoke: tiny sizes and budgets (PRESETS). It sets the fields still at their defaults: a flag given "
                "with another value wins."})

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name, value in PRESETS[self.preset].items():
            if getattr(self, name) == defaults[name]:  # a flag given on the command line wins over the preset
                setattr(self, name, value)
        if not self.out:
            raise ValueError("--out is required (a run directory outside the repo)")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        bad = [a for a in self.arm_list if a not in ARMS]
        if bad or not self.arm_list:
            raise ValueError(f"arms must be a comma-separated subset of {sorted(ARMS)}, got {self.arms!r}")
        m = self.mark_list
        if not m or any(x <= 0 for x in m) or m != sorted(set(m)) or m[-1] > self.budget_s:
            raise ValueError(f"marks must be increasing positive seconds <= budget_s ({self.budget_s}), got {self.marks!r}")
        for name in ("n_train", "n_test", "eval_samples", "num_generations", "completions_per_step", "max_new_tokens",
                     "sft_batch_size", "eval_batch", "stage_one_problems", "stage_one_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.completions_per_step % self.num_generations:
            raise ValueError(f"completions_per_step ({self.completions_per_step}) must be a multiple of "
                             f"num_generations ({self.num_generations})")
        if min(self.budget_s, self.teacher_sft_s, self.lr, self.teacher_lr) <= 0:
            raise ValueError("budget_s, teacher_sft_s, lr and teacher_lr must be > 0")
        from data_tools.grader import ANSWER_FILTERS

        for name in ("answer_filter", "report_filter"):
            if getattr(self, name) not in ANSWER_FILTERS:
                raise ValueError(f"{name} must be one of {ANSWER_FILTERS}, got {getattr(self, name)!r}")
        if self.sft_filter not in ("verified", "none"):
            raise ValueError(f"sft_filter must be 'verified' or 'none', got {self.sft_filter!r}")
        if self.eval_temperature <= 0 or self.train_temperature <= 0:
            raise ValueError("temperatures must be > 0 (sampling)")

    @property
    def arm_list(self) -> list[str]:
        return [a.strip() for a in self.arms.split(",") if a.strip()]

    @property
    def mark_list(self) -> list[float]:
        try:
            return [float(x) for x in self.marks.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"marks must be comma-separated seconds, got {self.marks!r}") from None

    @property
    def dir(self) -> Path:
        return Path(self.out).expanduser().resolve()


# ------------------------------------------------------------------------------------------- data


def build_data(cfg: LearningConfig) -> dict[str, Path]:
    """Write ``data/train.parquet``, ``data/test.parquet`` and the trainer's ``data/curriculum.parquet``.

    Ladder: ``data_tools.synth`` hard ladder, train/test split by problem hash. GSM8K: the first
    ``n_train`` rows of ``gsm8k_train.jsonl`` and the first ``n_test`` of ``gsm8k_test.jsonl`` (a
    fixed subset), reference solutions with the calculator annotations removed.

    Raises:
        FileNotFoundError: GSM8K files missing.
    """
    from data_tools.problems import load_problems
    from data_tools.runio import write_parquet

    d = cfg.dir / "data"
    paths = {k: d / f"{k}.parquet" for k in ("train", "test", "curriculum")}
    if all(p.exists() for p in paths.values()):
        return paths
    if cfg.task == "ladder":
        train = load_problems(f"synth-hard:train:{cfg.n_train}", seed=cfg.seed).rows
        test = load_problems(f"synth-hard:test:{cfg.n_test}", seed=cfg.seed).rows
    else:
        g = Path(cfg.gsm8k_dir)
        train = load_problems(g / "gsm8k_train.jsonl", limit=cfg.n_train).rows
        test = load_problems(g / "gsm8k_test.jsonl", limit=cfg.n_test).rows
        for r in train + test:  # GSM8K rationale, then the answer the grader looks for
            r["solution"] = f"{r['solution']}\nThe answer is \\boxed{{{r['answer']}}}."
    write_parquet(train, paths["train"])
    write_parquet(test, paths["test"])
    # stage one's curriculum schema (trainers.opd_trainer.load_curriculum); shuffled by the trainer
    cur = [dict(problem_id=r["problem_id"], problem=r["problem"], answer=r["answer"], reference=r["solution"],
                bucket=int(r.get("level") or 0) if str(r.get("level") or "").isdigit() else 0, curriculum_index=i,
                prompt_style=cfg.prompt_style, source=r.get("source") or cfg.task) for i, r in enumerate(train)]
    write_parquet(cur, paths["curriculum"])
    return paths


def read_rows(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


# ------------------------------------------------------------------------------------------- evaluation


@dataclass
class Generated:
    """Completions of one generation call: token ids (EOS kept), decoded text, hit-the-cap flags."""

    ids: list[list[int]]
    texts: list[str]
    clipped: list[bool]


def generate(model, tok, prompts: list[str], *, max_new_tokens: int, temperature: float, batch: int,
             seed: int, fast: bool) -> Generated:
    """Sample one completion per prompt string (chat-rendered), in chunks of ``batch`` sequences.

    ``fast``: ``trainers.generation.FastGenerator`` (static cache; CUDA graph on a GPU); else HF
    ``generate``. ``clipped[i]`` is True when completion i reached ``max_new_tokens`` without EOS.
    """
    import torch

    from trainers.generation import SamplingParams, generator_for

    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    dev = next(model.parameters()).device
    torch.manual_seed(seed)
    out: list[list[int]] = []
    for s in range(0, len(prompts), batch):
        enc = [tok(p, add_special_tokens=False).input_ids for p in prompts[s : s + batch]]
        if fast:
            gen = generator_for(model, pad, [eos])
            out += gen.generate(model, enc, SamplingParams(max_new_tokens=max_new_tokens, do_sample=True,
                                                           temperature=temperature))
        else:
            was = model.training
            model.eval()
            P = max(len(e) for e in enc)
            ids = torch.tensor([[pad] * (P - len(e)) + e for e in enc], device=dev)
            mask = torch.tensor([[0] * (P - len(e)) + [1] * len(e) for e in enc], device=dev)
            with torch.no_grad():
                res = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=True,
                                     temperature=temperature, top_p=1.0, top_k=0, pad_token_id=pad, eos_token_id=eos)
            model.train(was)
            for row in res[:, P:].tolist():
                cut = next((j + 1 for j, t in enumerate(row) if t == eos), len(row))
                out.append(row[:cut])
    texts = tok.batch_decode(out, skip_special_tokens=True)
    clipped = [not (len(o) and o[-1] == eos) and len(o) >= max_new_tokens for o in out]
    return Generated(out, texts, clipped)


def evaluate(model, tok, problems: list[dict], cfg: LearningConfig, *, name: str, mark_s: float, train_s: float,
             step: int) -> list[dict]:
    """avg@k sample rows of ``model`` on ``problems`` (one row per problem x sample), graded.

    Row keys: name, mark_s (the planned mark), train_s (the arm's training clock when evaluated),
    step, problem_id, level, sample_index, completion, extracted, n_tokens, finish_reason, and the
    verdicts (``grade_rows``): correct_numeric, correct_math, correct (= under ``cfg.answer_filter``).
    """
    from data_tools.prompts import render, student_messages

    k = cfg.eval_samples
    prompts = [render(tok, student_messages(p["problem"], cfg.prompt_style)) for p in problems for _ in range(k)]
    g = generate(model, tok, prompts, max_new_tokens=cfg.max_new_tokens, temperature=cfg.eval_temperature,
                 batch=cfg.eval_batch, seed=cfg.seed + 7919, fast=cfg.fast_generation)
    rows = []
    for i, text in enumerate(g.texts):
        p = problems[i // k]
        rows.append(dict(name=name, mark_s=float(mark_s), train_s=round(float(train_s), 2), step=int(step),
                         problem_id=p["problem_id"], level=str(p.get("level") or ""), sample_index=i % k,
                         completion=text, n_tokens=len(g.ids[i]), finish_reason="length" if g.clipped[i] else "stop"))
    return grade_rows(rows, {p["problem_id"]: p["answer"] for p in problems}, cfg.answer_filter)


def grade_rows(rows: list[dict], answers: dict[str, str], primary: str) -> list[dict]:
    """Grade evaluation rows in place under both answer filters; ``correct`` is the ``primary`` one's verdict.

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


def summarize_mark(rows: list[dict], answer_filter: str | None = None) -> dict:
    """avg@k, its standard error over problems, clip rate and mean completion tokens of one mark's rows.

    ``answer_filter``: read ``correct_<filter>`` instead of ``correct``.
    """
    from data_tools.evalstats import summarize

    if answer_filter:
        rows = [{**r, "correct": r[f"correct_{answer_filter}"]} for r in rows]
    s = summarize(rows)
    return dict(avg_at_k=s["pass_at_1"], stderr=s["pass_at_1_stderr"], clip_rate=s["clip_rate"],
                mean_tokens=sum(r["n_tokens"] for r in rows) / len(rows), n_problems=s["n_problems"],
                train_s=max(r["train_s"] for r in rows), step=max(r["step"] for r in rows))


def paired_difference(rows_x: list[dict], rows_y: list[dict]) -> tuple[float, float | None, int]:
    """Mean over problems of (pass rate under x - pass rate under y), its standard error, problem count.

    The standard error is the sample std (ddof=1) of the per-problem differences / sqrt(n): the
    paired form, since every arm is evaluated on the same problems (the problem is the unit of
    sampling, as in ``data_tools.evalstats``). Only problems present in both are used.

    Raises:
        ValueError: no problem in common.
    """
    from data_tools.evalstats import per_problem_rates, stderr_over_problems

    rx, ry = per_problem_rates(rows_x), per_problem_rates(rows_y)
    common = [p for p in rx if p in ry]
    if not common:
        raise ValueError("the two evaluations share no problem")
    diffs = [rx[p][1] / rx[p][0] - ry[p][1] / ry[p][0] for p in common]
    return sum(diffs) / len(diffs), stderr_over_problems(diffs), len(common)


# ------------------------------------------------------------------------------------------- the clock


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class MarkClock:
    """Training clock of one arm: evaluates at each mark, pauses itself while evaluating, stops at the last.

    ``check(model, step)`` is called after every optimizer step. The clock counts wall seconds since
    ``start()`` (plus ``offset_s``, e.g. arm d's stage-one sampling done before its trainer exists)
    minus the seconds spent in ``eval_fn``. When it passes a mark, ``eval_fn(model, mark, train_s, step)``
    runs; after the last mark ``check`` returns True (stop training).
    """

    def __init__(self, marks: list[float], eval_fn, clock=time.perf_counter, sync=_sync):
        self.marks, self.eval_fn, self.clock, self.sync = list(marks), eval_fn, clock, sync
        self.next = 0
        self.paused = 0.0
        self.t0: float | None = None
        self.offset_s = 0.0

    def start(self, offset_s: float = 0.0) -> None:
        self.sync()
        self.t0, self.offset_s = self.clock(), offset_s

    def elapsed(self) -> float:
        return self.clock() - self.t0 - self.paused + self.offset_s

    @property
    def done(self) -> bool:
        return self.next >= len(self.marks)

    def check(self, model, step: int) -> bool:
        if self.t0 is None:
            self.start()
        self.sync()
        t = self.elapsed()
        while not self.done and t >= self.marks[self.next]:
            e0 = self.clock()
            self.eval_fn(model, self.marks[self.next], t, step)
            self.sync()
            self.paused += self.clock() - e0
            self.next += 1
        return self.done


def _clock_callback(clock: MarkClock):
    from transformers import TrainerCallback

    class _ClockCallback(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            if clock.t0 is None:
                clock.start()

        def on_step_end(self, args, state, control, model=None, **kw):
            if clock.check(model, state.global_step):
                control.should_training_stop = True

    return _ClockCallback()


# ------------------------------------------------------------------------------------------- SFT


def sft(model, tok, examples: list[dict], cfg: LearningConfig, *, out_dir: Path, lr: float, clock: MarkClock):
    """Fine-tune ``model`` in place with TRL's ``SFTTrainer`` on prompt/completion ``examples`` until ``clock`` stops.

    Prompts are the student's chat-rendered prompt strings (the same text as rollouts and evaluation),
    completions the solutions; the loss is on completion tokens only (TRL ``completion_only_loss``),
    EOS appended by TRL. Constant LR, AdamW, float32 weights, no checkpoints.
    """
    import torch
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(out_dir), per_device_train_batch_size=cfg.sft_batch_size, learning_rate=lr,
                     lr_scheduler_type="constant", num_train_epochs=10_000, logging_steps=25, save_strategy="no",
                     report_to="none", bf16=False, max_length=512, completion_only_loss=True, seed=cfg.seed,
                     disable_tqdm=True, dataloader_num_workers=0, use_cpu=not torch.cuda.is_available(),
                     max_grad_norm=1.0)
    ds = Dataset.from_list([{"prompt": e["prompt"], "completion": e["completion"]} for e in examples])
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok,
                         callbacks=[_clock_callback(clock)])
    trainer.remove_callback(PrinterCallback)  # the log dicts go to trainer.state.log_history; keep the console short
    trainer.train()
    from data_tools.runio import write_text

    write_text("".join(json.dumps(h) + "\n" for h in trainer.state.log_history),
               Path(out_dir) / "metrics" / "train.jsonl")  # as OPDTrainer's arms write theirs
    return trainer


def sft_examples(tok, rows: list[dict], cfg: LearningConfig) -> list[dict]:
    """Prompt/completion pairs for ``sft``: the student's rendered prompt and the row's reference solution."""
    from data_tools.prompts import render, student_messages

    return [{"prompt": render(tok, student_messages(r["problem"], cfg.prompt_style)), "completion": r["solution"]}
            for r in rows]


# ------------------------------------------------------------------------------------------- steps


def load_student(path: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if torch.cuda.is_available():
        model = model.cuda()
    return model, tok


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


def make_teacher(cfg: LearningConfig, student_path: str, data: dict[str, Path]) -> Path:
    """Fine-tune the student on the training problems' reference solutions -> ``<out>/teacher``; evaluate it."""
    import shutil

    dest = cfg.dir / "teacher"
    if (dest / "config.json").exists() and (cfg.dir / "evals" / "teacher.parquet").exists():
        return dest
    model, tok = load_student(student_path)
    test = read_rows(data["test"])
    evals: list[dict] = []

    def on_mark(m, mark, t, step):
        evals.extend(evaluate(m, tok, test, cfg, name="teacher", mark_s=mark, train_s=t, step=step))

    clock = MarkClock([cfg.teacher_sft_s], on_mark)
    t0 = time.time()
    sft(model, tok, sft_examples(tok, read_rows(data["train"]), cfg), cfg, out_dir=cfg.dir / "work" / "teacher_sft",
        lr=cfg.teacher_lr, clock=clock)
    tmp = cfg.dir / ".teacher.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    _write_evals(evals, "teacher", cfg)
    s = summarize_mark(evals)
    print(f"[learning] teacher: SFT {cfg.teacher_sft_s:.0f}s (wall {time.time() - t0:.0f}s) -> avg@{cfg.eval_samples} "
          f"{s['avg_at_k']:.3f} ± {s['stderr']:.3f} clip {s['clip_rate']:.2f}", flush=True)
    return dest


def eval_student(cfg: LearningConfig, student_path: str, data: dict[str, Path]) -> None:
    """Mark 0 of every arm: the initial student on the held-out problems."""
    if (cfg.dir / "evals" / "student.parquet").exists():
        return
    model, tok = load_student(student_path)
    rows = evaluate(model, tok, read_rows(data["test"]), cfg, name="student", mark_s=0.0, train_s=0.0, step=0)
    _write_evals(rows, "student", cfg)
    s = summarize_mark(rows)
    print(f"[learning] student at 0 s: avg@{cfg.eval_samples} {s['avg_at_k']:.3f} ± {s['stderr']:.3f} "
          f"clip {s['clip_rate']:.2f} tokens {s['mean_tokens']:.1f}", flush=True)


def check_fast_generation(cfg: LearningConfig, student_path: str) -> bool:
    """Greedy completions from the fast path equal HF ``generate``'s on a few prompts (else fall back)."""
    import torch

    from data_tools.prompts import render, student_messages
    from trainers.generation import SamplingParams, generator_for

    model, tok = load_student(student_path)
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
        agree = sum(1 for x, y in zip(ref[:cut], f) if x == y)
        ok &= agree >= min(8, cut)
    return ok


def run_arm(cfg: LearningConfig, arm: str) -> None:
    """Train one arm for ``budget_s`` training seconds, evaluating at the marks -> ``evals/<arm>.parquet``."""
    import torch

    test = read_rows(cfg.dir / "data" / "test.parquet")
    student_path = json.loads((cfg.dir / "settings.json").read_text())["student_path"]
    teacher_path = str(cfg.dir / "teacher")
    evals: list[dict] = []
    torch.manual_seed(cfg.seed)
    t_wall = time.time()

    if arm == "d":
        model, tok = load_student(teacher_path)  # stage one: the teacher samples the training problems
        _sync()
        t0 = time.perf_counter()  # d's clock starts here: its data generation is part of its budget
        rows = read_rows(cfg.dir / "data" / "train.parquet")[: cfg.stage_one_problems]
        s1 = stage_one(model, tok, rows, cfg)
        _sync()
        offset = time.perf_counter() - t0
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        model, tok = load_student(student_path)
        verified = [r for r in s1 if r["correct"] or cfg.sft_filter == "none"]
        print(f"[learning] arm d: stage one {len(s1)} teacher samples, {sum(r['correct'] for r in s1)} verified, "
              f"{len(verified)} kept (sft_filter={cfg.sft_filter}), {offset:.1f}s (counted in d's budget)", flush=True)
        if not verified:
            raise RuntimeError("arm d: the teacher produced no verified solution; nothing to fine-tune on")

        def on_mark(m, mark, t, step):
            evals.extend(evaluate(m, tok, test, cfg, name="d", mark_s=mark, train_s=t, step=step))

        clock = MarkClock(cfg.mark_list, on_mark)
        clock.start(offset_s=offset)
        if not clock.check(model, 0):  # the sampling may already have passed early marks
            sft(model, tok, [{"prompt": r["prompt"], "completion": r["completion"]} for r in verified], cfg,
                out_dir=cfg.dir / "arms" / "d", lr=cfg.lr, clock=clock)
        else:  # stage one used the whole budget: no SFT step; the empty log says so
            from data_tools.runio import write_text

            print("[learning] arm d: stage one used the whole budget, no fine-tuning step", flush=True)
            write_text("", cfg.dir / "arms" / "d" / "metrics" / "train.jsonl")
    else:
        from transformers import PrinterCallback

        from trainers.opd_trainer import OPDConfig, OPDTrainer, build_train_dataset, load_curriculum

        w_kl, w_reward = {"a": (0.0, 1.0), "b": (1.0, 0.0), "c": (1.0, 1.0), "e": (1.0, 1.0)}[arm]
        args = OPDConfig(
            output_dir=str(cfg.dir / "arms" / arm), student_model=student_path,
            teacher_model=None if arm in ("a", "e") else teacher_path,
            curriculum_path=str(cfg.dir / "data" / "curriculum.parquet"), experiment_name=f"learning-{arm}",
            teacher_context="privileged" if arm == "e" else "teacher", kl_mode="sampled", w_kl=w_kl, w_reward=w_reward,
            num_generations=cfg.num_generations, per_device_train_batch_size=cfg.completions_per_step,
            gradient_accumulation_steps=1, learning_rate=cfg.lr, max_completion_length=cfg.max_new_tokens,
            temperature=cfg.train_temperature, prompt_style=cfg.prompt_style, curriculum="shuffled", seed=cfg.seed,
            max_wall_time_seconds=10**7, deadline_reserve_seconds=0, ckpt_every_minutes=0, ckpt_every_steps=0,
            resume=False, save_rollouts=True, fast_generation=cfg.fast_generation, compile_layers=False,
            report_to="none", max_grad_norm=1.0, use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
            answer_filter=cfg.answer_filter)
        model, tok = load_student(student_path)
        ds = build_train_dataset(load_curriculum(args.curriculum_path), tok, prompt_style=cfg.prompt_style)
        trainer = OPDTrainer(model=model, teacher_model=args.teacher_model, args=args, train_dataset=ds,
                             processing_class=tok)

        def on_mark(m, mark, t, step):
            evals.extend(evaluate(trainer.accelerator.unwrap_model(m), tok, test, cfg, name=arm, mark_s=mark,
                                  train_s=t, step=step))

        trainer.add_callback(_clock_callback(MarkClock(cfg.mark_list, on_mark)))
        trainer.remove_callback(PrinterCallback)  # per-step metrics are in arms/<arm>/metrics/train.jsonl
        trainer.train()
    _write_evals(evals, arm, cfg)
    last = summarize_mark([r for r in evals if r["mark_s"] == cfg.mark_list[-1]])
    print(f"[learning] arm {arm} ({arm_label(arm, cfg)}): avg@{cfg.eval_samples} {last['avg_at_k']:.3f} ± {last['stderr']:.3f} "
          f"at {last['train_s']:.0f}s (step {last['step']}), clip {last['clip_rate']:.2f}, "
          f"wall {time.time() - t_wall:.0f}s", flush=True)


def stage_one(model, tok, rows: list[dict], cfg: LearningConfig) -> list[dict]:
    """Arm d's data: the teacher samples each training problem; the grader marks each sample -> ``data/stage_one.parquet``."""
    from data_tools.grader import grade_batch
    from data_tools.prompts import render, student_messages
    from data_tools.runio import write_parquet

    k = cfg.stage_one_samples
    prompts = [render(tok, student_messages(r["problem"], cfg.prompt_style)) for r in rows for _ in range(k)]
    g = generate(model, tok, prompts, max_new_tokens=cfg.max_new_tokens, temperature=cfg.eval_temperature,
                 batch=cfg.eval_batch, seed=cfg.seed + 104729, fast=cfg.fast_generation)
    verdicts = grade_batch(g.texts, [r["answer"] for r in rows for _ in range(k)], answer_filter=cfg.answer_filter)
    out, seen = [], set()
    for i, (text, v) in enumerate(zip(g.texts, verdicts)):
        r = rows[i // k]
        dup = (r["problem_id"], text) in seen
        seen.add((r["problem_id"], text))
        out.append(dict(problem_id=r["problem_id"], sample_index=i % k, prompt=prompts[i], completion=text,
                        correct=bool(v.correct) and not g.clipped[i] and not dup, graded_correct=bool(v.correct),
                        duplicate=dup, n_tokens=len(g.ids[i]), finish_reason="length" if g.clipped[i] else "stop"))
    write_parquet(out, cfg.dir / "data" / "stage_one.parquet")
    return out


# ------------------------------------------------------------------------------------------- report


def _collect(cfg: LearningConfig, evals: dict[str, list[dict]], f: str) -> dict:
    """Per-mark summaries under answer filter ``f``, the best arm at the last mark, paired comparisons."""
    base = evals["student"]
    out: dict = {"answer_filter": f, "student": summarize_mark(base, f), "arms": {}}
    if "teacher" in evals:
        out["teacher"] = summarize_mark(evals["teacher"], f)
    finals: dict[str, list[dict]] = {}
    for arm in [a for a in ARMS if a in evals]:
        rows = evals[arm]
        by_mark = {str(m): summarize_mark(mr, f) for m in cfg.mark_list if (mr := [r for r in rows if r["mark_s"] == m])}
        out["arms"][arm] = {"label": arm_label(arm, cfg), "marks": by_mark}
        last = [r for r in rows if r["mark_s"] == cfg.mark_list[-1]]
        if last:
            finals[arm] = [{**r, "correct": r[f"correct_{f}"]} for r in last]
    if finals:  # paired comparisons at the last mark: the best arm against every other, each against the start
        best = max(finals, key=lambda a: summarize_mark(finals[a])["avg_at_k"])
        out["best_arm"] = best
        start = [{**r, "correct": r[f"correct_{f}"]} for r in base]
        cmp = {}
        for arm, rows in finals.items():
            d, se, _ = paired_difference(finals[best], rows) if arm != best else (0.0, None, len(rows))
            d0, se0, _ = paired_difference(rows, start)
            cmp[arm] = {"best_minus_arm": d, "stderr": se, "n_sigma": (d / se) if se else None,
                        "gain_over_start": d0, "gain_stderr": se0}
        out["comparisons_at_last_mark"] = cmp
    return out


def load_evals(cfg: LearningConfig) -> dict[str, list[dict]]:
    """``evals/<name>.parquet`` rows by name (student, teacher, arms).

    Raises:
        FileNotFoundError: no ``evals/student.parquet`` (the run has not started).
        ValueError: rows lack ``correct_numeric`` / ``correct_math`` (written before both were stored:
            run ``--stage regrade``).
    """
    import pyarrow.parquet as pq

    ev = cfg.dir / "evals"
    if not (ev / "student.parquet").exists():
        raise FileNotFoundError(f"{ev / 'student.parquet'} not found: run the experiment first")
    out = {}
    for name in ["student", "teacher", *ARMS]:  # every arm this directory has results for
        p = ev / f"{name}.parquet"
        if p.exists():
            out[name] = pq.read_table(p).to_pylist()
            if out[name] and "correct_numeric" not in out[name][0]:
                raise ValueError(f"{p} has no correct_numeric/correct_math columns: run --stage regrade first")
    return out


def report(cfg: LearningConfig) -> dict:
    """Collect ``evals/*.parquet`` into ``results.json``, ``results.md`` and ``learning.png``.

    The top-level numbers use ``cfg.report_filter``; ``other_filter`` holds the same under the other one.
    """
    from data_tools.grader import ANSWER_FILTERS
    from data_tools.runio import write_json

    evals = load_evals(cfg)
    res: dict = {"settings": dataclasses.asdict(cfg), **_collect(cfg, evals, cfg.report_filter),
                 "skipped": {a: "not run (see the run log)" for a in cfg.arm_list if a not in evals}}
    skip_file = cfg.dir / "skipped.json"  # why run_all skipped or lost arms, kept for later reports
    if skip_file.exists():
        res["skipped"].update({a: w for a, w in json.loads(skip_file.read_text()).items() if a not in evals})
    other = [f for f in ANSWER_FILTERS if f != cfg.report_filter][0]
    res["other_filter"] = _collect(cfg, evals, other)
    write_json(res, cfg.dir / "results.json")
    (cfg.dir / "results.md").write_text(results_markdown(res, cfg))
    plot(res, cfg, cfg.dir / "learning.png")
    return res


def regrade(cfg: LearningConfig) -> None:
    """Re-grade every ``evals/*.parquet`` under both answer filters (``grade_rows``), atomically per file.

    For runs whose rows predate ``correct_numeric`` / ``correct_math``; the held-out answers come from
    ``data/test.parquet`` (rebuilt from the settings when absent: the data are deterministic).
    """
    import pyarrow.parquet as pq

    test = read_rows(build_data(cfg)["test"])
    answers = {r["problem_id"]: r["answer"] for r in test}
    for p in sorted((cfg.dir / "evals").glob("*.parquet")):
        rows = pq.read_table(p).to_pylist()
        if "correct" in rows[0] and "correct_math" not in rows[0]:
            for r in rows:  # keep the verdict the run itself recorded
                r["correct_recorded"] = r["correct"]
        _write_evals(grade_rows(rows, answers, cfg.answer_filter), p.stem, cfg)
        n = len(rows)
        print(f"[learning] regraded {p.name}: numeric {sum(r['correct_numeric'] for r in rows) / n:.3f}, "
              f"math {sum(r['correct_math'] for r in rows) / n:.3f} over {n} samples", flush=True)


def arm_label(arm: str, cfg: LearningConfig) -> str:
    if arm == "d" and cfg.sft_filter == "none":
        return "off-policy SFT on all teacher samples (sft_filter=none)"
    return ARMS[arm]


def _fmt(x, nd=3):
    return "—" if x is None else f"{x:.{nd}f}"


def _table(col: dict, cfg: LearningConfig) -> list[str]:
    k = cfg.eval_samples
    lines = []
    s, t = col["student"], col.get("teacher")
    lines.append(f"- start (the student): avg@{k} {_fmt(s['avg_at_k'])} ± {_fmt(s['stderr'])}, clip {_fmt(s['clip_rate'], 2)}, "
                 f"{s['mean_tokens']:.1f} tokens")
    if t:
        lines.append(f"- teacher (student + {cfg.teacher_sft_s:.0f} s SFT on reference solutions, lr {cfg.teacher_lr}): "
                     f"avg@{k} {_fmt(t['avg_at_k'])} ± {_fmt(t['stderr'])}, clip {_fmt(t['clip_rate'], 2)}, "
                     f"{t['mean_tokens']:.1f} tokens")
    lines += ["", "| arm | " + " | ".join(f"{m:g} s" for m in cfg.mark_list) + " | last mark at s | steps | clip | tokens |",
              "|---|" + "---|" * (len(cfg.mark_list) + 4)]
    for arm, a in col["arms"].items():
        cells = [f"{_fmt(a['marks'][str(m)]['avg_at_k'])} ± {_fmt(a['marks'][str(m)]['stderr'])}"
                 if str(m) in a["marks"] else "—" for m in cfg.mark_list]
        last = a["marks"].get(str(cfg.mark_list[-1]), {})
        lines.append(f"| {arm}: {a['label']} | " + " | ".join(cells) + f" | {_fmt(last.get('train_s'), 1)}"
                     f" | {last.get('step', '—')} | {_fmt(last.get('clip_rate'), 2)} | {_fmt(last.get('mean_tokens'), 1)} |")
    if col.get("comparisons_at_last_mark"):
        b = col["best_arm"]
        finals = [a["marks"][str(cfg.mark_list[-1])]["avg_at_k"] for a in col["arms"].values()
                  if str(cfg.mark_list[-1]) in a["marks"]]
        head = (f"Best at {cfg.mark_list[-1]:g} s: **{b}** ({arm_label(b, cfg)})." if max(finals) > min(finals)
                else f"No arm ahead at {cfg.mark_list[-1]:g} s: all at {max(finals):.3f}.")
        lines += ["", f"{head} Paired differences over the same problems:", ""]
        for arm, c in col["comparisons_at_last_mark"].items():
            if arm == b:
                continue
            lines.append(f"- {b} − {arm}: {c['best_minus_arm']:+.3f} ± {_fmt(c['stderr'])} "
                         f"({_fmt(c['n_sigma'], 1)} standard errors)")
        lines.append("")
        for arm, c in col["comparisons_at_last_mark"].items():
            lines.append(f"- {arm} − start: {c['gain_over_start']:+.3f} ± {_fmt(c['gain_stderr'])}")
    return lines


def results_markdown(res: dict, cfg: LearningConfig) -> str:
    k = cfg.eval_samples
    lines = [f"Task `{cfg.task}`, {cfg.n_test} held-out problems x {k} samples (T={cfg.eval_temperature}, "
             f"{cfg.max_new_tokens}-token cap). Budget {cfg.budget_s:.0f} training seconds per arm. "
             f"Training reward and stage one graded with answer filter `{cfg.answer_filter}`. A mark is evaluated "
             f"at the first optimizer step that ends past it (\"last mark at s\"; 0 steps: no update in time).", "",
             f"### avg@{k}, answer filter `{res['answer_filter']}`", ""]
    lines += _table(res, cfg)
    o = res["other_filter"]
    lines += ["", f"### avg@{k}, answer filter `{o['answer_filter']}`", ""] + _table(o, cfg)
    for arm, why in res["skipped"].items():
        lines.append(f"- arm {arm} skipped: {why}")
    return "\n".join(lines) + "\n"


def plot(res: dict, cfg: LearningConfig, path: Path) -> None:
    """avg@k against training minutes, one line per arm (error bars: standard error), one panel per answer
    filter; skipped without matplotlib."""
    try:
        import matplotlib
    except ImportError:  # the GPU machine has no matplotlib: `--stage report` redraws it from evals/
        print(f"[learning] matplotlib missing: {path.name} not drawn (run --stage report where it is installed)")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [res, res["other_filter"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), sharey=True)
    for ax, col in zip(axes, panels):
        s = col["student"]
        for arm, a in col["arms"].items():
            ms = [m for m in cfg.mark_list if str(m) in a["marks"]]
            xs = [0.0] + [a["marks"][str(m)]["train_s"] / 60 for m in ms]
            ys = [s["avg_at_k"]] + [a["marks"][str(m)]["avg_at_k"] for m in ms]
            es = [s["stderr"] or 0] + [a["marks"][str(m)]["stderr"] or 0 for m in ms]
            ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=f"{arm}: {a['label']}")
        if col.get("teacher"):
            ax.axhline(col["teacher"]["avg_at_k"], color="grey", ls="--", lw=1, label="teacher")
        ax.set_xlabel("training minutes on the arm's own clock (evaluation excluded)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"answer filter: {col['answer_filter']}" +
                     (" (reported)" if col is res else " (equal expressions accepted)"))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"avg@{cfg.eval_samples} on {cfg.n_test} held-out problems ({cfg.task})")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"SmolLM2-135M-Instruct: arms at equal training seconds (reward graded '{cfg.answer_filter}')")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)
    plt.close(fig)


# ------------------------------------------------------------------------------------------- main


def _parse(argv):
    from transformers import HfArgumentParser

    parser = HfArgumentParser(LearningConfig)
    parser.add_argument("--stage", default="all", choices=["all", "arm", "report", "regrade"],
                        help="all: data, teacher, baseline, every arm (each in a subprocess), report. report: "
                             "redraw from evals/. regrade: grade evals/ again under both answer filters.")
    parser.add_argument("--arm", default=None, help="--stage arm: which arm.")
    cfg, extra = parser.parse_args_into_dataclasses(args=argv)
    return cfg, extra


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
        torch.backends.cuda.matmul.allow_tf32 = True  # float32 weights (design.md section 8), TF32 matmuls
        torch.backends.cudnn.allow_tf32 = True
    if extra.stage in ("arm", "report", "regrade"):
        saved = cfg.dir / "settings.json"
        if not saved.exists():
            print(f"bench.learning: {saved} not found: run the experiment first (--stage all)", file=sys.stderr)
            return 2
        names = {f.name for f in dataclasses.fields(LearningConfig)} - {"preset"}
        kept = json.loads(saved.read_text())
        # runs made before these settings existed graded rewards with math-verify equivalence only
        kept.setdefault("answer_filter", "math")
        kept["fast_generation"] = kept.get("fast_generation_used", kept.get("fast_generation", True))
        kept = {k: v for k, v in kept.items() if k in names}
        kept["report_filter"] = cfg.report_filter  # a report chooses its filter on its own command line
        kept["out"] = str(cfg.dir)  # the directory may have moved since (e.g. copied back from a GPU machine)
        try:
            cfg = LearningConfig(**kept)
            if extra.stage == "arm":
                if extra.arm not in ARMS:
                    raise ValueError(f"--arm must be one of {sorted(ARMS)}")
                run_arm(cfg, extra.arm)
                return 0
            if extra.stage == "regrade":
                regrade(cfg)
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
            return run_all(cfg)
    except LockHeld as e:
        print(f"bench.learning: {e}", file=sys.stderr)
        return EXIT_LOCKED
    except (ValueError, FileNotFoundError) as e:
        print(f"bench.learning: {e}", file=sys.stderr)
        return 2


#: Settings that may differ between invocations on one run directory: the arms asked for this time,
#: the deadline, what the fast-generation check decided, and where the directory lives.
LOOSE_SETTINGS = ("arms", "deadline_s", "fast_generation_used", "out")


def merge_settings(old: dict | None, new: dict, arms: list[str]) -> dict:
    """The settings to record for a (re)started run: ``new``, with the arms of ``old`` kept and its
    ``fast_generation_used`` decision reused.

    Raises:
        ValueError: ``old`` records other values for a setting outside ``LOOSE_SETTINGS`` (a different
            experiment: mixing its results would be wrong); the message names them.
    """
    out = dict(new)
    if old is None:
        out["fast_generation_used"] = bool(new.get("fast_generation", True))
        return out
    a = {k: v for k, v in old.items() if k not in LOOSE_SETTINGS}
    b = {k: v for k, v in new.items() if k not in LOOSE_SETTINGS}
    if a != b:
        diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        raise ValueError(f"the run directory holds a run with other settings ({diff}); use another --out")
    out["arms"] = ",".join(x for x in dict.fromkeys(old.get("arms", "").split(",") + arms) if x)
    out["fast_generation_used"] = old.get("fast_generation_used", old.get("fast_generation", True))
    return out


def run_all(cfg: LearningConfig) -> int:
    from data_tools.models import resolve_model
    from data_tools.runio import write_json

    t_start = time.time()
    settings_path = cfg.dir / "settings.json"
    student_path = resolve_model(cfg.student_model)
    settings = {**dataclasses.asdict(cfg), "preset": "", "student_path": student_path}
    old = json.loads(settings_path.read_text()) if settings_path.exists() else None
    settings = merge_settings(old, settings, cfg.arm_list)
    if old is None and cfg.fast_generation and not check_fast_generation(cfg, student_path):
        print("[learning] fast generation disagrees with HF generate here: using HF generate for every arm", flush=True)
        settings["fast_generation_used"] = False
    write_json(settings, settings_path)
    data = build_data(cfg)
    print(f"[learning] data: {len(read_rows(data['train']))} train / {len(read_rows(data['test']))} test ({cfg.task}); "
          f"out {cfg.dir}", flush=True)
    eval_student(cfg, student_path, data)
    if any(a in cfg.arm_list for a in ("b", "c", "d")):
        make_teacher(cfg, student_path, data)
    skipped = {}
    for arm in cfg.arm_list:
        if (cfg.dir / "evals" / f"{arm}.parquet").exists():
            print(f"[learning] arm {arm}: already done", flush=True)
            continue
        if cfg.deadline_s and time.time() - t_start + cfg.budget_s + cfg.arm_overhead_s > cfg.deadline_s:
            skipped[arm] = f"not enough time left in deadline_s={cfg.deadline_s:.0f}"
            print(f"[learning] arm {arm}: skipped ({skipped[arm]})", flush=True)
            continue
        cmd = [sys.executable, "-m", "bench.learning", "--out", str(cfg.dir), "--stage", "arm", "--arm", arm]
        rc = subprocess.call(cmd, cwd=str(ROOT))
        if rc != 0:
            skipped[arm] = f"failed with exit code {rc}"
            print(f"[learning] arm {arm}: FAILED (exit {rc})", flush=True)
    write_json(skipped, cfg.dir / "skipped.json")
    report(cfg)
    print((cfg.dir / "results.md").read_text(), flush=True)
    print(f"[learning] done in {time.time() - t_start:.0f}s: {cfg.dir}/results.md, learning.png", flush=True)
    return 0 if not any("failed" in w for w in skipped.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
