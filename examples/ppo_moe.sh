#!/usr/bin/env bash
# PPO (actor + critic, GAE, KL to the reference) with elastic EP on the tiny MoE, 4 CPU workers.
#   bash examples/ppo_moe.sh                  # full run
#   STEPS=3 bash examples/ppo_moe.sh          # shorter
CONFIG="${CONFIG:-examples/configs/ppo_tiny.yaml}" exec bash "$(dirname "$0")/train_moe.sh" "$@"
