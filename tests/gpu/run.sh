#!/usr/bin/env bash
# The GPU check: one NVIDIA GPU, one process, an NCCL world of 1. Prints one JSON summary on
# stdout (tests/gpu/check.py says what it holds); exit 0 when every section passed.
#
# NCCL cannot put two ranks on one GPU: every rank needs a device of its own, so the multi-rank
# release protocol is tested on CPU with gloo (bash tests/run.sh) and this script checks the
# CUDA/NCCL code paths at world size 1.
#
# Needs: a python3 with torch (CUDA) and transformers. megatron-core, when that python lacks it,
# comes from wheels in .whl/ (megatron_core-0.16.1-*.whl; downloaded beside the repository with
# pip download --no-deps), installed into a temporary folder, never into the system.
# Runs in under 8 minutes (the check stops itself at 470 s).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import megatron.core" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/flexfloor-site .whl/*.whl >&2
    export PYTHONPATH=/tmp/flexfloor-site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo '{"ok": false, "error": "megatron-core is not installed and no wheel is in .whl/"}'
    exit 1
  fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1
export MASTER_PORT=${MASTER_PORT:-$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
export PYTHONWARNINGS=ignore TOKENIZERS_PARALLELISM=false
exec timeout 470 "$PY" tests/gpu/check.py
