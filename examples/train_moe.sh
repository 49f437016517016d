#!/usr/bin/env bash
# Launch FlexFloor training on one machine (torchrun, NPROC workers); used by grpo_moe.sh and
# ppo_moe.sh. Environment: CONFIG, NPROC (4), STEPS, RUN_DIR, MASTER_PORT (unset: torchrun picks
# a free one), MAX_RESTARTS (0: a lost worker ends the job; N: torchrun restarts it up to N times
# and it resumes from checkpoint.dir, see docs/reliability.md); extra arguments are
# section.field=value overrides.
# Exit codes: 0 done, 2 a bad config (checked once, before any worker starts), 75 preempted
# (SIGTERM/SIGINT: the step in progress was saved; run the same command again), 1 a failure.
set -euo pipefail
positive() {  # NAME VALUE: a whole number >= 1, else one line naming NAME and exit 2
  [[ "$2" =~ ^[1-9][0-9]*$ ]] || { echo "train_moe.sh: $1=$2: must be a whole number >= 1" \
    "(e.g. $1=4)" >&2; exit 2; }
}
NPROC="${NPROC:-4}"
positive NPROC "$NPROC"
[ -z "${STEPS:-}" ] || positive STEPS "$STEPS"
[[ "${MAX_RESTARTS:-0}" =~ ^[0-9]+$ ]] || { echo "train_moe.sh: MAX_RESTARTS=$MAX_RESTARTS: must be" \
  "a whole number >= 0 (0: a failed worker ends the run)" >&2; exit 2; }
if [ -n "${MASTER_PORT:-}" ] &&
   ! { [[ "$MASTER_PORT" =~ ^[1-9][0-9]*$ ]] && ((MASTER_PORT <= 65535)); }; then
  echo "train_moe.sh: MASTER_PORT=$MASTER_PORT: must be a TCP port, 1-65535 (or leave it unset:" \
    "torchrun then picks a free one)" >&2
  exit 2
fi
source "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/tools/setup_env.sh"
cd "$FLEXFLOOR_ROOT"
CONFIG="${CONFIG:?set CONFIG to a YAML file}"
RUN_DIR="${RUN_DIR:-runs/$(basename "$CONFIG" .yaml)_$(date +%Y%m%d_%H%M%S)}"
args=(--config "$CONFIG" "parallel.world_size=$NPROC" "parallel.expert_parallel_size=$NPROC"
      "logging.run_dir=$RUN_DIR")
[ -n "${STEPS:-}" ] && args+=("trainer.steps=$STEPS")
args+=("$@")
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# MASTER_PORT unset: torchrun binds a free port itself (--standalone), so no other job can take
# the port between its choice and its use
if [ -n "${MASTER_PORT:-}" ]; then
  rendezvous=(--master-addr 127.0.0.1 --master-port "$MASTER_PORT")
else
  rendezvous=(--standalone)
fi
# torchrun through flexfloor.launch.local: the config checked once before any worker starts (an
# error is one line, exit code 2), the exit code the workers' (75 when a stop signal had them
# save their step), no torchrun traceback for a stop signal
exec python -m flexfloor.launch.local --nproc-per-node "$NPROC" --max-restarts "${MAX_RESTARTS:-0}" \
  "${rendezvous[@]}" -m flexfloor.train "${args[@]}"
