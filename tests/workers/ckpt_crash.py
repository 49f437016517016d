"""A save killed half-way must leave the previous checkpoint the one that loads.

Usage: torchrun --nproc-per-node 2 tests/workers/ckpt_crash.py ROOT crash|resume
  crash:  save step 1, then die (os._exit) on rank 0 in the middle of saving step 2, after the
          shards of step 2 are written and before the save completes.
  resume: load ROOT (must be step 1), then save step 2 for real; write what was seen.
"""

import os

import torch

from flexfloor.checkpoint import load_checkpoint, save_checkpoint
from flexfloor.config import ModelConfig
from flexfloor.model import build_model, forward_logits
from flexfloor.parallel import Parallel

from _harness import run, write

MODEL = ModelConfig()


class DieWhilePickled:
    """Pickling this (rank 0 writes the extra state after the shards) kills the process."""

    def __reduce__(self):
        os._exit(17)


def main(root, mode):
    par = Parallel.build(timeout_s=30)
    model = build_model(MODEL, par)
    probe = torch.arange(10).view(1, 10)
    if mode == "crash":
        save_checkpoint(root, 1, model=model, model_cfg=MODEL, extra_state={"marker": 1})
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)  # step 2's weights differ from step 1's
        extra = {"marker": 2, "die": DieWhilePickled() if par.rank == 0 else None}
        save_checkpoint(root, 2, model=model, model_cfg=MODEL, extra_state=extra)
        raise SystemExit("unreachable: the save should have died")
    fresh = forward_logits(model, probe)  # the same seed as the crash run: step 1's weights
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.25)  # a load that leaves a weight as it finds it shows in the logits
    moved = not torch.equal(fresh, forward_logits(model, probe))
    step, extra = load_checkpoint(root, model=model, model_cfg=MODEL)
    loaded = forward_logits(model, probe)
    saved = save_checkpoint(root, 2, model=model, model_cfg=MODEL, extra_state={"marker": 2})
    write(root, "seen.json", {"step": step, "marker": extra["marker"],
                              "moved_before_load": moved,
                              "same_as_init": bool(torch.equal(fresh, loaded)),
                              "saved": os.path.basename(saved), "dirs": sorted(os.listdir(root))})


if __name__ == "__main__":
    run(main)
