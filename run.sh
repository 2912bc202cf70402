#!/usr/bin/env bash
# opd end to end: curate -> train -> evaluate (start model and last checkpoint) -> report.
#
#   bash run.sh                      # embedded CPU demo: SmolLM2-135M, privileged self-teacher, generated problems
#   bash run.sh r1_distill_1p5b      # formal recipe on a GPU node (set the environment below)
#
# Environment (the run contract; values here win over the recipe's config defaults):
#   STUDENT_MODEL TEACHER_MODEL TRAIN_DATA EVAL_DATA MAX_WALL_TIME_SECONDS DEADLINE_RESERVE_SECONDS
#   OUTPUT_DIR CKPT_DIR EXPERIMENT_NAME
# and, to swap a stage's recipe: CURATE_CONFIG TRAIN_CONFIG EVAL_PROTOCOLS (space-separated).
# Exit codes: a failing stage's own code; 75 when another run holds OUTPUT_DIR or CKPT_DIR.
set -uo pipefail
cd "$(dirname "$0")"

recipe="${1:-demo_cpu}"
case "$recipe" in
  demo_cpu)
    : "${CURATE_CONFIG:=configs/curate_demo_cpu.yaml}" "${TRAIN_CONFIG:=configs/demo_cpu.yaml}"
    : "${EVAL_PROTOCOLS:=synth_heldout}" "${EXPERIMENT_NAME:=default}" ;;  # = make's default run dir
  r1_distill_1p5b)
    : "${CURATE_CONFIG:=configs/curate_r1_distill_1p5b.yaml}" "${TRAIN_CONFIG:=configs/opd_r1_distill_1p5b.yaml}"
    : "${EVAL_PROTOCOLS:=math500_pass_at_1 aime24_25_at32}" "${EXPERIMENT_NAME:=opd_r1_distill_1p5b}" ;;
  -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
  *) echo "run.sh: unknown recipe '$recipe' (demo_cpu or r1_distill_1p5b)" >&2; exit 2 ;;
esac
# same root as data_tools.runio.cache_root: $OPD_CACHE, else $XDG_CACHE_HOME/opd, else ~/.cache/opd
: "${OUTPUT_DIR:=${OPD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/opd}/runs/$EXPERIMENT_NAME}"
: "${CKPT_DIR:=$OUTPUT_DIR/checkpoints}"
export EXPERIMENT_NAME OUTPUT_DIR CKPT_DIR
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

t0=$(date +%s)
say() { printf '\n=== [%4ds] %s\n' "$(( $(date +%s) - t0 ))" "$*"; }

PY=.venv/bin/python
if ! make -s setup >/tmp/opd-setup.$$.log 2>&1; then
  tail -20 /tmp/opd-setup.$$.log; echo "run.sh: make setup failed (log: /tmp/opd-setup.$$.log)" >&2; exit 1
fi
rm -f /tmp/opd-setup.$$.log

# One run per OUTPUT_DIR / CKPT_DIR: the lock records this shell's pid; the stages see
# OPD_LOCK_OWNER and run under it. A lock left by a dead process is taken over.
$PY -m data_tools.runio lock "$OUTPUT_DIR" "$CKPT_DIR" --pid $$ || exit $?
export OPD_LOCK_OWNER=$$
trap '$PY -m data_tools.runio unlock "$OUTPUT_DIR" "$CKPT_DIR" --pid $$' EXIT
# On SIGTERM / SIGINT: pass the signal to the running stage and wait until it has stopped (training
# saves a checkpoint first), so the lock is released only once nothing writes to the run any more.
child=""
on_signal() {
  echo "run.sh: got $1; stopping the current stage (pid ${child:-none}) and waiting for it" >&2
  [ -n "$child" ] && kill -"$1" "$child" 2>/dev/null && wait "$child"
  exit $(( 128 + $2 ))
}
trap 'on_signal TERM 15' TERM
trap 'on_signal INT 2' INT

stage() {  # stage NAME CMD...: run it; on failure stop with its exit code and a one-line reason
  local name=$1; shift
  say "$name: $*"
  "$@" & child=$!
  wait "$child"; local rc=$?
  child=""
  if [ $rc -ne 0 ]; then
    echo "run.sh: stage '$name' failed with exit code $rc; outputs so far are kept in $OUTPUT_DIR" >&2
    exit $rc
  fi
}

say "recipe $recipe -> OUTPUT_DIR=$OUTPUT_DIR CKPT_DIR=$CKPT_DIR"
stage curate $PY -m stages.curate --config "$CURATE_CONFIG"
stage train $PY -m stages.train --config "$TRAIN_CONFIG"

last_ckpt=$(ls -d "$CKPT_DIR"/checkpoint-* 2>/dev/null | sort -t- -k2 -n | tail -1)
[ -n "$last_ckpt" ] || { echo "run.sh: training left no checkpoint in $CKPT_DIR" >&2; exit 1; }
start_model=$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['models']['student']['path'])" "$OUTPUT_DIR/curate/manifest.json")
for proto in $EVAL_PROTOCOLS; do
  stage "eval $proto (start model)" $PY -m stages.evaluate --protocol "$proto" --model "$start_model" --label "start__$proto"
  stage "eval $proto ($(basename "$last_ckpt"))" $PY -m stages.evaluate --protocol "$proto" --model "$last_ckpt" --label "final__$proto"
done
stage report $PY -m stages.report --run "$OUTPUT_DIR"
say "done"
