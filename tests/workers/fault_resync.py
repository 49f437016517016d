"""Released ranks wait at resync for as long as the survivors make progress, and no longer.

Usage: torchrun --nproc-per-node 3 tests/workers/fault_resync.py OUT_DIR

Resync's timeout (parallel.timeout_s unless given) is 3 s; the groups keep 60 s, so that ranks
reaching the set-up's collectives seconds apart on a loaded machine are no failure. Rank 0
decodes a long response slowly (0.1 s per step, about 4 s), ranks 1 and 2 finish at once and
are released:
  1. they wait at resync longer than the timeout, and the rollout ends normally;
  2. in a second rollout rank 0 stops (8 s without a step, a hung survivor) after the others
     left: they fail with an error naming the rank, the phase and the step, and exit non-zero.
"""

import time

from flexfloor.config import ModelConfig, ReleasePolicy, RolloutConfig
from flexfloor.model import build_model
from flexfloor.parallel import Parallel
from flexfloor.rollout.elastic import ElasticMembership
from flexfloor.rollout.engine import CollectiveError
from flexfloor.rollout.stack import RolloutStack
from flexfloor.rollout.types import Request, SamplingParams

from _harness import run, write

TIMEOUT_S = 3.0


class SlowSurvivor(ElasticMembership):
    """Rank 0 takes 0.1 s per step (a long response on a slow machine); with `stall_at`, it
    stops for 8 s at that engine step (hung)."""

    stall_at = None

    def step_boundary(self, engine, has_work):
        if engine.rank == 0 and engine.record.steps > 0:
            time.sleep(8.0 if engine.record.steps == self.stall_at else 0.1)
        return super().step_boundary(engine, has_work)


def rollout(stack, step, stall_at=None):
    run = stack.start(ReleasePolicy.ELASTIC, step=step)
    run.membership.__class__ = SlowSurvivor
    run.membership.stall_at = stall_at
    rank = stack.parallel.rank
    n = 40 if rank == 0 else 2
    reqs = [Request(prompt_uid=rank, sample_index=0, prompt_ids=(1, 2, 3), max_new_tokens=n,
                    target_len=n, sampling=SamplingParams(greedy=True), step=step)]
    out = run.generate(reqs)
    t0 = time.perf_counter()
    run.resync(timeout_s=TIMEOUT_S)
    return out, time.perf_counter() - t0


def main(out_dir):
    par = Parallel.build(timeout_s=60)
    rank = par.rank
    model = build_model(ModelConfig(num_experts=6), par)
    stack = RolloutStack.build(par, model, rollout=RolloutConfig(progress=False))
    res = {}
    out, wait = rollout(stack, step=1)
    res["long"] = {"resync_wait_s": wait, "release_step": out.record.release_step,
                   "steps": out.record.steps, "tokens": sum(len(r.token_ids) for r in out.results)}
    t0 = time.perf_counter()
    try:
        rollout(stack, step=2, stall_at=10)
        res["hung"] = {"error": None}
    except CollectiveError as e:
        res["hung"] = {"error": str(e), "after_s": time.perf_counter() - t0}
    write(out_dir, f"rank{rank}.json", res, every_rank=True)
    raise SystemExit(3)  # the second rollout failed: the launcher must see it


if __name__ == "__main__":
    run(main)
