#!/usr/bin/env python
"""Convert Hugging Face safetensors checkpoints <-> FlexFloor (Megatron-Core) checkpoints.

Families: Mixtral, Qwen3-MoE, OLMoE (read from config.json's model_type).

    python tools/convert_checkpoint.py hf-to-flexfloor --hf HF_DIR --out CKPT_ROOT [--ep N]
    python tools/convert_checkpoint.py flexfloor-to-hf --ckpt CKPT_ROOT --out HF_DIR [--ep N]

--ep N runs N gloo workers (the tool starts them with torchrun), each holding 1/N of the experts:
it reads only its own experts, and on the way back writes them as its own safetensors shard.
Under torchrun the EP size defaults to the world size. FlexFloor checkpoints load at any EP size,
so the EP size of a conversion only decides the memory each worker needs.

hf-to-flexfloor also writes CKPT_ROOT/model.yaml, the model section to train the checkpoint
with (`model.*` of a FlexFloor config). A checkpoint not made by this tool (a training run's)
needs its model section back: `flexfloor-to-hf --config run.yaml --family mixtral ...`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("hf-to-flexfloor", help="HF folder -> FlexFloor checkpoint root")
    a.add_argument("--hf", required=True, help="HF model folder (config.json + *.safetensors)")
    a.add_argument("--out", required=True, help="FlexFloor checkpoint root (created)")
    a.add_argument("--step", type=int, default=0, help="step number of the saved checkpoint")
    b = sub.add_parser("flexfloor-to-hf", help="FlexFloor checkpoint -> HF folder")
    b.add_argument("--ckpt", required=True, help="checkpoint root (follows latest) or iter_N")
    b.add_argument("--out", required=True, help="HF model folder (created; must not exist)")
    b.add_argument("--config", help="FlexFloor YAML whose model section the checkpoint holds "
                   "(only for checkpoints this tool did not make)")
    b.add_argument("--family", help="HF model_type to write: mixtral, qwen3_moe, olmoe "
                   "(only for checkpoints this tool did not make)")
    b.add_argument("overrides", nargs="*", help="section.field=value overrides of --config")
    for s in (a, b):
        s.add_argument("--ep", type=int, default=None,
                       help="expert-parallel size (default: 1, or the torchrun world size)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if "RANK" not in os.environ and (args.ep or 1) > 1:
        argv = sys.argv[1:] if argv is None else list(argv)
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.ep}",
               "--master-addr=127.0.0.1", f"--master-port={_free_port()}",
               os.path.abspath(__file__), "--", *argv]
        return subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if "RANK" not in os.environ:  # one process: its own one-rank gloo world
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))

    import yaml

    from flexfloor.checkpoint import CheckpointError
    from flexfloor.config import ConfigError, load_config
    from flexfloor.convert import ConversionError, flexfloor_to_hf, hf_to_flexfloor
    from flexfloor.convert.families import model_config_dict
    from flexfloor.parallel import Parallel

    par = Parallel.build(expert_parallel_size=args.ep, backend="gloo")
    try:
        if args.direction == "hf-to-flexfloor":
            directory, cfg, _ = hf_to_flexfloor(args.hf, args.out, par, step=args.step)
            if par.rank == 0:
                path = os.path.join(args.out, "model.yaml")
                with open(path + ".tmp", "w") as f:
                    yaml.safe_dump({"model": model_config_dict(cfg)}, f, sort_keys=False)
                os.replace(path + ".tmp", path)
                print(f"[convert] {args.hf} -> {directory} (EP={par.ep_size}); model section: {path}")
        else:
            cfg = load_config(args.config, args.overrides).model if args.config else None
            flexfloor_to_hf(args.ckpt, args.out, par, model_cfg=cfg, family=args.family)
            if par.rank == 0:
                print(f"[convert] {args.ckpt} -> {args.out} (EP={par.ep_size}, "
                      f"{par.ep_size} shard{'s' if par.ep_size > 1 else ''})")
    except (ConversionError, CheckpointError, ConfigError) as e:
        if par.rank == 0:
            print(f"[convert] error: {e}", file=sys.stderr)
        return 2
    finally:
        par.destroy()
    return 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
