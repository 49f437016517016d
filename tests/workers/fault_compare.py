"""Compare two Megatron dist-checkpoints tensor by tensor (model and optimizer state).

Usage: python tests/workers/fault_compare.py CKPT_A CKPT_B
Prints the number of entries and those that differ; exits 1 if any differs.
"""

import sys

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing import load_plain_tensors


def flat(d, prefix=""):
    out = {}
    items = enumerate(d) if isinstance(d, (list, tuple)) else d.items()
    for k, v in items:
        if isinstance(v, (dict, list, tuple)):
            out.update(flat(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def same(x, y):
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)
    return x == y


def main():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    a, b = (flat(load_plain_tensors(p)) for p in sys.argv[1:3])
    tensors = sum(isinstance(v, torch.Tensor) for v in a.values())
    bad = sorted(set(a) ^ set(b)) + [k for k in a if k in b and not same(a[k], b[k])]
    print(f"{len(a)} entries ({tensors} tensors), differ: {bad}")
    sys.exit(1 if bad or tensors < 10 else 0)


if __name__ == "__main__":
    main()
