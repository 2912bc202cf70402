#!/usr/bin/env bash
# One pass of the GPU checks on a CUDA machine, with or without vLLM, from the repo root:
#
#   bash bench/gpu_check.sh [RESULTS_DIR]     # default ${TMPDIR:-/tmp}/opd-gpu-check
#
# 1. the GPU tests (`pytest -m gpu`);
# 2. the demo_gpu recipe end to end, its stages in run.sh's order (curate, train, evaluate the start
#    model and the last checkpoint, report), each timed -- by hand rather than through run.sh, so it
#    also runs where `make setup` cannot (a machine without a package index, PY=python3);
# 3. MATH-500 (math500_pass_at_1: 500 problems x 4 samples) at a labelled generation cap that fits
#    SmolLM2-135M's context (MATH_CAP tokens, default 1536; MATH_LIMIT=N scores the first N only).
#
# Environment: PY (default .venv/bin/python, else python3), MATH500 (the question file, default
# ../shared/data/math500_test.jsonl), ENGINE (auto | vllm | hf, default auto).
# Writes RESULTS_DIR/: gpu_tests.log, stage_times.tsv, <stage>.log, run/ (the run's OUTPUT_DIR).
set -uo pipefail
cd "$(dirname "$0")/.."
res=${1:-${TMPDIR:-/tmp}/opd-gpu-check}
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
MATH500=${MATH500:-../shared/data/math500_test.jsonl}
MATH_CAP=${MATH_CAP:-1536}
ENGINE=${ENGINE:-auto}
mkdir -p "$res"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
printf 'stage\texit\tseconds\n' > "$res/stage_times.tsv"

stage() {  # stage NAME CMD...: run, log to RESULTS_DIR/NAME.log, record exit code and seconds
  local name=$1; shift
  local t0; t0=$(date +%s%N)
  "$@" > "$res/$name.log" 2>&1; local rc=$?
  local ds=$(( ($(date +%s%N) - t0) / 100000000 ))  # tenths of a second
  printf '%s\t%s\t%d.%d\n' "$name" "$rc" $((ds / 10)) $((ds % 10)) | tee -a "$res/stage_times.tsv"
  tail -3 "$res/$name.log"
  return $rc
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, transformers, trl; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__, '| trl', trl.__version__)"
stage model "$PY" -c "from data_tools.models import resolve_model; print(resolve_model(None))"

stage gpu_tests "$PY" -m pytest -m gpu -q -p no:cacheprovider

export OUTPUT_DIR="$res/run" EXPERIMENT_NAME=demo_gpu
export CKPT_DIR="$OUTPUT_DIR/checkpoints"

stage curate "$PY" -m stages.curate --config configs/curate_demo_gpu.yaml --engine "$ENGINE" &&
stage train "$PY" -m stages.train --config configs/demo_gpu.yaml && {
  last=$(ls -d "$CKPT_DIR"/checkpoint-* | sort -t- -k2 -n | tail -1)
  start=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['models']['student']['path'])" "$OUTPUT_DIR/curate/manifest.json")
  stage eval_start "$PY" -m stages.evaluate --protocol synth_heldout_gpu --engine "$ENGINE" --model "$start" --label start__synth_heldout_gpu
  stage eval_final "$PY" -m stages.evaluate --protocol synth_heldout_gpu --engine "$ENGINE" --model "$last" --label final__synth_heldout_gpu
  stage report "$PY" -m stages.report --run "$OUTPUT_DIR"
}

if [ -f "$MATH500" ]; then
  stage math500 "$PY" -m stages.evaluate --protocol math500_pass_at_1 --engine "$ENGINE" --eval_data "$MATH500" \
    --max_tokens "$MATH_CAP" ${MATH_LIMIT:+--limit "$MATH_LIMIT"} --label "math500_pass_at_1__cap$MATH_CAP"
else
  echo "no $MATH500: MATH-500 evaluation skipped (set MATH500=FILE)"
fi
cat "$res/stage_times.tsv"
