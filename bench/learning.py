"""Learning efficacy (issue 7): which stage-two objective makes a small student better per GPU minute.

    python -m bench.learning --out DIR                       # the GPU experiment (all arms, defaults below)
    python -m bench.learning --out DIR --task gsm8k          # the same on GSM8K (needs ../shared/data)
    python -m bench.learning --out DIR --preset cpu_smoke    # seconds-long budgets, to check the plumbing on a CPU
    python -m bench.learning --out DIR --start_sft_steps 60 --arms d,d@3e-5,f,f@3e-5 --seeds 0,1 --deadline_s 460
                                         # regime (i) start, an lr sweep, two seeds; re-run until nothing is left

Student: SmolLM2-135M-Instruct (the embedded default, float32). One task, one set of held-out
problems; every arm is given the same *training* seconds (its own clock, evaluation paused)
and is evaluated at the same marks on that clock:

    a  reward only              OPDTrainer, w_kl = 0, w_reward = 1 (GRPO-style group advantage)
    b  distillation only        OPDTrainer, w_kl = 1, w_reward = 0, the stronger teacher
    c  distillation + reward    OPDTrainer, w_kl = 1, w_reward = 1, the stronger teacher
    d  off-policy fine-tuning   stage one (the teacher samples the train problems; the grader keeps the
                                verified solutions) then TRL SFTTrainer on them; the sampling is on d's clock
    e  self-distillation        as c, but the teacher is the frozen initial student reading the
                                reference solution (privileged context, OPSD)
    f  combined recipe          OPDTrainer: w_kl = 1, w_reward = 1, w_sft * cross-entropy on stage one's verified
                                solutions (reaching it through the curriculum's teacher_solution column) and a
                                share of off-policy steps scheduled over the arm's clock (trainers.offpolicy);
                                stage one is on f's clock, as on d's
    g  self-distillation, hint  as e, the privileged context holding the reference solution *and* the final
                                answer stated explicitly
    h  combined, full KL        as f with the exact full-vocabulary reverse KL (kl_mode full), not its sampled
                                single-token estimate (bench/opd_gradients.py measures the two)

An arm runs at ``lr`` unless ``--arm_lr`` or an ``x@lr`` entry of ``--arms`` says otherwise, once per
``--seeds`` entry; the run's name (``f@3e-05-s1``) names its files. The start is the raw student, or
with ``start_sft_s`` / ``start_sft_steps`` a mid-trained one (regime (i): in the teacher's format,
regime (ii): SFT nearly saturated); the teacher is the start plus more SFT. With ``deadline_s`` a
command runs the arm runs that fit and stops; the same command again continues (finished pieces,
the start and the teacher are kept), so an experiment runs as a series of short pieces.

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
import math
import os
import re
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

from bench.learning_report import report, summarize_mark  # noqa: E402 - after the sys.path line

ARMS = {
    "a": "reward only (w_kl=0)",
    "b": "OPD only (w_reward=0)",
    "c": "OPD + reward",
    "d": "off-policy SFT on teacher's verified solutions",
    "e": "OPD + reward, privileged self-teacher",
    "f": "combined: OPD + reward + SFT on verified solutions, clock-scheduled mix",
    "g": "OPD + reward, privileged self-teacher shown the solution and the final answer",
    "h": "combined as f, exact full-vocabulary reverse KL (kl_mode=full)",
}
#: An arm run: its letter, then ``@<lr>`` when its learning rate is not ``lr``, then ``-s<seed>`` when its
#: seed is not ``seed`` (``f@3e-05-s1``). The name is the file name of its evaluations.
ARM_RUN = re.compile(r"([a-z])(?:@([0-9.]+(?:e[+-]?[0-9]+)?))?(?:-s([0-9]+))?")
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
    arms: str = field(default="a,b,c,d,e", metadata={
        "help": "Comma-separated arms to run, in this order (see ARMS); 'f@3e-5' runs arm f at that learning rate."})
    arm_lr: str = field(default="", metadata={
        "help": "Learning rates per arm, e.g. 'd=5e-5,f=3e-5' (arms not named, and not given as x@lr, use lr)."})
    seeds: str = field(default="", metadata={
        "help": "Comma-separated seeds: every arm runs once per seed (same data, start, teacher); empty = seed."})
    start_sft_s: float = field(default=0.0, metadata={
        "help": "Training seconds of SFT on the reference solutions that make the starting student (0 = the raw "
                "model): regime (i) ~15 (in the teacher's format, about half its score), regime (ii) until SFT "
                "gains little. The teacher is this start + teacher_sft_s more."})
    w_sft: float = field(default=1.0, metadata={"help": "Arms f, h: OPDConfig.w_sft (cross-entropy on verified solutions in on-policy steps)."})
    sft_share_start: float = field(default=0.8, metadata={"help": "Arms f, h: share of training seconds in off-policy steps at 0 s."})
    sft_share_end: float = field(default=0.2, metadata={"help": "Arms f, h: the same share at budget_s (linear in between)."})
    student_model: str | None = field(default=None, metadata={"help": "Local HF dir; empty = embedded SmolLM2-135M-Instruct."})
    n_train: int = field(default=6000, metadata={"help": "Training problems (the teacher's SFT data and every arm's prompts)."})
    n_test: int = field(default=300, metadata={"help": "Held-out problems evaluated at every mark."})
    gsm8k_dir: str = field(default=str(SHARED / "data"), metadata={"help": "Folder of gsm8k_{train,test}.jsonl."})
    budget_s: float = field(default=150.0, metadata={"help": "Training seconds per arm (its own clock, evals paused)."})
    marks: str = field(default="15,30,60,100,150", metadata={
        "help": "Training-clock seconds at which each arm is evaluated (the last one ends the arm; <= budget_s)."})
    teacher_sft_s: float = field(default=90.0, metadata={"help": "Training seconds of the teacher's fine-tuning."})
    start_sft_steps: int = field(default=0, metadata={
        "help": "> 0: the start's SFT runs this many optimizer steps instead of start_sft_s seconds. A step count is "
                "reproducible for a seed, so pieces of one experiment run on different (fresh) machines rebuild the "
                "same start."})
    teacher_sft_steps: int = field(default=0, metadata={"help": "> 0: the same for the teacher (instead of teacher_sft_s)."})
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
        bad = [a for a in self.arm_list if not ARM_RUN.fullmatch(a) or a[0] not in ARMS or "-s" in a]
        if bad or not self.arm_list:
            raise ValueError(f"arms must be a comma-separated subset of {sorted(ARMS)} (each optionally @lr), "
                             f"got {self.arms!r}")
        try:
            rates, seeds = self.arm_lr_table, self.seed_list
        except ValueError:
            raise ValueError(f"arm_lr must read like 'd=5e-5,f=3e-5' and seeds like '0,1,2', got {self.arm_lr!r}, "
                             f"{self.seeds!r}") from None
        if any(k not in ARMS or v <= 0 for k, v in rates.items()) or min(seeds) < 0:
            raise ValueError(f"arm_lr names arms of {sorted(ARMS)} with rates > 0, seeds are >= 0; got "
                             f"{self.arm_lr!r}, {self.seeds!r}")
        if min(self.start_sft_steps, self.teacher_sft_steps) < 0:
            raise ValueError("start_sft_steps and teacher_sft_steps must be >= 0")
        if self.start_sft_s < 0 or self.w_sft < 0 or not (0 <= self.sft_share_start <= 1 and 0 <= self.sft_share_end <= 1):
            raise ValueError("need start_sft_s >= 0, w_sft >= 0 and sft shares in [0, 1]")
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
    def arm_lr_table(self) -> dict[str, float]:
        return {k.strip(): float(v) for k, v in (x.split("=", 1) for x in self.arm_lr.split(",") if x.strip())}

    @property
    def seed_list(self) -> list[int]:
        return [int(x) for x in self.seeds.split(",") if x.strip()] or [self.seed]

    def run_name(self, arm: str, lr: float, seed: int) -> str:
        return arm + (f"@{lr:g}" if lr != self.lr else "") + (f"-s{seed}" if seed != self.seed else "")

    @property
    def instances(self) -> list[str]:
        """The arm runs this invocation asks for (``ARM_RUN`` names): every arm at its rate, for every seed."""
        out = []
        for spec in self.arm_list:
            arm, lr, _ = ARM_RUN.fullmatch(spec).groups()
            rate = float(lr) if lr else self.arm_lr_table.get(arm, self.lr)
            out += [self.run_name(arm, rate, s) for s in self.seed_list]
        return list(dict.fromkeys(out))

    def parse_run(self, name: str) -> tuple[str, float, int]:
        """``(arm, learning rate, seed)`` of a run name. Raises ValueError for a name ``ARM_RUN`` does not match."""
        m = ARM_RUN.fullmatch(name)
        if not m or m.group(1) not in ARMS:
            raise ValueError(f"not an arm run name: {name!r} (e.g. 'c', 'f@3e-05', 'd-s1')")
        return m.group(1), float(m.group(2)) if m.group(2) else self.lr, int(m.group(3)) if m.group(3) else self.seed

    def label(self, group: str) -> str:
        """Label of an arm (a run name without its seed) for tables and the plot."""
        arm, lr, _ = self.parse_run(group)
        text = ("off-policy SFT on all teacher samples (sft_filter=none)" if arm == "d" and self.sft_filter == "none"
                else ARMS[arm])
        return text + (f", lr {lr:g}" if lr != self.lr else "")

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


def sft(model, tok, examples: list[dict], cfg: LearningConfig, *, out_dir: Path, lr: float, clock: MarkClock,
        max_steps: int = -1):
    """Fine-tune ``model`` in place with TRL's ``SFTTrainer`` on prompt/completion ``examples`` until ``clock``
    stops (or after ``max_steps`` optimizer steps when > 0).

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
                     max_grad_norm=1.0, max_steps=max_steps)
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


def fine_tune(cfg: LearningConfig, src: str, data: dict[str, Path], *, dest_name: str, eval_name: str,
              seconds: float, steps: int = 0) -> Path:
    """Fine-tune ``src`` on the training problems' reference solutions for ``seconds`` (or ``steps`` optimizer
    steps when > 0) -> ``<out>/<dest_name>``; its evaluation -> ``evals/<eval_name>.parquet``. Used for the
    teacher and for a mid-trained start."""
    import shutil

    dest = cfg.dir / dest_name
    if (dest / "config.json").exists() and (cfg.dir / "evals" / f"{eval_name}.parquet").exists():
        return dest
    student_path = src
    model, tok = load_student(student_path)
    test = read_rows(data["test"])
    evals: list[dict] = []

    def on_mark(m, mark, t, step):
        evals.extend(evaluate(m, tok, test, cfg, name=eval_name, mark_s=mark, train_s=t, step=step))

    clock = MarkClock([math.inf if steps else seconds], on_mark)
    t0 = time.time()
    trainer = sft(model, tok, sft_examples(tok, read_rows(data["train"]), cfg), cfg,
                  out_dir=cfg.dir / "work" / f"{dest_name}_sft", lr=cfg.teacher_lr, clock=clock, max_steps=steps or -1)
    if steps:
        seconds = clock.elapsed()
        on_mark(model, seconds, seconds, trainer.state.global_step)
    tmp = cfg.dir / f".{dest_name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    _write_evals(evals, eval_name, cfg)
    s = summarize_mark(evals)
    print(f"[learning] {dest_name}: SFT {seconds:.0f}s (wall {time.time() - t0:.0f}s) -> avg@{cfg.eval_samples} "
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


def run_arm(cfg: LearningConfig, name: str) -> None:
    """Train one arm run for ``budget_s`` training seconds, evaluating at the marks -> ``evals/<name>.parquet``.

    ``name`` is an ``ARM_RUN`` name: its arm, learning rate and seed (which also seeds the evaluation's sampling).
    """
    import torch

    arm, lr, seed = cfg.parse_run(name)
    cfg = dataclasses.replace(cfg, lr=lr, seed=seed)
    test = read_rows(cfg.dir / "data" / "test.parquet")
    student_path = json.loads((cfg.dir / "settings.json").read_text())["start_path"]
    teacher_path = str(cfg.dir / "teacher")
    evals: list[dict] = []
    torch.manual_seed(seed)
    t_wall = time.time()

    def on_mark(m, mark, t, step):
        evals.extend(evaluate(m, tok, test, cfg, name=name, mark_s=mark, train_s=t, step=step))

    clock = MarkClock(cfg.mark_list, on_mark)
    offset = 0.0
    if arm in ("d", "f", "h"):  # off-policy arms: stage one's teacher sampling is on their clock
        s1, offset = stage_one_cached(cfg)
        verified = [r for r in s1 if r["correct"] or cfg.sft_filter == "none"]
        print(f"[learning] arm {name}: stage one {len(s1)} teacher samples, {sum(r['correct'] for r in s1)} verified, "
              f"{len(verified)} kept (sft_filter={cfg.sft_filter}), {offset:.1f}s (counted in its budget)", flush=True)
        if not verified:
            raise RuntimeError(f"arm {name}: the teacher produced no verified solution; nothing to fine-tune on")
    if arm == "d":
        model, tok = load_student(student_path)
        clock.start(offset_s=offset)
        if not clock.check(model, 0):  # the sampling may already have passed early marks
            sft(model, tok, [{"prompt": r["prompt"], "completion": r["completion"]} for r in verified], cfg,
                out_dir=cfg.dir / "arms" / name, lr=lr, clock=clock)
        else:  # stage one used the whole budget: no SFT step; the empty log says so
            from data_tools.runio import write_text

            print(f"[learning] arm {name}: stage one used the whole budget, no fine-tuning step", flush=True)
            write_text("", cfg.dir / "arms" / name / "metrics" / "train.jsonl")
    else:
        from transformers import PrinterCallback

        from trainers.opd_trainer import OPDConfig, OPDTrainer, build_train_dataset, load_curriculum

        w_kl, w_reward = (0.0, 1.0) if arm == "a" else (1.0, 0.0) if arm == "b" else (1.0, 1.0)
        curriculum = arm_curriculum(cfg, arm, name, verified if arm in ("f", "h") else None)
        args = OPDConfig(
            output_dir=str(cfg.dir / "arms" / name), student_model=student_path,
            teacher_model=None if arm in ("a", "e", "g") else teacher_path,
            curriculum_path=str(curriculum), experiment_name=f"learning-{name}",
            teacher_context="privileged" if arm in ("e", "g") else "teacher",
            kl_mode="full" if arm == "h" else "sampled", w_kl=w_kl,
            w_reward=w_reward, num_generations=cfg.num_generations, per_device_train_batch_size=cfg.completions_per_step,
            gradient_accumulation_steps=1, learning_rate=lr, max_completion_length=cfg.max_new_tokens,
            temperature=cfg.train_temperature, prompt_style=cfg.prompt_style, curriculum="shuffled", seed=seed,
            max_wall_time_seconds=10**7, deadline_reserve_seconds=0, ckpt_every_minutes=0, ckpt_every_steps=0,
            resume=False, save_rollouts=True, fast_generation=cfg.fast_generation, compile_layers=False,
            report_to="none", max_grad_norm=1.0, use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
            answer_filter=cfg.answer_filter, **(dict(w_sft=cfg.w_sft, sft_share_start=cfg.sft_share_start,
                                                      sft_share_end=cfg.sft_share_end, sft_batch_size=cfg.sft_batch_size)
                                                 if arm in ("f", "h") else {}))
        model, tok = load_student(student_path)
        ds = build_train_dataset(load_curriculum(args.curriculum_path), tok, prompt_style=cfg.prompt_style)
        trainer = OPDTrainer(model=model, teacher_model=args.teacher_model, args=args, train_dataset=ds,
                             processing_class=tok)
        # the mix schedule follows this arm's training clock (evaluations paused), not the process's wall clock
        trainer.time_fraction = lambda: min(1.0, max(0.0, clock.elapsed() / cfg.budget_s))
        clock.start(offset_s=offset)
        trainer.add_callback(_clock_callback(clock))
        trainer.remove_callback(PrinterCallback)  # per-step metrics are in arms/<name>/metrics/train.jsonl
        if not clock.check(trainer.model, 0):
            trainer.train()
    _write_evals(evals, name, cfg)
    last = summarize_mark([r for r in evals if r["mark_s"] == cfg.mark_list[-1]])
    print(f"[learning] arm {name} ({cfg.label(name)}): avg@{cfg.eval_samples} {last['avg_at_k']:.3f} ± "
          f"{last['stderr']:.3f} at {last['train_s']:.0f}s (step {last['step']}), clip {last['clip_rate']:.2f}, "
          f"wall {time.time() - t_wall:.0f}s", flush=True)


def arm_curriculum(cfg: LearningConfig, arm: str, name: str, verified: list[dict] | None) -> Path:
    """The curriculum table an on-policy arm reads (stage one's schema, ``stages.curate.CURRICULUM_SCHEMA``).

    a-e: ``data/curriculum.parquet``. f, h: the same with ``teacher_solution`` = the shortest verified teacher
    sample of each problem from stage one (None where the teacher verified none), as stages.curate writes it.
    g: ``reference`` = the reference solution followed by the verified final answer stated explicitly.
    """
    from data_tools.runio import write_parquet

    base = cfg.dir / "data" / "curriculum.parquet"
    if arm not in ("f", "g", "h"):
        return base
    rows = read_rows(base)
    if arm in ("f", "h"):
        best: dict[str, str] = {}
        for r in verified or []:
            if r["problem_id"] not in best or len(r["completion"]) < len(best[r["problem_id"]]):
                best[r["problem_id"]] = r["completion"]
        for r in rows:
            r["teacher_solution"] = best.get(r["problem_id"])
    else:
        for r in rows:
            r["reference"] = f"{r['reference']}\nThe final answer is {r['answer']}."
    return write_parquet(rows, cfg.dir / "arms" / name / "curriculum.parquet")


def stage_one_cached(cfg: LearningConfig) -> tuple[list[dict], float]:
    """Stage one of the off-policy arms and its seconds, measured once (``data/stage_one.{parquet,json}``).

    Every off-policy arm run charges the measured seconds to its own clock; the samples (seeded by the
    run's ``seed`` setting, not the arm's) are the same for all of them, as one stage one feeds stage two.
    """
    import torch

    p, meta = cfg.dir / "data" / "stage_one.parquet", cfg.dir / "data" / "stage_one.json"
    if p.exists() and meta.exists():
        return read_rows(p), float(json.loads(meta.read_text())["seconds"])
    from data_tools.runio import write_json

    base = dataclasses.replace(cfg, seed=json.loads((cfg.dir / "settings.json").read_text())["seed"])
    model, tok = load_student(str(cfg.dir / "teacher"))
    _sync()
    t0 = time.perf_counter()
    rows = stage_one(model, tok, read_rows(cfg.dir / "data" / "train.parquet")[: cfg.stage_one_problems], base)
    _sync()
    seconds = time.perf_counter() - t0
    write_json({"seconds": seconds}, meta)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows, seconds


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


# ------------------------------------------------------------------------------------------- main


def _parse(argv):
    from transformers import HfArgumentParser

    parser = HfArgumentParser(LearningConfig)
    parser.add_argument("--stage", default="all", choices=["all", "setup", "arm", "report", "regrade"],
                        help="all: data, start, teacher, baseline, every arm (each in a subprocess), report. setup: "
                             "all but the arms. report: redraw from evals/. regrade: grade evals/ again under both "
                             "answer filters.")
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
                cfg.parse_run(extra.arm or "")
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
            return run_all(cfg, setup_only=extra.stage == "setup")
    except LockHeld as e:
        print(f"bench.learning: {e}", file=sys.stderr)
        return EXIT_LOCKED
    except (ValueError, FileNotFoundError) as e:
        print(f"bench.learning: {e}", file=sys.stderr)
        return 2


#: Settings that may differ between invocations on one run directory: the arms asked for this time,
#: the deadline, what the fast-generation check decided, and where the directory lives.
LOOSE_SETTINGS = ("arms", "arm_lr", "seeds", "deadline_s", "fast_generation_used", "out")


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


def run_all(cfg: LearningConfig, setup_only: bool = False) -> int:
    from data_tools.models import resolve_model
    from data_tools.runio import write_json

    t_start = time.time()
    settings_path = cfg.dir / "settings.json"
    student_path = resolve_model(cfg.student_model)
    start_path = str(cfg.dir / "start") if cfg.start_sft_s > 0 or cfg.start_sft_steps else student_path
    settings = {**dataclasses.asdict(cfg), "preset": "", "student_path": student_path, "start_path": start_path}
    old = json.loads(settings_path.read_text()) if settings_path.exists() else None
    settings = merge_settings(old, settings, cfg.arm_list)
    if old is None and cfg.fast_generation and not check_fast_generation(cfg, student_path):
        print("[learning] fast generation disagrees with HF generate here: using HF generate for every arm", flush=True)
        settings["fast_generation_used"] = False
    write_json(settings, settings_path)
    data = build_data(cfg)
    print(f"[learning] data: {len(read_rows(data['train']))} train / {len(read_rows(data['test']))} test ({cfg.task}); "
          f"out {cfg.dir}", flush=True)
    if start_path != student_path:  # a mid-trained start: its evaluation is every arm's mark 0
        fine_tune(cfg, student_path, data, dest_name="start", eval_name="student", seconds=cfg.start_sft_s,
                  steps=cfg.start_sft_steps)
    else:
        eval_student(cfg, student_path, data)
    if setup_only or any(cfg.parse_run(n)[0] in "bcdfh" for n in cfg.instances):
        fine_tune(cfg, start_path, data, dest_name="teacher", eval_name="teacher", seconds=cfg.teacher_sft_s,
                  steps=cfg.teacher_sft_steps)
    if setup_only:
        print(f"[learning] setup done in {time.time() - t_start:.0f}s: {cfg.dir}", flush=True)
        return 0
    skipped = {}
    for arm in cfg.instances:
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
    if any("deadline" in w for w in skipped.values()):
        print(f"[learning] {sum('deadline' in w for w in skipped.values())} arm run(s) left: run the same command "
              "again to continue (finished pieces are kept)", flush=True)
    report(cfg)
    print((cfg.dir / "results.md").read_text(), flush=True)
    print(f"[learning] done in {time.time() - t_start:.0f}s: {cfg.dir}/results.md, learning.png", flush=True)
    return 0 if not any("failed" in w for w in skipped.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
