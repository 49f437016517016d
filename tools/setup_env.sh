#!/usr/bin/env bash
# Create/refresh .venv with FlexFloor's dependencies. Sourced by tests/run.sh and the examples.
# torch is installed first and pinned, so no CUDA build is pulled on CPU machines.
set -euo pipefail
FLEXFLOOR_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$FLEXFLOOR_ROOT"
PYTHON_BIN="${PYTHON:-python3}"
TORCH_SPEC="${FLEXFLOOR_TORCH:-torch==2.13.0}"
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PYTHON_BIN --version)"
  "$PYTHON_BIN" -m venv .venv
fi
stamp=.venv/.flexfloor-installed
want="$(cat requirements.txt setup.py | sha256sum | cut -d' ' -f1) $TORCH_SPEC"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[setup] installing $TORCH_SPEC, then requirements.txt (a few minutes on a fresh machine)"
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/python -m pip install -q "$TORCH_SPEC"
  .venv/bin/python -m pip install -q -r requirements.txt pytest
  .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
  echo "$want" > "$stamp"
fi
export PATH="$FLEXFLOOR_ROOT/.venv/bin:$PATH"
# the CPU kernels (megatron_ext/csrc): built once per source, compiler and CPU; a warning if they
# cannot be built (the rollout then runs on torch's kernels)
.venv/bin/python -c "from megatron_ext import cpu_kernels; cpu_kernels.build()" || true
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
