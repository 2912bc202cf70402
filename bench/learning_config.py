"""Settings of bench/learning.py: the arms, presets, ``LearningConfig`` and the resume rules of a run directory."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: ``mark_s`` of a sequential arm's evaluation at its hand-over (after its last off-policy step; its ``train_s``
#: says when): a value no clock mark takes, so the per-mark tables leave it out and a query picks it by name.
HANDOVER_MARK = -1.0


@dataclass(frozen=True)
class Arm:
    """What an arm trains on: the stage-two objective of one row of the arm table (bench/learning/arms.md).

    ``teacher``: ``"trained"`` = ``<out>/teacher`` (the stronger same-tokenizer teacher), ``"self"`` = the frozen
    start reading the reference solution (``teacher_context="privileged"``), None = no teacher. ``off_policy``:
    ``""`` none; ``"sft"`` every step is cross-entropy on stage one's verified teacher solutions (SFT); ``"mix"``
    ``w_sft`` in on-policy steps plus the off-policy share schedule (``LearningConfig.w_sft``, ``sft_share_*``);
    ``"seq"`` every step off-policy until ``LearningConfig.sft_max_epochs`` passes over the solutions, then every
    step on-policy.
    Either needs stage one, which samples the trained teacher. ``stated_answer``: the privileged context's
    reference ends with the final answer stated.
    """

    label: str
    w_kl: float
    w_reward: float
    teacher: str | None
    off_policy: str = ""
    stated_answer: bool = False
    kl_mode: str = "sampled"

    @property
    def needs_teacher(self) -> bool:
        """The trained teacher must exist: the arm reads it, or its stage one samples it."""
        return self.teacher == "trained" or bool(self.off_policy)


def parse_marks(marks: str) -> list[float]:
    """``--marks`` as seconds: "15,30,60" -> [15.0, 30.0, 60.0] (empty pieces skipped). Raises ValueError."""
    try:
        return [float(x) for x in marks.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"marks must be comma-separated seconds, got {marks!r}") from None


ARM_SPECS: dict[str, Arm] = {
    "a": Arm("reward only (w_kl=0)", 0.0, 1.0, None),
    "b": Arm("OPD only (w_reward=0)", 1.0, 0.0, "trained"),
    "c": Arm("OPD + reward", 1.0, 1.0, "trained"),
    "d": Arm("off-policy SFT on teacher's verified solutions", 0.0, 0.0, None, off_policy="sft"),
    "e": Arm("OPD + reward, privileged self-teacher", 1.0, 1.0, "self"),
    "f": Arm("combined: OPD + reward + SFT on verified solutions, clock-scheduled mix", 1.0, 1.0, "trained",
             off_policy="mix"),
    "g": Arm("OPD + reward, privileged self-teacher shown the solution and the final answer", 1.0, 1.0, "self",
             stated_answer=True),
    "h": Arm("combined as f, exact full-vocabulary reverse KL (kl_mode=full)", 1.0, 1.0, "trained", off_policy="mix",
             kl_mode="full"),
    "i": Arm("combined as f, with g's privileged self-teacher (solution and final answer)", 1.0, 1.0, "self",
             off_policy="mix", stated_answer=True),
    "j": Arm("sequential: SFT on verified solutions for sft_max_epochs passes, then OPD + reward", 1.0, 1.0, "trained",
             off_policy="seq"),
    # j's order with one on-policy term each: which of j's two terms costs what after the hand-over
    "k": Arm("sequential: SFT on verified solutions for sft_max_epochs passes, then OPD only (w_reward=0)", 1.0, 0.0,
             "trained", off_policy="seq"),
    "l": Arm("sequential: SFT on verified solutions for sft_max_epochs passes, then reward only (w_kl=0)", 0.0, 1.0,
             None, off_policy="seq"),
}
#: SFT on the reference solutions: how the mid-trained start and the teacher are made (not an arm)
SFT_REFERENCE = Arm("SFT on reference solutions", 0.0, 0.0, None, off_policy="sft")
ARMS = {k: v.label for k, v in ARM_SPECS.items()}
#: An arm run: its letter, then ``@<lr>`` when its learning rate is not ``learning_rate``, then ``+kl<w>`` when its
#: on-policy KL weight is not the arm's (``w_kl`` = w with ``w_reward`` kept at 1: the KL : reward weight ratio), then
#: ``+ep<n>`` when its passes over stage one's solutions are not ``sft_max_epochs`` (arms j, k, l), then ``+bs<n>``
#: when its rollout batch is not ``per_device_train_batch_size`` completions, then ``+spg<n>`` when each rollout
#: batch is split into n optimizer steps (``steps_per_generation``), then ``-s<seed>`` when its seed is not ``seed``
#: (``f@3e-05-s1``, ``j@3e-06+kl3+ep2-s1``, ``b+bs8``, ``j+spg16``). The name is the file name of its evaluations.
_NUM = r"[0-9.]+(?:e[+-]?[0-9]+)?"
ARM_RUN = re.compile(rf"([a-z])(?:@({_NUM}))?(?:\+kl({_NUM}))?(?:\+ep({_NUM}))?(?:\+bs([0-9]+))?(?:\+spg([0-9]+))?"
                     r"(?:\+(const))?(?:\+(all))?(?:-s([0-9]+))?")
#: Learning-rate schedules an arm can run on (``OPDConfig.lr_scheduler_type``): constant (after ``warmup_steps``), or
#: linear / cosine decay over the arm's training seconds (``trainers.schedules``, the formal recipe's ``linear_time``).
ARM_SCHEDULES = ("constant", "linear_time", "cosine_time")
#: Which decoder layers a cut student keeps (``bench.learning_setup.kept_layers``).
LAYER_CHOICES = ("even", "first")
TASKS = ("ladder", "gsm8k")
SHARED = Path(os.environ.get("OPD_SHARED_DIR", ROOT.parent / "shared"))
#: Named sets of settings. cpu_smoke: toy sizes to run every piece on a CPU in minutes; its teacher
#: (4 s of SFT, 16-token cap) verifies nothing, so arm d fine-tunes on all of its samples.
PRESETS: dict[str, dict] = {
    "": {},
    "cpu_smoke": dict(n_train=48, n_test=6, budget_s=6.0, marks="3,6", teacher_sft_s=4.0,
                      per_device_train_batch_size=8, num_generations=4, max_completion_length=16, eval_samples=2, stage_one_problems=16, sft_batch_size=8,
                      eval_batch=64, sft_filter="none"),
    # regime (iii) (bench/LEARNING.md "Run 3"): a student cut to 12 of the 30 layers and healed by SFT, the
    # full model fine-tuned as its teacher, arms on problems neither saw, long answers, few measured problems, the
    # formal schedule (linear over each arm's training seconds, warm-up in seconds), the plan's 320-token cap and
    # avg@4 on 1,500 held-out problems. GSM8K train in file order: the start and the teacher SFT on problems 1-4400,
    # the arms train on 4401-5900, the held-out set is the file's last 1,500 (--train_data / --test_data change it).
    # The setup stops before any arm when the teacher leads the start by less than +0.15 (the plan's rule 4).
    "regime3": dict(task="gsm8k", train_data=str(SHARED / "data" / "gsm8k_train.jsonl"), student_layers=12,
                    start_sft_steps=300, start_lr=1e-4, teacher_sft_steps=400, teacher_n_train=4400, n_train=1500,
                    unseen_arm_problems=True, n_test=1500, eval_samples=4, max_completion_length=320,
                    stage_one_problems=300, budget_s=150.0, marks="50,100,150", late_marks=2, learning_rate=3e-6,
                    sft_learning_rate=3e-5, sft_max_epochs=8.0, lr_scheduler_type="linear_time", lr_warmup_s=10.0,
                    kl_probe_problems=256, gate_lead=0.15, micro_batch=32),
    # run 4, the formal regime's proxy (bench/learning/run-4-plan.md): a mid-trained start (regime (i)'s: 60 SFT steps
    # at 5e-5), its teacher the start after 400 steps of reward-only RL at a constant 3e-6 (as JustRL-DeepSeek-1.5B is
    # DeepSeek-R1-Distill-Qwen-1.5B after RL), the formal metric's prompt and grader profile, the hard ladder (GSM8K
    # gave the 135M start 0.025: no signal for its RL); the start and the teacher on problems 1-4400, the arms on
    # 4401-5900, 1,500 held out; the gate: +0.10 and +30% over the start, else no arm runs. Stage one as the formal
    # recipe's (4 teacher samples, the start's pass rate over 8, its filter and order).
    "run4": dict(task="ladder", prompt_style="formal", grader_profile="formal", answer_filter="math",
                 start_sft_steps=60, start_lr=5e-5, teacher_objective="rl", teacher_sft_steps=400, teacher_lr=3e-6,
                 teacher_n_train=4400, n_train=1500, unseen_arm_problems=True, n_test=1500, eval_samples=4,
                 stage_one_problems=300, budget_s=150.0, marks="50,100,150", late_marks=2, learning_rate=3e-6,
                 sft_learning_rate=3e-5, sft_max_epochs=8.0, lr_scheduler_type="linear_time", lr_warmup_s=10.0,
                 num_generations=4, kl_probe_problems=256, gate_lead=0.10, gate_rel_lead=0.30, stage_one_samples=4,
                 stage_one_filter="formal"),
}


@dataclass
class LearningConfig:
    """Settings of one learning-efficacy run (written to ``<out>/settings.json``; arms re-read it)."""

    out: str = field(default="", metadata={"help": "Run directory (outside the repo). Required."})
    task: str = field(default="ladder", metadata={"help": "ladder: data_tools.synth hard ladder; gsm8k: GSM8K."})
    arms: str = field(default="a,b,c,d,e", metadata={
        "help": "Comma-separated arms to run, in this order (see ARMS); 'f@3e-5' runs arm f at that learning rate; "
                "'+kl3', '+ep2', '+bs8', '+spg16', '+const', '+all' set one run's KL weight, SFT passes, rollout batch, "
                "its updates, a constant rate, every arm problem without stage one's filter (LearningConfig.run_options)."})
    arm_lr: str = field(default="", metadata={
        "help": "Learning rates per arm, e.g. 'd=5e-5,f=3e-5' (arms not named, and not given as x@lr, use learning_rate)."})
    seeds: str = field(default="", metadata={
        "help": "Comma-separated seeds: every arm runs once per seed (same data, start, teacher); empty = seed."})
    start_sft_s: float = field(default=0.0, metadata={
        "help": "Training seconds of SFT on the reference solutions that make the starting student (0 = the raw "
                "model): regime (i) ~15 (in the teacher's format, about half its score), regime (ii) until SFT "
                "gains little. The teacher is this start + teacher_sft_s more."})
    w_sft: float = field(default=1.0, metadata={"help": "Arms f, h, i: weight of the cross-entropy on verified solutions in on-policy steps (OPDConfig's)."})
    sft_share_start: float = field(default=0.8, metadata={"help": "Arms f, h, i: share of training seconds in off-policy steps at 0 s."})
    sft_share_end: float = field(default=0.2, metadata={"help": "Arms f, h, i: the same share at budget_s (linear in between)."})
    sft_max_epochs: float = field(default=2.0, metadata={
        "help": "Arms j, k, l: passes of off-policy steps over stage one's verified solutions before every step is "
                "on-policy (OPDConfig's; > 0 here)."})
    sft_handover_reset: int = field(default=0, metadata={
        "help": "Arms j, k, l (OPDConfig's): > 0: clear the optimizer's moments at the hand-over and warm the rate up "
                "again over this many steps; 0 = carry them."})
    sft_learning_rate: float = field(default=0.0, metadata={
        "help": "Arms j, k, l (OPDConfig's): the rate of their SFT passes, on the arm's schedule; 0 = the arm's own rate "
                "for both phases."})
    student_model: str | None = field(default=None, metadata={"help": "Local HF dir; empty = embedded SmolLM2-135M-Instruct."})
    student_layers: int = field(default=0, metadata={
        "help": "> 0: the start is student_model cut to this many of its decoder layers (student_layer_choice), saved "
                "as <out>/cut_student and healed by the start's SFT (start_sft_steps or start_sft_s, required); the "
                "teacher is then built from the whole student_model, not from the start. 0 = the whole model."})
    student_layer_choice: str = field(default="even", metadata={
        "help": "student_layers > 0: even = evenly spaced layers from the first to the last (the last feeds the "
                "output head); first = the first N."})
    start_lr: float = field(default=0.0, metadata={
        "help": "Learning rate of the start's SFT (AdamW, constant); 0 = teacher_lr."})
    train_data: str = field(default="", metadata={
        "help": "Problems file (jsonl / parquet / json / a datasets dir; data_tools.problems) of the start, the "
                "teacher and the arms, read in file order; empty = task's source. Held-out problems: test_data, or "
                "else this file's last n_test problems (disjoint by position)."})
    test_data: str = field(default="", metadata={
        "help": "Held-out problems file: its first n_test problems; empty = the last n_test of train_data (or the "
                "task's test split without train_data). Refused if a problem is also a training problem."})
    unseen_arm_problems: bool = field(default=False, metadata={
        "help": "The arms (stage one and on-policy prompts) train on n_train problems after every problem the start "
                "or the teacher trained on: both build on the first max(n_train, teacher_n_train), so neither saw the "
                "arms' problems (regime (iii)). Off: the arms train on the start's own problems."})
    lr_scheduler_type: str = field(default="constant", metadata={
        "help": "Every arm's rate schedule (OPDConfig's): constant (after warmup_steps); linear_time / cosine_time = "
                "decay to 0 over the arm's training window, from its first step to budget_s (stage one's seconds "
                "excluded, as the product's window starts at training), after lr_warmup_s seconds of linear warm-up. "
                "With a time schedule the off-policy share of arms f, h, i follows the same window."})
    lr_warmup_s: float = field(default=0.0, metadata={
        "help": "linear_time / cosine_time: seconds of linear warm-up from 0 at the start of each arm's training "
                "window (written to the recipe as lr_warmup_time, a share of that window); >= 0."})
    gate_rel_lead: float = field(default=0.0, metadata={
        "help": "Setup: > 0 = also the teacher's lead must be at least this share of the start's own score (0.3 = "
                "30%%; JustRL-DeepSeek-1.5B leads its student by 81%%); else exit 3 as gate_lead. 0 = no relative gate."})
    gate_lead: float = field(default=0.0, metadata={
        "help": "Setup: > 0 = the arms run only where the teacher leads the start on the held-out problems (avg@k, "
                "paired) by at least this; else the command stops after the setup's lines with exit code 3 and runs "
                "no arm (no arm runs in a regime without the property it tests). 0 = no gate."})
    kl_probe_problems: int = field(default=0, metadata={
        "help": "Setup: > 0 = the start samples this many of the arms' problems once (temperature and cap of the "
                "on-policy arms) and the per-token reverse KL of those samples under the teacher is measured "
                "(data/setup_kl.json, in the report); 0 = not measured."})
    n_train: int = field(default=6000, metadata={"help": "Training problems (the teacher's SFT data and every arm's prompts)."})
    n_test: int = field(default=300, metadata={"help": "Held-out problems evaluated at every mark."})
    gsm8k_dir: str = field(default=str(SHARED / "data"), metadata={"help": "Folder of gsm8k_{train,test}.jsonl."})
    budget_s: float = field(default=150.0, metadata={"help": "Training seconds per arm (its own clock, evals paused)."})
    marks: str = field(default="15,30,60,100,150", metadata={
        "help": "Training-clock seconds at which each arm is evaluated (the last one ends the arm; <= budget_s)."})
    teacher_sft_s: float = field(default=90.0, metadata={"help": "Training seconds of the teacher's fine-tuning."})
    teacher_objective: str = field(default="sft", metadata={
        "help": "How the teacher is made from the start: sft = SFT on the reference solutions; rl = reward only (arm "
                "a's objective: the verifier's reward, no teacher, no references) at teacher_lr for teacher_sft_s "
                "seconds (or teacher_sft_steps), as JustRL-DeepSeek-1.5B is DeepSeek-R1-Distill-Qwen-1.5B after RL "
                "(bench/learning/run-4-plan.md)."})
    start_sft_steps: int = field(default=0, metadata={
        "help": "> 0: the start's SFT runs this many optimizer steps instead of start_sft_s seconds. A step count is "
                "reproducible for a seed, so pieces of one experiment run on different (fresh) machines rebuild the "
                "same start."})
    teacher_sft_steps: int = field(default=0, metadata={"help": "> 0: the same for the teacher (instead of teacher_sft_s)."})
    teacher_n_train: int = field(default=0, metadata={
        "help": "Training problems of the teacher's SFT (a built teacher): 0 = the n_train every arm trains on; more = "
                "those and further problems of the same source no arm sees (the ladder: disjoint from the test split), "
                "so the teacher knows more than a start saturated on the n_train (regime (ii))."})
    fresh_arm_problems: bool = field(default=False, metadata={
        "help": "Regime (ii) on new prompts: the start's SFT uses the first n_train problems and every arm trains on "
                "the next n_train, which the start never saw and the teacher did (needs a built teacher with "
                "teacher_n_train >= 2 x n_train). Off: the arms train on the start's own problems, whose answers a "
                "saturated start has memorised."})
    start_model: str = field(default="", metadata={
        "help": "A local HF model dir to use as the start instead of building one (e.g. an earlier run's "
                "<out>/start): copied to <out>/start and evaluated as mark 0. Excludes start_sft_s / start_sft_steps."})
    teacher_model: str = field(default="", metadata={
        "help": "A local HF model dir to use as the teacher instead of start + SFT (e.g. an earlier run's arm export "
                "<out>/arms/<run>/final, kept by --keep_final: a teacher above an SFT-saturated start for regime (ii)): "
                "copied to <out>/teacher and evaluated. Excludes teacher_sft_steps."})
    teacher_init: str = field(default="", metadata={
        "help": "A local HF model dir the teacher's fine-tuning (SFT or RL) starts from instead of the start, e.g. an "
                "earlier run's <out>/teacher: a longer RL in links of at most ten minutes, each gated against this "
                "run's own start. Excludes teacher_model; the teacher's steps or seconds are this link's."})
    teacher_lr: float = field(default=5e-5, metadata={"help": "Learning rate of the teacher's fine-tuning."})
    learning_rate: float = field(default=1e-5, metadata={"help": "Learning rate of every arm (AdamW; constant, after warmup_steps if set)."})
    warmup_steps: int = field(default=0, metadata={
        "help": "> 0: every arm's rate rises linearly over its first N optimizer steps, then stays constant "
                "(transformers' constant_with_warmup), so that Adam's first updates (about lr x sign(g) on every "
                "weight) stay small. Counted in steps: every arm gets the same number of small first updates. 0 = no "
                "warm-up."})
    sft_batch_size: int = field(default=64, metadata={"help": "Solutions per off-policy (SFT) step: the start, the teacher, arm d, and the SFT steps of f, h, i, j."})
    micro_batch: int = field(default=0, metadata={
        "help": "> 0: at most this many completions (or SFT solutions) per forward: an on-policy step runs as "
                "ceil(its batch / micro_batch) accumulation steps, an SFT step in slices of micro_batch; the same "
                "steps in less memory (long answers: a few hundred tokens x 128 completions may not fit one forward). "
                "0 = a step in one forward."})
    num_generations: int = field(default=8, metadata={"help": "G: samples per prompt in on-policy steps (every arm but d)."})
    per_device_train_batch_size: int = field(default=128, metadata={"help": "Completions per on-policy optimizer step (every arm but d; one process, no accumulation)."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature of on-policy rollouts."})
    max_completion_length: int = field(default=96, metadata={"help": "Completion cap in tokens: training rollouts, stage one and evaluation."})
    eval_samples: int = field(default=4, metadata={"help": "k of avg@k."})
    eval_temperature: float = field(default=0.7, metadata={"help": "Sampling temperature of evaluation and stage one."})
    eval_batch: int = field(default=1200, metadata={"help": "Sequences per generation call in evaluation / stage one."})
    stage_one_problems: int = field(default=6000, metadata={"help": "Stage one (arms d, f, h, i, j): training problems the teacher samples."})
    stage_one_samples: int = field(default=1, metadata={"help": "Stage one (arms d, f, h, i, j): teacher samples per problem."})
    stage_one_filter: str = field(default="none", metadata={
        "help": "filtered (or formal, its first name, which the logged commands use: the formal stage one was "
                "filtered then): the pass-rate-filtered stage one (configs/curate_r1_distill_1p5b_filtered.yaml's "
                "student_samples, band_low / band_high, zero_pass_share, order): the start sampled for its pass rate, the band filter, the "
                "easy-to-hard order; the off-policy arms train on its kept rows in that order and are charged its "
                "teacher and student seconds ('+all' on a run name: every arm problem instead, the teacher's seconds "
                "only). none: every arm problem, shuffled, the teacher's seconds only."})
    sft_filter: str = field(default="verified", metadata={
        "help": "Arms d, f, h, i, j: verified = fine-tune only on graded-correct, finished, distinct teacher samples (the "
                "classical recipe); none = on every teacher sample (an ablation; lets the CPU smoke test run arm d "
                "with a teacher that solves nothing)."})
    prompt_style: str = field(default="reasoning", metadata={"help": "data_tools.prompts style of every prompt."})
    grader_profile: str = field(default="", metadata={
        "help": "Grader profile of the training reward and stage one's verification (OPDConfig.grader_profile; "
                "formal = the formal metric's rules); empty = the trainer's default."})
    answer_filter: str = field(default="numeric", metadata={
        "help": "Grader answer filter of the training reward and stage one's verification (data_tools.grader): "
                "numeric = the answer must be a number (arithmetic tasks); math = any equal expression."})
    report_filter: str = field(default="numeric", metadata={
        "help": "Answer filter of the reported avg@k (both are stored per sample: correct_numeric, correct_math)."})
    late_marks: int = field(default=3, metadata={
        "help": "Report: also compare the arms on each problem's pass rate pooled over the last N marks (and seeds), "
                "the late mean, which moves less between runs than one mark. 0 = off; all marks if there are fewer."})
    contrasts: str = field(default="", metadata={
        "help": "Report: comma-separated 'x:y' pairs of arms (run names without the seed, e.g. 'j:d@3e-5,j+kl3:l'): "
                "x - y at the last mark and on the late mean, seeds pooled, paired over problems with its 95%% "
                "t-interval (df = problems - 1), and with >= 2 runs of each the interval from the spread between "
                "runs (Welch's df)."})
    seed: int = field(default=0, metadata={"help": "Seed of every arm (data order, sampling, evaluation)."})
    engine: str = field(default="hf", metadata={
        "help": "Engine of stage one and evaluation (data_tools.generation.engines): hf (the fast decoder of the training "
                "rollouts), vllm, or auto (vllm where it imports)."})
    fast_generation: bool = field(default=True, metadata={
        "help": "data_tools.generation.fast_decoder's static-cache / CUDA-graph generation for rollouts and evaluation."})
    deadline_s: float = field(default=0.0, metadata={
        "help": "Whole-run wall-clock limit (0 = none): an arm that cannot finish before it is skipped and reported."})
    arm_overhead_s: float = field(default=90.0, metadata={
        "help": "Estimated seconds an arm spends outside its budget (start-up, mark exports, evaluations), for "
                "deadline_s; after each arm run the largest overhead measured in this invocation is used if larger."})
    keep_final: bool = field(default=False, metadata={
        "help": "Keep each arm run's last export at <out>/arms/<run>/final (weights are deleted otherwise), e.g. as "
                "another experiment's --teacher_model."})
    preset: str = field(default="", metadata={
        "help": "cpu_smoke: tiny sizes and budgets; regime3: a cut, healed student under the whole model as teacher, "
                "long answers, few measured problems; run4: the formal regime's proxy, a teacher made by RL from the "
                "start (PRESETS). On the command line its values are the flags' defaults: a flag given wins, at any "
                "value; in code (LearningConfig(preset=...)) it sets the fields still at their defaults."})

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name, value in PRESETS[self.preset].items():
            if getattr(self, name) == defaults[name]:  # a flag given on the command line wins over the preset
                setattr(self, name, value)
        if self.stage_one_filter == "filtered":  # one value within: run names and saved configs keep 'formal'
            self.stage_one_filter = "formal"
        if not self.out:
            raise ValueError("--out is required (a run directory outside the repo)")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.grader_profile == "formal" and self.answer_filter != "math":  # refused here, not in the first arm
            raise ValueError(f"answer_filter {self.answer_filter!r} does not apply under grader_profile formal (the "
                             "metric's own rule decides what counts): --answer_filter math")
        bad = [a for a in self.arm_list if not ARM_RUN.fullmatch(a) or a[0] not in ARMS or "-s" in a]
        if bad or not self.arm_list:
            raise ValueError(f"arms must be a comma-separated subset of {sorted(ARMS)}, each optionally followed, in "
                             f"this order, by @<lr>, +kl<w_kl>, +ep<passes>, +bs<batch>, +spg<updates>, +const, +all "
                             f"(e.g. 'j@3e-6+kl3', 'b+bs8+const', 'j+spg16', 'j+all'); {bad or 'none'} do not read so")
        for a in self.arm_list:
            self.run_options(a)  # raises for a weight or a pass count the arm cannot take
        try:
            rates, seeds = self.arm_lr_table, self.seed_list
        except ValueError:
            raise ValueError(f"arm_lr must read like 'd=5e-5,f=3e-5' and seeds like '0,1,2', got {self.arm_lr!r}, "
                             f"{self.seeds!r}") from None
        if any(k not in ARMS or v <= 0 for k, v in rates.items()) or min(seeds) < 0:
            raise ValueError(f"arm_lr names arms of {sorted(ARMS)} with rates > 0, seeds are >= 0; got "
                             f"{self.arm_lr!r}, {self.seeds!r}")
        if self.start_model and (self.start_sft_s > 0 or self.start_sft_steps):
            raise ValueError("start_model replaces the start's SFT: leave start_sft_s and start_sft_steps at 0")
        if self.teacher_init and self.teacher_model:
            raise ValueError("teacher_init is where a built teacher's fine-tuning starts; teacher_model adopts a teacher "
                             "as it is: give one of them")
        if self.teacher_model and self.teacher_sft_steps:
            raise ValueError("teacher_model replaces the teacher's SFT: leave teacher_sft_steps at 0")
        if self.teacher_init and self.student_layers:
            raise ValueError("teacher_init continues a teacher of the start's shape; student_layers builds the teacher "
                             "from the whole model: give one of them")
        if min(self.start_sft_steps, self.teacher_sft_steps) < 0:
            raise ValueError("start_sft_steps and teacher_sft_steps must be >= 0")
        if self.teacher_n_train and self.teacher_n_train < self.n_train:
            raise ValueError(f"teacher_n_train must be 0 or >= n_train ({self.n_train}), got {self.teacher_n_train}")
        if self.teacher_n_train and self.teacher_model:
            raise ValueError("teacher_n_train shapes a built teacher's SFT data: leave it at 0 with teacher_model")
        if self.fresh_arm_problems and (self.start_model or not (self.start_sft_steps or self.start_sft_s > 0)):
            raise ValueError("fresh_arm_problems keeps the arms off the start's own SFT problems: it needs a start built "
                             "here (start_sft_steps or start_sft_s), not a given start_model or the raw student")
        if self.fresh_arm_problems and (self.teacher_model or self.teacher_n_train < 2 * self.n_train):
            raise ValueError(f"fresh_arm_problems trains the arms on problems n_train..2 x n_train, which the teacher "
                             f"must have seen: build the teacher with teacher_n_train >= {2 * self.n_train} (got "
                             f"{self.teacher_n_train}{', and a given teacher_model' if self.teacher_model else ''})")
        if self.unseen_arm_problems and (self.fresh_arm_problems or self.start_model or self.teacher_model
                                         or not (self.start_sft_steps or self.start_sft_s > 0)):
            raise ValueError("unseen_arm_problems builds the start and the teacher here on problems before the arms': it "
                             "needs start_sft_steps or start_sft_s, no start_model / teacher_model, and excludes "
                             "fresh_arm_problems")
        if self.student_layers < 0 or self.student_layer_choice not in LAYER_CHOICES:
            raise ValueError(f"student_layers must be >= 0 and student_layer_choice one of {LAYER_CHOICES}, got "
                             f"{self.student_layers}, {self.student_layer_choice!r}")
        if self.student_layers and (self.start_model or not (self.start_sft_steps or self.start_sft_s > 0)):
            raise ValueError("student_layers cuts the student into the start, which its SFT heals: give start_sft_steps "
                             "or start_sft_s (and no start_model)")
        if self.lr_scheduler_type not in ARM_SCHEDULES:
            raise ValueError(f"lr_scheduler_type must be one of {ARM_SCHEDULES}, got {self.lr_scheduler_type!r}")
        if not 0 <= self.lr_warmup_s < math.inf or (self.lr_warmup_s and self.lr_scheduler_type == "constant"):
            raise ValueError(f"lr_warmup_s must be finite and >= 0, and is for a time schedule only (constant: "
                             f"warmup_steps); got {self.lr_warmup_s} with {self.lr_scheduler_type}")
        if self.lr_scheduler_type != "constant" and self.warmup_steps:
            raise ValueError("warmup_steps is constant_with_warmup's; a time schedule warms up over lr_warmup_s")
        if not 0 <= self.gate_rel_lead < math.inf:
            raise ValueError(f"gate_rel_lead must be finite and >= 0, got {self.gate_rel_lead}")
        if not (0 <= self.start_lr < math.inf and 0 <= self.gate_lead <= 1) or self.kl_probe_problems < 0:
            raise ValueError(f"start_lr must be finite and >= 0, gate_lead in [0, 1] and kl_probe_problems >= 0, got "
                             f"{self.start_lr}, {self.gate_lead}, {self.kl_probe_problems}")
        for pair in self.contrast_list:
            for name in pair:
                self.canonical(name)  # raises for a name that is no run
        if self.test_data and not self.train_data:
            raise ValueError("test_data goes with train_data (without it the task's own test split is used)")
        if self.teacher_n_train == self.n_train:
            self.teacher_n_train = 0  # the same teacher data as 0: recorded alike, so a resume accepts either
        if not 0 < self.sft_max_epochs < math.inf:  # NaN fails too
            raise ValueError(f"sft_max_epochs must be a finite number > 0, got {self.sft_max_epochs}")
        if self.sft_handover_reset < 0:
            raise ValueError(f"sft_handover_reset must be >= 0, got {self.sft_handover_reset}")
        if not 0 <= self.sft_learning_rate < math.inf:
            raise ValueError(f"sft_learning_rate must be a finite number >= 0, got {self.sft_learning_rate}")
        if self.start_sft_s < 0 or self.w_sft < 0 or not (0 <= self.sft_share_start <= 1 and 0 <= self.sft_share_end <= 1):
            raise ValueError("need start_sft_s >= 0, w_sft >= 0 and sft shares in [0, 1]")
        m = self.mark_list
        if not m or any(x <= 0 for x in m) or m != sorted(set(m)) or m[-1] > self.budget_s:
            raise ValueError(f"marks must be increasing positive seconds <= budget_s ({self.budget_s}), got {self.marks!r}")
        if self.late_marks < 0:
            raise ValueError(f"late_marks must be >= 0, got {self.late_marks}")
        for name in ("n_train", "n_test", "eval_samples", "num_generations", "per_device_train_batch_size",
                     "max_completion_length",
                     "sft_batch_size", "eval_batch", "stage_one_problems", "stage_one_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.per_device_train_batch_size % self.num_generations:
            raise ValueError(f"per_device_train_batch_size ({self.per_device_train_batch_size}) must be a multiple of "
                             f"num_generations ({self.num_generations})")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.teacher_objective not in ("sft", "rl"):
            raise ValueError(f"teacher_objective must be 'sft' or 'rl', got {self.teacher_objective!r}")
        if min(self.budget_s, self.teacher_sft_s, self.learning_rate, self.teacher_lr) <= 0:
            raise ValueError("budget_s, teacher_sft_s, learning_rate and teacher_lr must be > 0")
        from data_tools.grader import ANSWER_FILTERS

        for name in ("answer_filter", "report_filter"):
            if getattr(self, name) not in ANSWER_FILTERS:
                raise ValueError(f"{name} must be one of {ANSWER_FILTERS}, got {getattr(self, name)!r}")
        from data_tools.generation.engines import ENGINES

        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.micro_batch < 0:
            raise ValueError(f"micro_batch must be >= 0, got {self.micro_batch}")
        if self.micro_batch:  # every step that will run, split as train_recipe splits it: refused now, not mid-run
            self.accumulation_steps(self.per_device_train_batch_size, with_sft=False)  # the teacher's RL
            for a in self.arm_list:
                opts, spec = self.run_options(a), ARM_SPECS[self.parse_run(a)[0]]
                if spec.off_policy != "sft":
                    step = opts.get("batch", self.per_device_train_batch_size) // opts.get("spg", 1)
                    self.accumulation_steps(step, with_sft=bool(spec.off_policy), name=a)
        if self.stage_one_filter not in ("none", "formal"):
            raise ValueError(f"stage_one_filter must be 'none', 'filtered' or 'formal', got {self.stage_one_filter!r}")
        if self.sft_filter not in ("verified", "none"):
            raise ValueError(f"sft_filter must be 'verified' or 'none', got {self.sft_filter!r}")
        if self.eval_temperature <= 0 or self.temperature <= 0:
            raise ValueError("temperatures must be > 0 (sampling)")

    @property
    def arm_list(self) -> list[str]:
        return [a.strip() for a in self.arms.split(",") if a.strip()]

    @property
    def arm_lr_table(self) -> dict[str, float]:
        return {k.strip(): float(v) for k, v in (x.split("=", 1) for x in self.arm_lr.split(",") if x.strip())}

    @property
    def contrast_list(self) -> list[tuple[str, str]]:
        """``contrasts`` as (x, y) pairs. Raises ValueError for a piece that is not 'x:y'."""
        out = []
        for piece in (x.strip() for x in self.contrasts.split(",") if x.strip()):
            x, sep, y = piece.partition(":")
            if not sep or not x.strip() or not y.strip() or "-s" in piece:
                raise ValueError(f"contrasts must be comma-separated 'x:y' pairs of arms without a seed, got {piece!r}")
            out.append((x.strip(), y.strip()))
        return out

    @property
    def seed_list(self) -> list[int]:
        return [int(x) for x in self.seeds.split(",") if x.strip()] or [self.seed]

    def run_name(self, arm: str, lr: float, seed: int, w_kl: float | None = None,
                 sft_max_epochs: float | None = None, batch: int | None = None, spg: int | None = None,
                 const: bool = False, every_problem: bool = False) -> str:
        """An ``ARM_RUN`` name: ``w_kl`` / ``sft_max_epochs`` / ``batch`` / ``spg`` (None = the arm's own) as
        ``+kl`` / ``+ep`` / ``+bs`` / ``+spg``; ``const`` as ``+const``, ``every_problem`` as ``+all``."""
        return (arm + (f"@{lr:g}" if lr != self.learning_rate else "")
                + (f"+kl{w_kl:g}" if w_kl is not None else "")
                + (f"+ep{sft_max_epochs:g}" if sft_max_epochs is not None else "")
                + (f"+bs{batch}" if batch is not None else "")
                + (f"+spg{spg}" if spg is not None else "")
                + ("+const" if const else "")
                + ("+all" if every_problem else "")
                + (f"-s{seed}" if seed != self.seed else ""))

    def accumulation_steps(self, step: int, *, with_sft: bool, name: str = "") -> int:
        """Under ``micro_batch``: the gradient-accumulation steps that run an on-policy step of ``step`` completions in
        micro-batches of at most ``micro_batch`` (ceil(step / micro_batch), which must divide the step evenly, and
        ``sft_batch_size`` too when the run also takes SFT steps: the trainer splits both into as many). 1 without.

        Raises:
            ValueError: the step, or the SFT step, does not split evenly; the message names the run.
        """
        if not self.micro_batch:
            return 1
        ga = -(-step // self.micro_batch)
        if step % ga or (with_sft and self.sft_batch_size % ga):
            raise ValueError(f"micro_batch {self.micro_batch}{f' ({name})' if name else ''}: a step of {step} "
                             f"completions{f' and SFT steps of {self.sft_batch_size} solutions' if with_sft else ''} "
                             f"must split evenly into {ga} micro-batches of at most {self.micro_batch}")
        return ga

    def run_options(self, name: str) -> dict[str, float]:
        """The settings a run name gives beyond its rate and seed: ``{"w_kl": w}`` for ``+kl<w>`` (the on-policy
        KL weight, ``w_reward`` staying the arm's 1), ``{"sft_max_epochs": n}`` for ``+ep<n>``, ``batch`` / ``spg``
        for ``+bs<n>`` / ``+spg<n>`` (the rollout batch and the updates it is split into), ``{"const": True}`` for
        ``+const`` (this run at a constant rate under the run's time schedule: run 4's arm R, as the reference recipe
        runs), ``{"every_problem": True}`` for ``+all`` (an off-policy arm on every arm problem, shuffled, instead of
        stage one's kept rows under ``stage_one_filter formal``: run 4's arm N); {} for none.

        Raises:
            ValueError: not an ``ARM_RUN`` name; ``+kl`` on an arm without both the KL and the reward term, or a
                weight <= 0 (arm l is w_kl = 0); ``+ep`` on an arm that does not hand over (j, k, l), or <= 0;
                ``+bs`` / ``+spg`` on arm d or not dividing evenly; ``+const`` where the run's schedule is constant;
                ``+all`` on an arm without stage one or under ``stage_one_filter none``.
        """
        m = ARM_RUN.fullmatch(name)
        if not m or m.group(1) not in ARMS:
            raise ValueError(f"not an arm run name: {name!r} (e.g. 'c', 'f@3e-05', 'd-s1', 'j@3e-06+kl3+ep2')")
        spec, out = ARM_SPECS[m.group(1)], {}
        if m.group(3) is not None:
            w = float(m.group(3))
            if not (spec.w_kl > 0 and spec.w_reward > 0) or not 0 < w < math.inf:
                both = ", ".join(k for k, v in ARM_SPECS.items() if v.w_kl > 0 and v.w_reward > 0)
                raise ValueError(f"{name!r}: +kl<w> sets the KL weight beside the reward's 1, on an arm with both "
                                 f"terms ({both}), w > 0 (arm l is the reward alone)")
            out["w_kl"] = w
        if m.group(4) is not None:
            n = float(m.group(4))
            if ARM_SPECS[m.group(1)].off_policy != "seq" or not 0 < n < math.inf:
                raise ValueError(f"{name!r}: +ep<n> sets the passes before the hand-over of arms j, k, l, n > 0")
            out["sft_max_epochs"] = n
        if m.group(5) is not None or m.group(6) is not None:
            if spec.off_policy == "sft":
                raise ValueError(f"{name!r}: +bs / +spg set the on-policy rollout batch; arm d has none")
            batch = int(m.group(5)) if m.group(5) is not None else self.per_device_train_batch_size
            spg = int(m.group(6)) if m.group(6) is not None else 1
            if batch < 1 or batch % self.num_generations or spg < 1 or batch % spg:
                raise ValueError(f"{name!r}: a rollout batch of {batch} completions must be a multiple of "
                                 f"num_generations ({self.num_generations}) and split evenly into {spg} steps")
            if m.group(5) is not None:
                out["batch"] = batch
            if m.group(6) is not None:
                out["spg"] = spg
        if m.group(7) is not None:
            if self.lr_scheduler_type == "constant":
                raise ValueError(f"{name!r}: +const runs one arm at a constant rate under a time schedule; this "
                                 "run's lr_scheduler_type is constant already")
            out["const"] = True
        if m.group(8) is not None:
            if not spec.off_policy or self.stage_one_filter == "none":
                raise ValueError(f"{name!r}: +all trains an off-policy arm on every arm problem instead of stage one's "
                                 "kept rows; it needs such an arm and stage_one_filter formal")
            out["every_problem"] = True
        return out

    def canonical(self, name: str) -> str:
        """``name`` as this experiment writes it (``j@3e-6+kl3.0`` -> ``j@3e-06+kl3``). Raises ValueError."""
        return self.run_name(*self.parse_run(name), **self.run_options(name))

    @property
    def instances(self) -> list[str]:
        """The arm runs this invocation asks for (``ARM_RUN`` names): every arm at its rate, for every seed."""
        out = []
        for spec in self.arm_list:
            arm, lr = ARM_RUN.fullmatch(spec).group(1, 2)
            rate = float(lr) if lr else self.arm_lr_table.get(arm, self.learning_rate)
            out += [self.run_name(arm, rate, s, **self.run_options(spec)) for s in self.seed_list]
        return list(dict.fromkeys(out))

    def parse_run(self, name: str) -> tuple[str, float, int]:
        """``(arm, learning rate, seed)`` of a run name. Raises ValueError for a name ``ARM_RUN`` does not match."""
        m = ARM_RUN.fullmatch(name)
        if not m or m.group(1) not in ARMS:
            raise ValueError(f"not an arm run name: {name!r} (e.g. 'c', 'f@3e-05', 'd-s1', 'j@3e-06+kl3+ep2')")
        return m.group(1), float(m.group(2)) if m.group(2) else self.learning_rate, int(m.group(9)) if m.group(9) else self.seed

    def label(self, group: str) -> str:
        """Label of an arm (a run name without its seed) for tables and the plot."""
        arm, lr, _ = self.parse_run(group)
        text = ("off-policy SFT on all teacher samples (sft_filter=none)" if arm == "d" and self.sft_filter == "none"
                else ARMS[arm])
        opts = self.run_options(group)
        if ARM_SPECS[arm].off_policy == "seq":
            n = opts.get("sft_max_epochs", self.sft_max_epochs)
            text = text.replace("sft_max_epochs passes", "1 pass" if n == 1 else f"{n:g} passes")
            if self.sft_filter == "none":
                text = text.replace("verified solutions", "all teacher samples (sft_filter=none)")
        if "w_kl" in opts:
            text += f", w_kl {opts['w_kl']:g} (KL : reward = {opts['w_kl']:g} : 1)"
        if "batch" in opts or "spg" in opts:
            b, k = opts.get("batch", self.per_device_train_batch_size), opts.get("spg", 1)
            text += f", rollouts of {b}" + (f" in {k} updates" if k > 1 else "")
        if opts.get("const"):
            text += ", constant rate"
        if opts.get("every_problem"):
            text += ", every arm problem (no stage-one filter)"
        return text + (f", lr {lr:g}" if lr != self.learning_rate else "")

    @property
    def data_name(self) -> str:
        """What the problems are, for the report: the task, or the files given."""
        if not self.train_data:
            return self.task
        return Path(self.train_data).name + (f" (held out: {Path(self.test_data).name})" if self.test_data else
                                             f" (held out: its last {self.n_test})")

    @property
    def mark_list(self) -> list[float]:
        return parse_marks(self.marks)

    @property
    def dir(self) -> Path:
        return Path(self.out).expanduser().resolve()


def has_weights(path: Path) -> bool:
    """A Hugging Face model folder with its weights (``config.json`` and a ``*.safetensors``)."""
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def check_given_models(cfg: "LearningConfig") -> None:
    """Before a run adopts ``--start_model`` / ``--teacher_model`` (``bench.learning.adopt_model``): each names a
    Hugging Face model folder with its weights, unless the run directory already holds its copy. Not a
    ``__post_init__`` check: a report on tables brought back from another machine re-reads these settings where the
    source paths never were.

    Raises:
        FileNotFoundError: the field and the path that holds no ``config.json`` or no ``*.safetensors`` (tables
            packed by ``bench/offline_gpu.sh pack`` have no weights; an arm's ``final`` exists only with
            ``--keep_final``).
    """
    for name, dest in (("start_model", "start"), ("teacher_model", "teacher"), ("teacher_init", "teacher")):
        path = getattr(cfg, name)
        if path and not has_weights(cfg.dir / dest) and not has_weights(Path(path)):
            hint = ("; an earlier run's teacher is <its out>/teacher" if name == "teacher_init"
                    else "; an arm's <out>/arms/<run>/final is kept only with --keep_final")
            raise FileNotFoundError(f"{name}: {path} is not a Hugging Face model folder with weights (no config.json "
                                    f"or no *.safetensors){hint}")


#: Settings renamed to ``OPDConfig``'s field names: old name -> new. A ``settings.json`` written under an old name
#: is read with the new one (:func:`upgrade_settings`); a command-line flag of an old name is refused naming the new.
RENAMED = {
    "lr": "learning_rate",
    "completions_per_step": "per_device_train_batch_size",
    "train_temperature": "temperature",
    "max_new_tokens": "max_completion_length",
    "seq_sft_epochs": "sft_max_epochs",
    "seq_sft_lr": "sft_learning_rate",
    "seq_handover_reset": "sft_handover_reset",
}


def upgrade_settings(settings: dict, source: str | Path) -> dict:
    """``settings`` (a run directory's recorded ``settings.json``, read from ``source``) under today's names: each
    old name of :data:`RENAMED` becomes its new one, values unchanged.

    Raises:
        ValueError: ``source`` records a setting under both its old and its new name, with different values (the
            message names both).
    """
    out = dict(settings)
    for old, new in RENAMED.items():
        if old not in out:
            continue
        value = out.pop(old)
        if new in out and out[new] != value:
            raise ValueError(f"{source}: {old!r} is the old name of {new!r}, and it records both, with different "
                             f"values ({value!r} and {out[new]!r}): keep {new!r} only")
        out[new] = value
    return out


def refuse_renamed_flags(argv: list[str]) -> None:
    """Raise ValueError naming the new flag for any ``--<old name>`` of :data:`RENAMED` in ``argv``."""
    for arg in argv:
        name = arg[2:].split("=", 1)[0] if arg.startswith("--") else None
        if name in RENAMED:
            raise ValueError(f"--{name} is now --{RENAMED[name]} (the trainer's own name, OPDConfig.{RENAMED[name]})")


#: Settings that may differ between invocations on one run directory: the arms asked for this time,
#: the deadline and its overhead estimate, what the fast-generation check decided, where the directory lives,
#: whether arm exports are kept, and what the report and the setup's gate read.
LOOSE_SETTINGS = ("arms", "arm_lr", "seeds", "deadline_s", "arm_overhead_s", "fast_generation_used", "out", "keep_final",
                  "late_marks", "runs", "contrasts", "gate_lead", "gate_rel_lead")


def merge_settings(old: dict | None, new: dict, arms: list[str]) -> dict:
    """The settings to record for a (re)started run: ``new``, with the arms and the requested runs of ``old`` kept
    and its ``fast_generation_used`` decision reused (``old`` read under today's names: :func:`upgrade_settings`).

    Raises:
        ValueError: ``old`` records other values for a setting outside ``LOOSE_SETTINGS`` (a different
            experiment: mixing its results would be wrong), or one setting under two names; the message names them.
    """
    out = dict(new)
    if old is None:
        out["fast_generation_used"] = bool(new.get("fast_generation", True))
        return out
    old = upgrade_settings(old, "the run directory's settings.json")
    defaults = {f.name: f.default for f in dataclasses.fields(LearningConfig)}
    # a setting added after the old run was recorded had its default there
    keys = (old.keys() | new.keys()) - set(LOOSE_SETTINGS)
    a = {k: old.get(k, defaults.get(k)) for k in keys}
    b = {k: new.get(k, defaults.get(k)) for k in keys}
    if a != b:
        diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        raise ValueError(f"the run directory holds a run with other settings ({diff}); use another --out")
    out["arms"] = ",".join(x for x in dict.fromkeys(old.get("arms", "").split(",") + arms) if x)
    out["runs"] = list(dict.fromkeys((old.get("runs") or []) + (new.get("runs") or [])))  # every command's runs
    out["fast_generation_used"] = old.get("fast_generation_used", old.get("fast_generation", True))
    return out
