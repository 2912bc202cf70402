"""The node's layout (``data_tools.layout``): usable GPUs, each training process's share of the recipe's step, and
``run.sh --plan`` on a node of 8 GPUs (a stub ``nvidia-smi``)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from data_tools.layout import plan, split_batch, visible_gpus

REPO = Path(__file__).resolve().parents[1]
SMI_8 = "".join(f"GPU {i}: NVIDIA H200 (UUID: GPU-{i}aaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee)\n" for i in range(8))


def test_visible_gpus_follow_cuda_visible_devices_as_cuda_does():
    assert visible_gpus({}, SMI_8) == [str(i) for i in range(8)]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "3,5"}, SMI_8) == ["3", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-2aaa,1"}, SMI_8) == ["GPU-2aaa", "1"]  # UUID prefixes too
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, SMI_8) == []  # empty hides all
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}, SMI_8) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,9,1"}, SMI_8) == ["0"]  # CUDA stops at an entry it cannot find
    assert visible_gpus({}, "No devices were found\n") == []
    assert visible_gpus({"PATH": "/nonexistent"}) == []  # no nvidia-smi: no GPU


@pytest.mark.parametrize("pd, ga, n, want", [
    (8, 16, 1, (8, 16)), (8, 16, 2, (8, 8)), (8, 16, 8, (8, 2)), (8, 16, 16, (8, 1)),
    (8, 2, 8, (2, 1)),     # accumulation does not divide: the micro-batch shrinks, 8 x 2 x 1 = 16
    (8, 16, 32, (4, 1)),   # more processes than micro-batches
    (6, 4, 8, (3, 1)),
])
def test_split_batch_keeps_the_recipe_step(pd, ga, n, want):
    got = split_batch(pd, ga, n)
    assert got == want
    assert got[0] * got[1] * n == pd * ga and got[0] <= pd


def test_split_batch_refuses_what_does_not_divide_with_the_numbers():
    with pytest.raises(ValueError, match=r"step of 128 completions .* does not divide over 3 processes: use a "
                                         r"process count in \[1, 2, 4, 8, 16\]"):
        split_batch(8, 16, 3)
    with pytest.raises(ValueError, match="sft_batch_size 24 does not divide over 8 processes x 2 micro-batches"):
        split_batch(8, 16, 8, sft_batch_size=24)
    assert split_batch(8, 16, 8, sft_batch_size=64) == (8, 2)
    with pytest.raises(ValueError, match="not a multiple of num_generations 3"):
        split_batch(2, 2, 2, num_generations=3)


def test_layout_defaults_are_the_trainers(tmp_path):
    """``data_tools.layout.DEFAULTS`` stands in for OPDConfig's defaults where a recipe is silent (data_tools cannot
    import trainers): each must be the value the trainer runs with."""
    from data_tools.layout import DEFAULTS
    from trainers.opd_config import OPDConfig

    trainer = OPDConfig(output_dir=str(tmp_path / "o"))
    assert DEFAULTS == {k: getattr(trainer, k) for k in DEFAULTS}


def test_plan_of_the_formal_recipe_on_8_gpus():
    lay = plan(REPO / "configs" / "opd_r1_distill_1p5b.yaml", [str(i) for i in range(8)])
    assert (lay.processes, lay.workers, lay.per_device, lay.accumulation) == (8, 8, 8, 2)
    text = "\n".join(lay.lines())
    assert "8 process(es) (accelerate launch, DDP); a step = 128 completions (32 prompts x 4) = 8 x 8 a micro-batch " \
           "x 2 accumulated (the recipe's 8 x 16 on one process)" in text
    two = plan(REPO / "configs" / "opd_r1_distill_1p5b.yaml", ["0", "1"], nodes=2)
    assert (two.per_device, two.accumulation) == (8, 4)  # 4 processes over two nodes
    cpu = plan(REPO / "configs" / "demo_cpu.yaml", [], processes=2)
    assert (cpu.processes, cpu.workers, cpu.per_device, cpu.accumulation) == (2, 1, 8, 1)


def _plan(tmp_path, **env):
    stub = tmp_path / "bin"
    stub.mkdir(exist_ok=True)
    (stub / "nvidia-smi").write_text("#!/bin/sh\ncat <<'EOF'\n" + SMI_8 + "EOF\n")
    (stub / "nvidia-smi").chmod(0o755)
    e = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "OPD_NUM_PROCESSES", "NNODES")}
    e.update(PATH=f"{stub}:{os.environ['PATH']}", STUDENT_MODEL=str(tmp_path / "student"), TEACHER_MODEL=str(tmp_path / "student"),
             OUTPUT_DIR=str(tmp_path / "out"), **env)
    return subprocess.run(["bash", "run.sh", "--plan"], cwd=REPO, env=e, capture_output=True, text=True, timeout=300)


def test_run_sh_plan_on_an_8_gpu_node_prints_the_layout_and_refuses_a_batch_that_does_not_divide(tmp_path):
    r = _plan(tmp_path)
    # the plan is printed first; then this machine's CPU torch under 8 visible GPUs is the preflight's refusal
    assert r.returncode == 2 and "is a CPU build but 8 GPU(s) are visible" in r.stderr, r.stderr
    assert "recipe r1_distill_1p5b (STUDENT_MODEL is set and CUDA is visible)" in r.stdout
    assert "layout: 8 GPU(s) visible; GPUs 0,1,2,3,4,5,6,7" in r.stdout
    assert "stage one   8 engine worker(s), one a GPU" in r.stdout
    assert "8 process(es) (accelerate launch, DDP); a step = 128 completions (32 prompts x 4) = 8 x 8 a " \
           "micro-batch x 2 accumulated" in r.stdout
    r3 = _plan(tmp_path, CUDA_VISIBLE_DEVICES="0,1,2")
    assert r3.returncode == 2
    assert "does not divide over 3 processes" in r3.stderr and "set-up + stage one" not in r3.stdout
    r2 = _plan(tmp_path, CUDA_VISIBLE_DEVICES="4,6")
    assert "layout: 2 GPU(s) visible; GPUs 4,6" in r2.stdout
    assert "= 2 x 8 a micro-batch x 8 accumulated" in r2.stdout
