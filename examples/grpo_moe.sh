#!/usr/bin/env bash
# The main job: GRPO with elastic EP on the tiny MoE (synthetic running-sum task), 4 CPU workers.
#   bash examples/grpo_moe.sh                 # full run
#   STEPS=3 bash examples/grpo_moe.sh         # shorter
#   NPROC=2 bash examples/grpo_moe.sh trainer.lr=3e-4 elastic.release_policy=static
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/tools/setup_env.sh"
cd "$FLEXFLOOR_ROOT"
NPROC="${NPROC:-4}"
CONFIG="${CONFIG:-examples/configs/grpo_tiny.yaml}"
RUN_DIR="${RUN_DIR:-runs/grpo_moe_$(date +%Y%m%d_%H%M%S)}"
extra=()
[ -n "${STEPS:-}" ] && extra+=("trainer.steps=$STEPS")
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
python -m torch.distributed.run --nproc-per-node "$NPROC" --master-addr 127.0.0.1 \
  --master-port "${MASTER_PORT:-$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}" \
  -m flexfloor.train --config "$CONFIG" "parallel.world_size=$NPROC" "parallel.expert_parallel_size=$NPROC" \
  "logging.run_dir=$RUN_DIR" "${extra[@]}" "$@"
