"""A rank that stops answering mid-rollout: the others must fail within the timeout with an error
that names the rank, the phase and the step, and exit non-zero (no silent hang).

Usage: torchrun --nproc-per-node 3 tests/workers/hang.py OUT_DIR
"""

import os
import time

from flexfloor.config import ModelConfig, RolloutConfig
from flexfloor.model import build_model
from flexfloor.parallel import Parallel
from flexfloor.rollout.engine import RolloutError, StaticMembership
from flexfloor.rollout.stack import RolloutStack
from flexfloor.rollout.types import Request, SamplingParams

from _harness import launch_store, run, wait_for

MODEL = ModelConfig(num_experts=6)


class StallsAtStep3(StaticMembership):
    """Rank 1 stops answering at its third step boundary (a hung peer), for 15 s; when the
    stall ends it leaves the file `stall_ended` in `out`."""

    def __init__(self, rank, out):
        self.rank, self.out, self.calls = rank, out, 0

    def step_boundary(self, engine, has_work):
        self.calls += 1
        if self.rank == 1 and self.calls == 4:
            time.sleep(15)
            open(os.path.join(self.out, "stall_ended"), "w").close()
        return super().step_boundary(engine, has_work)


def main(out):
    # the 4 s timeout is for the rollout: every rank arrives before the world is built with it
    # (under load one rank's imports may take seconds longer than another's), and before the
    # rollout starts (the model's and the stack's set-up)
    store, world = launch_store(), int(os.environ["WORLD_SIZE"])
    wait_for(store, "flexfloor_tests/hang/start", world)
    par = Parallel.build(timeout_s=4)
    rank = par.rank
    model = build_model(MODEL, par)
    engine = RolloutStack.build(par, model, rollout=RolloutConfig(progress=False)).engine
    wait_for(store, "flexfloor_tests/hang/ready", world)
    reqs = [Request(prompt_uid=rank, sample_index=0, prompt_ids=(1, 2, 3), max_new_tokens=30,
                    target_len=30, sampling=SamplingParams(greedy=True))]
    try:
        engine.generate(reqs, StallsAtStep3(rank, out))
        msg = "no error"
    except RolloutError as e:
        msg = str(e)
    # whether the stall had ended when this rank gave up (it must not have: the timeout fired)
    stall_ended = os.path.exists(os.path.join(out, "stall_ended"))
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write(f"{stall_ended}\n{msg}\n")
    raise SystemExit(3)  # non-zero: the launcher sees the failure


if __name__ == "__main__":
    run(main)
