"""Entry point: `torchrun --nproc-per-node N -m flexfloor.train --config FILE [a.b=value ...]`."""

from __future__ import annotations

import argparse
import os
import sys
import warnings


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flexfloor.train",
        description="GRPO/PPO post-training of a MoE model with elastic expert parallelism. "
        "Launch with torchrun (one process per worker).",
    )
    parser.add_argument("--config", help="YAML config (see examples/configs/)")
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", module="megatron")

    from flexfloor.config import ConfigError, load_config

    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = load_config(args.config, args.overrides).resolve_world(world)
    except (ConfigError, FileNotFoundError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    from flexfloor.coordinator import Job

    job = Job(cfg)
    try:
        job.run()
    finally:
        job.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
