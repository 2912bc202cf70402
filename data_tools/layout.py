"""How a run spreads over a node's GPUs: how many processes each stage starts, on which devices, and each training
process's share of the recipe's batch.

A recipe's batch is written for one process: ``per_device_train_batch_size`` completions a micro-batch x
``gradient_accumulation_steps`` micro-batches = the completions of one optimizer step (the formal recipe: 8 x 16 =
128 = 32 prompts x 4 samples). On P processes a step still means that batch: :func:`split_batch` divides the
gradient accumulation by P (keeping each micro-batch, so memory a GPU holds does not change), or, where the
accumulation does not divide, picks a smaller micro-batch; a batch that cannot be split evenly is refused with the
numbers. ``OPDConfig`` applies it under a launcher (``WORLD_SIZE``), ``run.sh --plan`` prints it.

No torch import: ``run.sh`` calls the CLI before anything heavy loads.

    python -m data_tools.layout --train configs/opd_r1_distill_1p5b.yaml --gpus 8 [--nodes 2]   # the layout, printed
    python -m data_tools.layout --train ... --gpus 8 --shell                                      # KEY=VALUE for run.sh
    python -m data_tools.layout --count-gpus                                                      # usable GPUs here
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

#: OPDConfig / TrainingArguments defaults, for a recipe whose YAML does not set them.
DEFAULTS = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "num_generations": 4,
            "sft_batch_size": 64}


def visible_gpus(env: Mapping[str, str] | None = None, nvidia_smi: str | None = None) -> list[str]:
    """The GPUs this run may use, as ``CUDA_VISIBLE_DEVICES`` entries (indices or UUIDs), in order.

    ``nvidia-smi -L`` lists the machine's GPUs (without it, the ``/dev/nvidia<N>`` device files);
    ``CUDA_VISIBLE_DEVICES`` (when set) narrows them, as CUDA itself does: empty or ``-1`` hides all, and an entry
    CUDA would not find ends the list there. ``nvidia_smi`` is that command's output (for tests); by default it is
    run; if it fails, no GPU is counted.
    """
    env = os.environ if env is None else env
    if nvidia_smi is None:
        exe = shutil.which("nvidia-smi", path=env.get("PATH"))
        if exe is None:
            nvidia_smi = "".join(f"GPU {p.name[6:]}: NVIDIA device\n" for p in sorted(Path("/dev").glob("nvidia[0-9]*")))
        else:
            try:
                nvidia_smi = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=60).stdout
            except (OSError, subprocess.SubprocessError):
                return []
    found = []  # (index, uuid)
    for line in nvidia_smi.splitlines():
        if line.startswith("GPU "):
            idx = line[4:].split(":", 1)[0].strip()
            uuid = line.rsplit("UUID:", 1)[1].strip(" )") if "UUID:" in line else ""
            found.append((idx, uuid))
    if "CUDA_VISIBLE_DEVICES" not in env:
        return [idx for idx, _ in found]
    out = []
    for entry in (e.strip() for e in env["CUDA_VISIBLE_DEVICES"].split(",")):
        match = [idx for idx, uuid in found if entry == idx or (entry and uuid.startswith(entry))]
        if not entry or entry == "-1" or not match:
            break  # CUDA stops at the first entry it cannot resolve
        out.append(entry)
    return out


def split_batch(per_device: int, accumulation: int, processes: int, *, num_generations: int = 1,
                sft_batch_size: int | None = None) -> tuple[int, int]:
    """``(per_device', accumulation')`` so that ``per_device' x accumulation' x processes`` completions make the
    recipe's step of ``per_device x accumulation``; per_device' <= per_device.

    Raises:
        ValueError: the step's completions, or its SFT batch, do not divide over ``processes``; the message names
            the numbers and the nearest process counts that work.
    """
    if processes < 1:
        raise ValueError(f"need at least one process, got {processes}")
    batch = per_device * accumulation
    if processes == 1:
        return per_device, accumulation
    if batch % processes:
        fits = [p for p in range(1, 17) if batch % p == 0]
        raise ValueError(f"the recipe's step of {batch} completions (per_device_train_batch_size {per_device} x "
                         f"gradient_accumulation_steps {accumulation}) does not divide over {processes} processes: "
                         f"use a process count in {fits} (CUDA_VISIBLE_DEVICES), or set "
                         f"gradient_accumulation_steps so that the step is a multiple of {processes} (and of "
                         f"num_generations {num_generations})")
    share = batch // processes
    if accumulation % processes == 0:
        out = per_device, accumulation // processes
    else:  # the fewest micro-batches whose size stays within the recipe's micro-batch
        acc = next(a for a in range(1, share + 1) if share % a == 0 and share // a <= per_device)
        out = share // acc, acc
    if sft_batch_size is not None and sft_batch_size % (processes * out[1]):
        raise ValueError(f"sft_batch_size {sft_batch_size} does not divide over {processes} processes x "
                         f"{out[1]} micro-batches each: make it a multiple of {processes * out[1]}")
    if num_generations > 1 and (out[0] * out[1] * processes) % num_generations:
        raise ValueError(f"{processes} processes x {out[0] * out[1]} completions is not a multiple of "
                         f"num_generations {num_generations}")
    return out


@dataclass
class Layout:
    """What each stage runs on one node of ``gpus`` GPUs (``nodes`` nodes in all)."""

    gpus: list[str]
    nodes: int
    per_device: int
    accumulation: int
    recipe_per_device: int
    recipe_accumulation: int
    num_generations: int

    processes: int = 0  # training processes on this node; 0 = one a GPU (one on a machine without GPUs)

    def __post_init__(self):
        self.processes = self.processes or max(len(self.gpus), 1)

    @property
    def workers(self) -> int:
        """Engine processes of stage one and evaluation on this node: one a GPU (one on the CPU)."""
        return max(len(self.gpus), 1)

    def lines(self) -> list[str]:
        world = self.processes * self.nodes
        where = f"GPUs {','.join(self.gpus)}" if self.gpus else "the CPU"
        nodes = f" on each of {self.nodes} nodes" if self.nodes > 1 else ""
        step = self.recipe_per_device * self.recipe_accumulation
        launcher = "accelerate launch, DDP" if world > 1 else "one process"
        engines = (f"{self.workers} engine worker(s){nodes}, one a GPU, each on its share of the "
                   if self.gpus else "one engine on the CPU over all ")
        return [f"layout: {len(self.gpus) or 'no'} GPU(s) visible{nodes}; {where}",
                f"  stage one   {engines}problems (seeded order)",
                f"  training    {world} process(es) ({launcher}); a step = {step} completions "
                f"({step // max(self.num_generations, 1)} prompts x {self.num_generations}) = {world} x "
                f"{self.per_device} a micro-batch x {self.accumulation} accumulated "
                f"(the recipe's {self.recipe_per_device} x {self.recipe_accumulation} on one process)",
                f"  evaluation  {engines}problems"]


def _yaml(path: str | Path) -> dict:
    try:  # here, not at the top: --count-gpus runs under the system python3, standard library only
        from data_tools.clock import read_yaml
    except ImportError:
        raise ValueError("pyyaml is not installed, so the training config cannot be read (the preflight above names "
                         "every missing package)") from None
    return read_yaml(path)


def plan(train_cfg: str | Path, gpus: list[str], nodes: int = 1, argv: list[str] | None = None,
         processes: int = 0) -> Layout:
    """The layout of ``train_cfg`` (a stage-two YAML) over ``gpus`` on each of ``nodes`` nodes (``processes``
    training processes a node; 0 = one a GPU); command-line overrides in ``argv`` (``--per_device_train_batch_size
    4`` ...) win over the YAML, as in ``stages.train``."""
    y = {**DEFAULTS, **{k: v for k, v in _yaml(train_cfg).items() if v is not None}}
    argv = list(argv or [])
    for i, a in enumerate(argv[:-1]):
        if a.startswith("--") and a[2:] in DEFAULTS:
            y[a[2:]] = argv[i + 1]
    pd, ga, g, sft = (int(y[k]) for k in ("per_device_train_batch_size", "gradient_accumulation_steps",
                                          "num_generations", "sft_batch_size"))
    world = (processes or max(len(gpus), 1)) * nodes
    pd2, ga2 = split_batch(pd, ga, world, num_generations=g, sft_batch_size=sft)
    return Layout(gpus=gpus, nodes=nodes, per_device=pd2, accumulation=ga2, recipe_per_device=pd,
                  recipe_accumulation=ga, num_generations=g, processes=processes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m data_tools.layout", description=__doc__.split("\n\n")[0])
    p.add_argument("--train", help="stage-two YAML")
    p.add_argument("--gpus", type=int, default=None, help="GPUs on this node (default: counted here)")
    p.add_argument("--nodes", type=int, default=int(os.environ.get("NNODES") or 1), help="nodes (env NNODES)")
    p.add_argument("--processes", type=int, default=int(os.environ.get("OPD_NUM_PROCESSES") or 0),
                   help="training processes a node (env OPD_NUM_PROCESSES; default one a GPU, one on a CPU machine)")
    p.add_argument("--shell", action="store_true", help="print KEY=VALUE lines for run.sh")
    p.add_argument("--count-gpus", action="store_true", help="print the usable GPU count and exit")
    a, rest = p.parse_known_args(argv)
    gpus = visible_gpus()
    if a.count_gpus:
        print(len(gpus))
        return 0
    if a.gpus is not None:
        gpus = gpus[: a.gpus] if len(gpus) >= a.gpus else [str(i) for i in range(a.gpus)]
    try:
        if a.nodes < 1 or a.processes < 0:
            raise ValueError(f"need NNODES >= 1 and OPD_NUM_PROCESSES >= 0, got {a.nodes} and {a.processes}")
        lay = plan(a.train, gpus, a.nodes, rest, processes=a.processes)
    except ValueError as e:
        print(f"run.sh: {e}", file=sys.stderr)
        return 2
    if a.shell:
        print(f"NGPUS={len(gpus)}\nNPROC={lay.processes}\nWORKERS={lay.workers}\nGPU_LIST={','.join(gpus)}")
        print("LAYOUT_LINES=(" + " ".join(shlex.quote(x) for x in lay.lines()) + ")")
    else:
        print("\n".join(lay.lines()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
