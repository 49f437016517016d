#!/usr/bin/env bash
# Launch FlexFloor training on one machine (torchrun, NPROC workers); used by grpo_moe.sh and
# ppo_moe.sh. Environment: CONFIG, NPROC (4), STEPS, RUN_DIR, MASTER_PORT, MAX_RESTARTS (0: a
# lost worker ends the job; N: torchrun restarts it up to N times and it resumes from
# checkpoint.dir, see docs/reliability.md); extra arguments are section.field=value overrides.
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/tools/setup_env.sh"
cd "$FLEXFLOOR_ROOT"
NPROC="${NPROC:-4}"
CONFIG="${CONFIG:?set CONFIG to a YAML file}"
RUN_DIR="${RUN_DIR:-runs/$(basename "$CONFIG" .yaml)_$(date +%Y%m%d_%H%M%S)}"
extra=()
[ -n "${STEPS:-}" ] && extra+=("trainer.steps=$STEPS")
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
python -m torch.distributed.run --nproc-per-node "$NPROC" --max-restarts "${MAX_RESTARTS:-0}" --master-addr 127.0.0.1 \
  --master-port "${MASTER_PORT:-$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}" \
  -m flexfloor.train --config "$CONFIG" "parallel.world_size=$NPROC" "parallel.expert_parallel_size=$NPROC" \
  "logging.run_dir=$RUN_DIR" "${extra[@]}" "$@"
