"""FlexFloor: synchronous RL post-training of MoE LLMs with elastic expert parallelism."""

__version__ = "0.1.0"
