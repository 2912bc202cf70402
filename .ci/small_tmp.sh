#!/usr/bin/env bash
# Run a command the way the formal machine would see /tmp: a fresh 256 MiB tmpfs on /tmp, HOME=/tmp, TMPDIR=/tmp.
#
#   .ci/small_tmp.sh CMD ARGS...          e.g.  .ci/small_tmp.sh env MAX_WALL_TIME_SECONDS=600 bash run.sh
#
# Needs root (CI runs as root): the command runs in a new mount namespace (unshare --mount --propagation
# private), so the tmpfs is seen by the command alone and vanishes with it; the host's /tmp is untouched.
# Paths under the host's /tmp that the command needs from outside (OPD_CACHE, as .ci/run makes it with mktemp,
# and the paths named in SMALL_TMP_KEEP, space-separated) are bind-mounted into the tmpfs: they lie on the
# host's disk and are not counted. The cache variables that would let a library write elsewhere than HOME
# (XDG_CACHE_HOME, HF_HOME, TORCHINDUCTOR_CACHE_DIR, ...) are unset, as on a fresh machine.
#
# /tmp's use (statvfs, as df reports it) is sampled every SMALL_TMP_SAMPLE_S seconds (0.1) while the command runs.
# It prints the command's exit code, its wall seconds, the peak and the final use of /tmp in MiB (and what is
# left there), and exits non-zero when the command failed (its exit code) or the peak or the final use went
# over SMALL_TMP_LIMIT_MIB (16; exit 3). SMALL_TMP_SIZE_MIB sets the tmpfs's size (256). A sample can miss a
# file written and deleted between two samples; the tmpfs's size is the hard bound (a write past it fails the
# command), so SMALL_TMP_SIZE_MIB=16 makes the limit strict.
set -uo pipefail
limit=${SMALL_TMP_LIMIT_MIB:-16} size=${SMALL_TMP_SIZE_MIB:-256} every=${SMALL_TMP_SAMPLE_S:-0.1}
[ $# -gt 0 ] || { sed -n '2,/^set -uo/{/^set -uo/d;s/^# \{0,1\}//;p}' "$0" >&2; exit 2; }

if [ "${_SMALL_TMP_NS:-}" != "$$" ]; then  # outside: re-run this script in a new mount namespace
  [ "$(id -u)" = 0 ] || { echo "small_tmp: needs root (a mount namespace and a tmpfs mount)" >&2; exit 2; }
  keep=()
  for p in ${OPD_CACHE:-} ${SMALL_TMP_KEEP:-}; do
    case "$p" in /tmp/*) mkdir -p "$p" && keep+=("$(realpath "$p")") ;; esac  # created here: a mount point needs one
  done
  # exec: the namespace's shell gets this pid, which is how it knows it is inside
  exec env _SMALL_TMP_NS=$$ _SMALL_TMP_KEEP="${keep[*]}" unshare --mount --propagation private bash "$0" "$@"
fi

# inside the namespace: the host's /tmp stays reachable through fd 9 while the tmpfs covers it
exec 9</tmp
mount -t tmpfs -o "size=${size}m,mode=1777" small-tmp /tmp || { echo "small_tmp: mounting a tmpfs on /tmp failed" >&2; exit 2; }
for p in ${_SMALL_TMP_KEEP:-}; do
  rel=${p#/tmp/}
  mkdir -p "/tmp/$rel"
  # --no-canonicalize: the source is reached through fd 9 (the covered /tmp); resolving it would name the tmpfs
  mount --no-canonicalize --bind "/proc/$$/fd/9/$rel" "/tmp/$rel" || { echo "small_tmp: cannot keep $p" >&2; exit 2; }
done
exec 9<&-
kept=${_SMALL_TMP_KEEP:-none}
unset _SMALL_TMP_NS _SMALL_TMP_KEEP XDG_CACHE_HOME XDG_CONFIG_HOME XDG_DATA_HOME HF_HOME HF_DATASETS_CACHE \
  HF_HUB_CACHE TRANSFORMERS_CACHE TORCHINDUCTOR_CACHE_DIR TRITON_CACHE_DIR VLLM_CACHE_ROOT VLLM_CONFIG_ROOT \
  VLLM_ASSETS_CACHE MPLCONFIGDIR TIKTOKEN_CACHE_DIR NUMBA_CACHE_DIR TORCH_EXTENSIONS_DIR CUDA_CACHE_PATH \
  FLASHINFER_WORKSPACE_BASE PYTHONPYCACHEPREFIX PIP_CACHE_DIR
export HOME=/tmp TMPDIR=/tmp
used_kib() { df -k --output=used /tmp | tail -1 | tr -d ' '; }
base=$(used_kib)  # the empty tmpfs (and the keep mount points): 0 here
echo "small_tmp: /tmp is a fresh ${size} MiB tmpfs, HOME=/tmp TMPDIR=/tmp; limit ${limit} MiB; kept from the host's /tmp: $kept"
t0=$(date +%s.%N)
"$@" & cmd=$!
sig=0
trap 'sig=1; kill -TERM $cmd 2>/dev/null' TERM INT  # passed on: the command stops itself (run.sh saves and exits)
# The sampler prints the largest use it saw once the command has ended: statvfs in one python3 process (df once a
# sample where there is none). It runs beside the command, so this shell waits in `wait`, which a signal interrupts.
if command -v python3 >/dev/null 2>&1; then
  exec 8< <(python3 -c '
import os, sys, time
pid, every, peak = int(sys.argv[1]), float(sys.argv[2]), 0
while True:
    st = os.statvfs("/tmp")
    peak = max(peak, (st.f_blocks - st.f_bfree) * st.f_frsize // 1024)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        break
    time.sleep(every)
print(peak)' "$cmd" "$every")
else
  exec 8< <(while kill -0 $cmd 2>/dev/null; do used_kib; sleep "$every"; done | sort -n | tail -1)
fi
wait $cmd; rc=$?
while [ $sig = 1 ]; do sig=0; wait $cmd; rc=$?; done  # a signal cut the wait short: wait for the command's own end
read -r peak <&8
exec 8<&-
wall=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
left=$(used_kib)
[ -n "$peak" ] && [ "$peak" -ge "$left" ] || peak=$left
mib() { awk -v k="$1" -v b="$base" 'BEGIN { printf "%.2f MiB (%d KiB)", (k - b) / 1024, k - b }'; }
echo "small_tmp: exit $rc after $wall s; /tmp peak $(mib "$peak"), left $(mib "$left") (limit $limit MiB)"
if [ "$left" -gt "$base" ]; then
  echo "small_tmp: left under /tmp (KiB, largest first):"
  du -xak /tmp 2>/dev/null | awk -F'\t' '$2 != "/tmp" { print "  " $0 }' | sort -k1,1rn | head -15
fi
[ $rc = 0 ] || { echo "small_tmp: the command failed (exit $rc)" >&2; exit $rc; }
if [ $(( peak - base )) -gt $(( limit * 1024 )) ] || [ $(( left - base )) -gt $(( limit * 1024 )) ]; then
  echo "small_tmp: /tmp use went over $limit MiB" >&2; exit 3
fi
echo "small_tmp: passed"
