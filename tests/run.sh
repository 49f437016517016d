#!/usr/bin/env bash
# The whole suite on a fresh machine: set-up (.venv, torch pinned first, requirements), then pytest.
# Extra arguments go to pytest (e.g. `bash tests/run.sh -k config`).
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/tools/setup_env.sh"
cd "$FLEXFLOOR_ROOT/tests"
start=$(date +%s)
python -m pytest -q -p no:cacheprovider "$@"
echo "[tests] suite took $(( $(date +%s) - start )) s"
