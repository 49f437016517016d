#!/usr/bin/env bash
# The main job: GRPO with elastic EP on the tiny MoE (synthetic running-sum task), 4 CPU workers.
#   bash examples/grpo_moe.sh                 # full run
#   STEPS=3 bash examples/grpo_moe.sh         # fewer RL steps (the supervised warm start first,
#                                             # minutes on 2 cores, is cached for the next run)
#   NPROC=2 bash examples/grpo_moe.sh trainer.lr=3e-3 elastic.release_policy=static
# The rollout runs on 2 engine replicas (rollout.replicas: 2 in the config): NPROC must be even,
# or add rollout.replicas=1 (one world-wide EP group; the same tokens and rewards).
CONFIG="${CONFIG:-examples/configs/grpo_tiny.yaml}" exec bash "$(dirname "$0")/train_moe.sh" "$@"
