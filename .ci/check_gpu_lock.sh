#!/usr/bin/env bash
# CI: requirements/gpu.lock (what `make setup-gpu` installs) still resolves for Linux x86-64 / CUDA /
# Python 3.12 and still satisfies requirements/gpu.txt + requirements/common.txt. Resolves with uv
# (metadata only, no wheels downloaded; ~15 s), uv itself installed into a throw-away venv.
# Fails when a requirement changed without `make gpu-lock`, or a pinned version is no longer available.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/uv" && "$tmp/uv/bin/pip" install -q uv
# The lock as constraints: the resolution must succeed and pick exactly the locked set.
"$tmp/uv/bin/uv" pip compile -q --python-platform x86_64-manylinux_2_28 --python-version 3.12 --no-header \
  --no-annotate requirements/gpu.txt requirements/common.txt -c requirements/gpu.lock -o "$tmp/now.txt"
pins() { grep -E '^[A-Za-z0-9_.-]+(\[[^]]*\])?==' "$1" | sed 's/ .*//' | tr 'A-Z_' 'a-z-' | sort; }
if ! diff <(pins requirements/gpu.lock) <(pins "$tmp/now.txt") >"$tmp/diff"; then
  echo "requirements/gpu.lock is out of date with requirements/{gpu,common}.txt (run: make gpu-lock):" >&2
  cat "$tmp/diff" >&2; exit 1
fi
echo "gpu.lock resolves: $(pins requirements/gpu.lock | wc -l) pins, $(grep -E '^(vllm|torch)==' requirements/gpu.lock | tr '\n' ' ')"
