#!/usr/bin/env bash
# CI's second environment: the formal image's package versions (requirements/formal.txt, built by `make formal-venv`
# into .venv-formal: transformers 4.57, TRL 1.0 installed --no-deps as the image does, numpy 1.26.4, pyarrow 23.0.1,
# datasets 4.7, accelerate 1.12; no duckdb, no vLLM; torch's CPU wheel stands in for the image's CUDA 2.10). Proves:
#   1. the fast suite there (tests needing vLLM or duckdb skip with a reason), and the trainer's tests on TRL 0.29.1;
#   2. `bash run.sh r1_distill_1p5b --plan` with models of the formal shapes and a verl parquet refuses nothing;
#   3. the CPU demo `bash run.sh` end to end from a verl-format parquet to a loadable checkpoint, with HOME and
#      TMPDIR on a 256 MiB tmpfs /tmp (.ci/small_tmp.sh), as the formal machine has them.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
say() { printf '\n=== formal stack [%4ds] %s\n' "$(( $(date +%s) - t0 ))" "$*"; }
say "make formal-venv"
make -s formal-venv
FPY=$PWD/.venv-formal/bin/python
say "fast suite + the trainer on TRL 0.29.1"
make -s test-formal
# the run's files outside the repo (run.sh refuses outputs inside it) and outside /tmp (the small /tmp below is the
# formal machine's, mounted over the real one: the run must not need anything there)
work=$(mktemp -d -p "$(dirname "$PWD")" opd-ci-formal.XXXXXX)
trap 'rm -rf "$work"' EXIT
export OPD_CACHE="$work/cache"
"$FPY" -m data_tools.synth --n 240 --verl "$work/train.parquet"
say "bash run.sh r1_distill_1p5b --plan (random models of the formal shapes, tiny)"
"$FPY" -m data_tools.formal_models --tiny --out "$work/models" >/dev/null
env OPD_PYTHON="$FPY" STUDENT_MODEL="$work/models/student" TEACHER_MODEL="$work/models/teacher" \
    TRAIN_DATA="$work/train.parquet" OUTPUT_DIR="$work/plan" bash run.sh r1_distill_1p5b --plan > "$work/plan.log" 2>&1 \
  || { cat "$work/plan.log"; echo "formal stack: --plan refused" >&2; exit 1; }
if grep -q "refus" "$work/plan.log"; then cat "$work/plan.log"; echo "formal stack: --plan printed a refusal" >&2; exit 1; fi
say "the CPU demo from a verl parquet under a 256 MiB /tmp"
bash .ci/small_tmp.sh env OPD_PYTHON="$FPY" TRAIN_DATA="$work/train.parquet" OUTPUT_DIR="$work/demo" \
    MAX_WALL_TIME_SECONDS=600 DEADLINE_RESERVE_SECONDS=60 bash run.sh
"$FPY" - "$work/demo/checkpoints" <<'PY'
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ckpts = sorted(Path(sys.argv[1]).glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
assert ckpts, f"no checkpoint-* under {sys.argv[1]}"
tok = AutoTokenizer.from_pretrained(ckpts[-1])
model = AutoModelForCausalLM.from_pretrained(ckpts[-1])
ids = tok("What is 2 + 3?", return_tensors="pt")
out = model.generate(**ids, max_new_tokens=4, do_sample=False)
assert out.shape[1] > ids["input_ids"].shape[1]
print(f"formal stack: {ckpts[-1].name} loads and generates ({len(ckpts)} export(s))")
PY
say "done"
