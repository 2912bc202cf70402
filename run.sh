#!/usr/bin/env bash
# opd end to end on one wall clock: set-up -> curate -> train -> evaluate -> report.
#
#   bash run.sh                    # the formal recipe when STUDENT_MODEL is set and CUDA is visible, else the CPU demo
#   bash run.sh RECIPE             # demo_cpu | demo_gpu | r1_distill_1p5b
#   bash run.sh --plan [RECIPE]    # print the recipe, its config files, the GPU layout and each stage's budget; run nothing
#   bash run.sh --rehearse [RECIPE]  # the recipe on a REHEARSAL_SECONDS clock (1200), every phase forced, under
#                                    # ${OUTPUT_DIR}.rehearsal; a table per phase and the real run's projection (stages/rehearse.py)
#
# One node, N GPUs, no flags: stage one and evaluation start one engine worker a GPU, training one process a GPU
# (accelerate launch, DDP; a step keeps the recipe's batch). CUDA_VISIBLE_DEVICES narrows the GPUs;
# OPD_NUM_PROCESSES sets the training processes (e.g. 2 on a CPU machine, gloo). Several nodes: the same command
# on each, with NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT set (torchrun's names) and a shared OUTPUT_DIR.
#
# Environment (the run contract; values here win over the recipe's config defaults):
#   STUDENT_MODEL TEACHER_MODEL TRAIN_DATA EVAL_DATA MAX_WALL_TIME_SECONDS DEADLINE_RESERVE_SECONDS
#   OUTPUT_DIR CKPT_DIR EXPERIMENT_NAME
# and, to swap a stage's recipe: CURATE_CONFIG TRAIN_CONFIG EVAL_PROTOCOLS (space-separated; empty = none);
# OPD_PYTHON: the interpreter (default .venv's; without .venv the image's python3 where a GPU is visible).
# MAX_WALL_TIME_SECONDS counts from this script's start (set-up included); training stops at
# MAX_WALL_TIME_SECONDS - DEADLINE_RESERVE_SECONDS (less the evaluation reserve of a recipe that keeps
# one) and its final export is done within the reserve.
# OUTPUT_DIR defaults to /out/opd/$EXPERIMENT_NAME where /out is a writable directory (the formal layout: CKPT_DIR
# then defaults to /out/checkpoints; OPD_FORMAL_OUT names another root, empty none), else to
# ${OPD_CACHE:-${XDG_CACHE_HOME:-~/.cache}/opd}/runs/$EXPERIMENT_NAME (CKPT_DIR: $OUTPUT_DIR/checkpoints).
# Where /tmp is small (under 2 GiB total or free; OPD_SMALL_TMP=1 / 0 forces it on / off) temp files go to
# $OUTPUT_DIR/tmp and, where HOME is on a small file system too, HOME and every library's cache to $OUTPUT_DIR/home
# (TMPDIR, HOME, HF_HOME, TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR, VLLM_CACHE_ROOT, ...: data_tools/rundirs.py).
# Exit codes: a failing stage's own code (74: disk full); 75 when another run holds OUTPUT_DIR or CKPT_DIR; 2 for a bad
# recipe or clock or a preflight refusal; 130 / 143 after Ctrl-C / SIGTERM (the running stage stops first; training saves).
set -uo pipefail
cd "$(dirname "$0")"
t0=$(date +%s.%N)
export OPD_RUN_START=$t0   # every stage counts the clock from here (data_tools/clock.py)
PY=.venv/bin/python
# The interpreter: OPD_PYTHON if set; else .venv's; else, on a machine where a GPU is visible (a GPU node: its
# image has the stack and maybe no package index), the image's python3, and nothing is installed (`make setup-gpu`
# builds a venv where an index exists); else a CPU machine's python3 if it has the required packages, or
# `make setup` builds .venv (the CPU demo's one-command set-up). The preflight below names what is missing.
gpu_listed() {  # nvidia-smi lists a GPU (or /dev/nvidia<N> exists) that CUDA_VISIBLE_DEVICES leaves visible
  [ "$(python3 -m data_tools.layout --count-gpus 2>/dev/null || echo 0)" -gt 0 ]  # standard library only
}
if [ -n "${OPD_PYTHON:-}" ]; then PY=$OPD_PYTHON; skip_setup=1
elif [ -x "$PY" ]; then gpu_listed && skip_setup=1 || skip_setup=0  # CPU: make setup keeps .venv current (a no-op when it is)
elif gpu_listed; then PY=python3; skip_setup=1
elif python3 -m data_tools.preflight --packages --quiet >/dev/null 2>&1; then PY=python3; skip_setup=1
else skip_setup=0
fi
if [ $skip_setup = 1 ] && ! command -v "$PY" >/dev/null 2>&1; then
  echo "run.sh: no python interpreter '$PY' (set OPD_PYTHON to one that has the packages of README \"The formal run\")" >&2; exit 2
fi
[ $skip_setup = 0 ] || PY=$(command -v "$PY")

# The recipe table, one entry per recipe:
#   NAME) recipe CURATE_CONFIG TRAIN_CONFIG "EVAL_PROTOCOLS" EXPERIMENT_NAME EVAL_POLICY ;;
# EVAL_POLICY reserve:<s>: keep <s> seconds of the clock for evaluation (re-estimated from stage one's
# measured rates before training starts); if_time: keep none, evaluate only if the time left covers it
# (the formal run's orchestrator scores the exports itself).
recipe() { : "${CURATE_CONFIG:=$1}" "${TRAIN_CONFIG:=$2}" "${EVAL_PROTOCOLS=$3}" "${EXPERIMENT_NAME:=$4}"; eval_policy=$5; }
set_recipe() {
  case "$1" in
    demo_cpu)        recipe configs/curate_demo_cpu.yaml configs/demo_cpu.yaml synth_heldout default reserve:240 ;;
    demo_gpu)        recipe configs/curate_demo_gpu.yaml configs/demo_gpu.yaml synth_heldout_gpu demo_gpu reserve:90 ;;
    r1_distill_1p5b) recipe configs/curate_r1_distill_1p5b.yaml configs/opd_r1_distill_1p5b.yaml \
                       "math500_pass_at_1 aime24_25_at32" opd_r1_distill_1p5b if_time ;;
    *) echo "run.sh: unknown recipe '$1' (recipes: $(sed -n 's/^    \([a-z0-9_]*\)) *recipe .*/\1/p' "$0" | xargs))" >&2; exit 2 ;;
  esac
}

plan=0 rehearse=0 name=""
for arg in "$@"; do  # --plan anywhere, at most one recipe; anything else is refused before anything runs
  case "$arg" in
    -h|--help) sed -n '2,/^set -uo/{/^set -uo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;  # the header, exit codes included
    --plan) plan=1 ;;
    --rehearse) rehearse=1 ;;
    -*) echo "run.sh: unknown option '$arg' (options: --plan, --rehearse, --help)" >&2; exit 2 ;;
    *) [ -z "$name" ] || { echo "run.sh: one recipe at most, got '$name' and '$arg'" >&2; exit 2; }; name=$arg ;;
  esac
done
if [ -n "$name" ]; then why="named on the command line"
elif [ -z "${STUDENT_MODEL:-}" ]; then name=demo_cpu; why="STUDENT_MODEL is not set"
elif gpu_listed; then name=r1_distill_1p5b; why="STUDENT_MODEL is set and CUDA is visible"
else name=demo_cpu; why="STUDENT_MODEL is set but no CUDA device is visible; the demo recipe runs on STUDENT_MODEL"
fi
set_recipe "$name"
if [ "$name" = r1_distill_1p5b ]; then  # without them its configs would fall back to the 135M demo student and a self-teacher
  unset_vars=$(for v in STUDENT_MODEL TEACHER_MODEL; do [ -n "${!v:-}" ] || printf '%s ' "$v"; done)
  if [ -n "$unset_vars" ]; then
    echo "run.sh: recipe r1_distill_1p5b needs STUDENT_MODEL and TEACHER_MODEL, local model directories (unset: ${unset_vars% });" \
         "the CPU demo is: bash run.sh demo_cpu; to see this recipe's plan without the real models:" \
         ".venv/bin/python -m data_tools.formal_models --out DIR --tiny, then STUDENT_MODEL=DIR/student" \
         "TEACHER_MODEL=DIR/teacher bash run.sh r1_distill_1p5b --plan" >&2
    exit 2
  fi
fi
# The run's directories, and the scratch environment where /tmp is small: data_tools/rundirs.py's rule (the header
# above), the one the stages' own defaults follow. Standard library only: before set-up, the system's python3.
boot=$PY; command -v "$boot" >/dev/null 2>&1 || boot=python3
dirs=$("$boot" -m data_tools.rundirs shell --experiment "$EXPERIMENT_NAME") || exit 2
eval "$dirs"  # OUTPUT_DIR CKPT_DIR SCRATCH SCRATCH_NOTE
export EXPERIMENT_NAME OUTPUT_DIR CKPT_DIR
if [ -n "$SCRATCH_NOTE" ]; then  # before anything runs: set-up, the stages and every library they load follow it
  if [ $plan = 1 ]; then
    echo "run.sh: $SCRATCH_NOTE (a run exports these; --plan creates nothing)"
  elif mkdir -p "${SCRATCH[@]#*=}"; then
    export "${SCRATCH[@]}"
    echo "run.sh: $SCRATCH_NOTE"
  else
    echo "run.sh: warning: $SCRATCH_NOTE: cannot create them (above); temp files and caches stay where they are" >&2
  fi
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

# A rehearsal runs under its own directory (stages/rehearse.py): known now, so that its lock is the one taken below.
if [ $rehearse = 1 ]; then
  OUTPUT_DIR=${REHEARSAL_DIR:-${OUTPUT_DIR%/}.rehearsal}
  CKPT_DIR=$OUTPUT_DIR/checkpoints
  export OUTPUT_DIR CKPT_DIR
fi
# One run per OUTPUT_DIR / CKPT_DIR, checked first: a second run exits 75 at once, before set-up, the preflight and the
# config check spend anything. The lock records this shell's pid; the stages see OPD_LOCK_OWNER and run under it. A
# lock left by a dead process is taken over. Several nodes share the directories: node 0's run.sh holds the lock for
# the run, the others run under it (data_tools.runio.run_lock). The lock's CLI needs the standard library only.
: "${NNODES:=1}" "${NODE_RANK:=0}" "${MASTER_ADDR:=127.0.0.1}" "${MASTER_PORT:=29500}"
case "$NODE_RANK" in ''|*[!0-9]*) echo "run.sh: NODE_RANK must be a number, got '$NODE_RANK'" >&2; exit 2 ;; esac
unlock() { "$boot" -m data_tools.runio unlock "$OUTPUT_DIR" "$CKPT_DIR" --pid $$; }
if [ $plan = 0 ] && [ "$NODE_RANK" = 0 ]; then
  "$boot" -m data_tools.runio lock "$OUTPUT_DIR" "$CKPT_DIR" --pid $$ || exit $?
  export OPD_LOCK_OWNER=$$
  trap unlock EXIT
fi

elapsed() { echo $(( $(date +%s) - ${t0%.*} )); }
say() { printf '\n=== [%4ds] %s\n' "$(elapsed)" "$*"; }

if [ $skip_setup = 0 ] && { [ $plan = 0 ] || [ ! -x $PY ]; }; then
  setup_log=${TMPDIR:-/tmp}/opd-setup.$$.log
  if ! make -s setup >"$setup_log" 2>&1; then
    tail -20 "$setup_log"; echo "run.sh: make setup failed (log: $setup_log)" >&2; exit 1
  fi
  rm -f "$setup_log"
fi
# Packages, GPUs, model and data paths, output directories, free disk: in a second, before anything is spent.
preflight() {
  $PY -m data_tools.preflight --recipe "$name" --curate "$CURATE_CONFIG" --train "$TRAIN_CONFIG" \
    --protocols "$EVAL_PROTOCOLS" $([ $plan = 1 ] && echo --plan)
}
# A rehearsal: the same recipe under its own directory on a short clock (stages/rehearse.py says what changes). The
# real run's clock is kept for the projection. Stage one's verified share is a rehearsal's only (never a real run's).
if [ $rehearse = 1 ]; then
  real=$($PY -m data_tools.clock shell --recipe "$name" --curate "$CURATE_CONFIG" --train "$TRAIN_CONFIG" \
         --protocols "$EVAL_PROTOCOLS" --eval "$eval_policy") || exit 2
  REAL_CLOCK_S=$(sed -n 's/^CLOCK_S=//p' <<<"$real") REAL_RESERVE_S=$(sed -n 's/^RESERVE_S=//p' <<<"$real")
  REAL_EVAL_S=$(sed -n 's/^EVAL_RESERVE_S=//p' <<<"$real")
  REHEARSAL_SECONDS=${REHEARSAL_SECONDS:-1200}
  export OPD_REHEARSAL_VERIFIED=${REHEARSAL_VERIFIED-0.5}
  [ -n "$OPD_REHEARSAL_VERIFIED" ] || unset OPD_REHEARSAL_VERIFIED
  EVAL_PROTOCOLS="" eval_policy=if_time  # the exports are loaded back by the rehearsal's report instead
else
  unset OPD_REHEARSAL_VERIFIED
fi
pf_ok=1
preflight || { [ $plan = 1 ] || exit 2; pf_ok=0; }  # --plan still prints what it can, then exits 2
# The node's layout: GPUs usable here, training processes, engine workers, each process's share of a step
layout=$($PY -m data_tools.layout --train "$TRAIN_CONFIG" --nodes "$NNODES" --shell) || exit 2
eval "$layout"  # NGPUS NPROC WORKERS GPU_LIST LAYOUT_LINES
curate_extra=() train_extra=()
if [ $rehearse = 1 ]; then
  rplan=$($PY -m stages.rehearse plan --curate "$CURATE_CONFIG" --train "$TRAIN_CONFIG" --seconds "$REHEARSAL_SECONDS" \
          --workers "$WORKERS" --real-clock "$REAL_CLOCK_S" --real-reserve "$REAL_RESERVE_S" \
          --real-eval-reserve "$REAL_EVAL_S") || exit 2
  eval "$rplan"  # R_CHUNK R_SHARE R_RESERVE R_WARMUP R_NOTE
  export MAX_WALL_TIME_SECONDS=$REHEARSAL_SECONDS DEADLINE_RESERVE_SECONDS=$R_RESERVE
  curate_extra=(--chunk_size "$R_CHUNK" --probe_size "$R_CHUNK" --time_share "$R_SHARE")  # one forced chunk a role
  train_extra=(--lr_warmup_time "$R_WARMUP")
fi
clock_args=(--recipe "$name" --curate "$CURATE_CONFIG" --train "$TRAIN_CONFIG" --protocols "$EVAL_PROTOCOLS" --eval "$eval_policy")
# The training config is parsed now, not after stage one: a typo in it must not cost stage one's hours.
check_train_config() {  # parses the config, checks the teacher's tokenizer; quiet when fine, else its lines without log noise
  local out
  out=$($PY -m stages.train --config "$TRAIN_CONFIG" "${train_extra[@]}" --check_config 2>&1) || {
    grep -v -e ' INFO ' -e ' WARNING ' <<<"$out" >&2
    echo "run.sh: $TRAIN_CONFIG or its models failed the check (above); nothing was run" >&2; exit 2; }
}
if [ $plan = 1 ]; then
  echo "run.sh: recipe $name ($why); OUTPUT_DIR=$OUTPUT_DIR CKPT_DIR=$CKPT_DIR"
  [ $rehearse = 1 ] && echo "rehearsal: $R_NOTE; stage one measures that chunk whatever its share below says;" \
    "verified share ${OPD_REHEARSAL_VERIFIED:-none (the grader alone)}; the real run: ${REAL_CLOCK_S}s clock," \
    "reserve ${REAL_RESERVE_S}s (its projection comes with the rehearsal's table)"
  printf '%s\n' "${LAYOUT_LINES[@]}"
  $PY -m data_tools.clock plan "${clock_args[@]}" || exit 2  # a bad clock: its own one-line error
  [ $pf_ok = 1 ] || exit 2
  # parsing the training config as the trainer does imports torch and TRL (~10 s): after the plan, not before it
  check_train_config
  echo "training config: $TRAIN_CONFIG parses"
  exit 0
fi
clock=$($PY -m data_tools.clock shell "${clock_args[@]}") || exit 2
eval "$clock"  # CLOCK_S RESERVE_S EVAL_RESERVE_S CURATE_BUDGET_S TRAIN_END_S CURATE_SHARE
export MAX_WALL_TIME_SECONDS=$CLOCK_S DEADLINE_RESERVE_SECONDS=$RESERVE_S  # one clock for every stage
check_train_config

export NNODES NODE_RANK MASTER_ADDR MASTER_PORT
if [ $rehearse = 1 ]; then  # a rehearsal starts afresh in its own directory, and samples the GPUs' memory
  $PY -m stages.rehearse clean --run "$OUTPUT_DIR"
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=timestamp,index,memory.used,memory.total --format=csv,noheader,nounits -lms 1000 \
      >"$OUTPUT_DIR/gpu_memory.csv" 2>/dev/null & sampler=$!
    trap 'kill $sampler 2>/dev/null; unlock' EXIT
  fi
fi
mkdir -p "$OUTPUT_DIR"
record() {  # one JSON line a stage in $OUTPUT_DIR/run_stages.jsonl (its run-clock times; the rehearsal reads them)
  printf '{"stage": "%s", %s}\n' "$1" "$2" >>"$OUTPUT_DIR/run_stages.jsonl"
}
record clock "\"start\": ${t0}, \"clock_s\": $CLOCK_S, \"reserve_s\": $RESERVE_S, \"rehearsal\": $rehearse"
# Stages run in the background of this non-interactive shell, so they start with SIGINT ignored
# (POSIX: asynchronous commands without job control). SIGTERM is what every stage handles (training
# saves a checkpoint and stops after its current step), so SIGINT (Ctrl-C) and SIGTERM are both passed
# on as SIGTERM, and the lock is released only once nothing writes to the run any more.
# Under accelerate's launcher the training processes are the launcher's children: they get the SIGTERM (each
# finishes its step; together they save once), and the launcher, seeing them end, ends too. Signalling the
# launcher instead would make it kill them TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds later, which a step and a save
# can outlast; it handles SIGTERM only (a terminal's Ctrl-C reaches the processes themselves).
child="" launcher=0
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-1800} TORCHELASTIC_SIGNALS_TO_HANDLE=SIGTERM,SIGHUP,SIGQUIT
on_signal() {
  echo "run.sh: got SIG$1; stopping the current stage (pid ${child:-none}) with SIGTERM and waiting for it" >&2
  if [ -n "$child" ]; then
    local procs=""
    [ $launcher = 1 ] && procs=$(pgrep -P "$child" 2>/dev/null | xargs)
    kill -TERM ${procs:-$child} 2>/dev/null
    wait "$child"
  fi
  exit $(( 128 + $2 ))
}
trap 'on_signal TERM 15' TERM
trap 'on_signal INT 2' INT

stage() {  # stage NAME CMD...: run it; on failure stop with its exit code and a one-line reason
  local name=$1; shift
  local began start; began=$(elapsed) start=$(date +%s.%N)
  say "$name: $*"
  "$@" & child=$!
  wait "$child"; local rc=$?
  child=""
  record "${name%% *}" "\"start\": $start, \"end\": $(date +%s.%N), \"rc\": $rc"
  if [ $rc -ne 0 ]; then
    echo "run.sh: stage '$name' failed with exit code $rc; outputs so far are kept in $OUTPUT_DIR" >&2
    exit $rc
  fi
  say "$name: done in $(( $(elapsed) - began ))s"
}
eval_estimate() {  # eval_estimate PROTOCOL N_MODELS: seconds, from stage one's measured rates (fails without them)
  $PY -m data_tools.clock eval-estimate --manifest "$OUTPUT_DIR/curate/manifest.json" --protocol "$1" --models "$2" \
    --workers "$WORKERS" 2>/dev/null
}

say "recipe $name ($why) -> OUTPUT_DIR=$OUTPUT_DIR CKPT_DIR=$CKPT_DIR"
[ $rehearse = 1 ] && echo "rehearsal: $R_NOTE; verified share ${OPD_REHEARSAL_VERIFIED:-none (the grader alone)}; the real run: ${REAL_CLOCK_S}s clock, reserve ${REAL_RESERVE_S}s"
printf '%s\n' "${LAYOUT_LINES[@]}"
[ "$NNODES" = 1 ] || echo "node $NODE_RANK of $NNODES (rendezvous $MASTER_ADDR:$MASTER_PORT)"
engine_args=()
[ "$WORKERS" -gt 1 ] && engine_args=(--workers "$WORKERS")
say "clock: ${CLOCK_S}s from this script's start, reserve ${RESERVE_S}s; stage one until ${CURATE_BUDGET_S}s (share $CURATE_SHARE), training until ${TRAIN_END_S}s, evaluation ${eval_policy}"
if ls "$OUTPUT_DIR"/resume/checkpoint-*/trainer_state.json >/dev/null 2>&1 && [ -f "$OUTPUT_DIR/curate/curriculum.parquet" ]; then
  # training has begun on this curriculum: a resumed run keeps it (stage one would measure more problems
  # on the new clock and change the rows under the resumed trainer); a fresh OUTPUT_DIR curates again
  say "curate: skipped, training has state in $OUTPUT_DIR/resume: it resumes on the curriculum it began with"
else
  stage curate $PY -m stages.curate --config "$CURATE_CONFIG" --deadline_reserve_seconds $(( RESERVE_S + EVAL_RESERVE_S )) \
    "${engine_args[@]}" "${curate_extra[@]}"
fi

eval_s=0
if [ "${eval_policy%%:*}" = reserve ]; then
  one=0  # the final export's evaluation alone
  for proto in $EVAL_PROTOCOLS; do
    e=$(eval_estimate "$proto" 2) || e=$(( EVAL_RESERVE_S / $(wc -w <<<"$EVAL_PROTOCOLS") ))
    o=$(eval_estimate "$proto" 1) || o=$(( e / 2 ))
    eval_s=$(( eval_s + e )); one=$(( one + o ))
  done
  # both evaluations (the start model's too) before training's time when short; never a reserve no evaluation can
  # run in (data_tools/clock.py eval_reserve)
  { read -r eval_s; read -r why; } < <($PY -m data_tools.clock eval-reserve --all "$eval_s" --final "$one" \
                                         --left $(( CLOCK_S - RESERVE_S - $(elapsed) )))
  say "evaluation reserve ${eval_s}s ($why; the plan assumed ${EVAL_RESERVE_S}s): training until $(( CLOCK_S - RESERVE_S - eval_s ))s"
fi
train=(-m stages.train --config "$TRAIN_CONFIG" --deadline_reserve_seconds $(( RESERVE_S + eval_s )) "${train_extra[@]}")
if [ $(( NPROC * NNODES )) -gt 1 ]; then  # accelerate's launcher (torchrun underneath): one process a GPU
  launcher=1
  train=(-m stages.launch --num_processes $(( NPROC * NNODES )) --num_machines "$NNODES" --machine_rank "$NODE_RANK"
         --main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT" -- "${train[@]:2}")
fi
stage train $PY "${train[@]}"
launcher=0
if [ "$NODE_RANK" != 0 ]; then
  say "done at $(elapsed)s: node $NODE_RANK trained; node 0 evaluates and reports"
  exit 0
fi

if [ $rehearse = 1 ]; then
  stage rehearsal $PY -m stages.rehearse report --run "$OUTPUT_DIR" --curate "$CURATE_CONFIG" --train "$TRAIN_CONFIG" \
    --real-clock "$REAL_CLOCK_S" --real-reserve "$REAL_RESERVE_S" --real-eval-reserve "$REAL_EVAL_S"
  say "rehearsal passed at $(elapsed)s; the table is in $OUTPUT_DIR/rehearsal.md"
  exit 0
fi
last_ckpt=$(ls "$CKPT_DIR" 2>/dev/null | grep -E '^checkpoint-[0-9]+$' | sort -t- -k2 -n | tail -1)
[ -n "$last_ckpt" ] || { echo "run.sh: training left no checkpoint in $CKPT_DIR" >&2; exit 1; }
last_ckpt=$CKPT_DIR/$last_ckpt
start_model=$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['models']['student']['path'])" "$OUTPUT_DIR/curate/manifest.json")
run_eval() {  # run_eval PROTOCOL MODEL LABEL: only with questions, and if the clock's time left covers its estimate
  if ! $PY -m data_tools.preflight --question-file "$1" >/dev/null; then  # warned at the start; exports and rc stand
    say "eval $3 skipped: no question file (set EVAL_DATA)"
    return 0
  fi
  local need left=$(( CLOCK_S - $(elapsed) ))
  need=$(eval_estimate "$1" 1) || need=$(( EVAL_RESERVE_S / 2 ))
  if [ "$need" -gt "$left" ]; then
    say "eval $3 skipped: it needs ~${need}s and ${left}s of the clock are left"
    return 0
  fi
  stage "eval $3 (~${need}s estimated, ${left}s left)" $PY -m stages.evaluate --protocol "$1" --model "$2" --label "$3" \
    "${engine_args[@]}"
}
# A run that trained 0 steps exported the start model as checkpoint-0: it is said, and evaluated once, as the start
# model (an evaluation labelled final would pass the start model off as a trained one)
outcome=$($PY -m stages.report --run "$OUTPUT_DIR" --outcome) || outcome=""
eval "$outcome"  # TRAINED_STEPS TRAINED_NOTE
if [ -n "${TRAINED_NOTE:-}" ]; then
  say "training: $TRAINED_NOTE; the evaluation runs on the start model only"
fi
for proto in $EVAL_PROTOCOLS; do  # the final export first: when time runs short it is the one that matters
  [ -n "${TRAINED_NOTE:-}" ] || run_eval "$proto" "$last_ckpt" "final__$proto"
  run_eval "$proto" "$start_model" "start__$proto"
done
stage report $PY -m stages.report --run "$OUTPUT_DIR"
if [ -n "${TRAINED_NOTE:-}" ]; then
  say "done at $(elapsed)s of the ${CLOCK_S}s clock: $TRAINED_NOTE"
else
  say "done at $(elapsed)s of the ${CLOCK_S}s clock; trained ${TRAINED_STEPS:-?} steps, final export $last_ckpt"
fi
