"""A training checkpoint resumes at another worker count (1 -> 2 and 2 -> 1), and Parallel is
built again after Parallel.destroy() in one process. 2 torchrun workers, one launch:

  A  rank 0 alone (a world of 1 over a local store): step 1 of a 2-step run saves A/iter_1.
  B  both ranks (world 2, torchrun's store): load A/iter_1, save it again as B/iter_1 (load
     exact if the two are equal entry by entry), train step 2, save B/iter_2.
  B2 both ranks again, after B's Parallel.destroy(): Parallel.build at EP=2 and an all-reduce,
     twice (build after destroy).
  C  rank 0 alone (world 1 again): load B/iter_2, save it again as C/iter_2.
Rank 0 compares the checkpoints (model and optimizer, every entry) and writes
OUT_DIR/results.json.

Usage: torchrun --nproc-per-node 2 tests/workers/reshard.py OUT_DIR
"""

import os
import time

import torch
import torch.distributed as dist

from _harness import run

BASE = [
    "trainer.prompts_per_step=2", "trainer.micro_batch_size=2", "rollout.samples_per_prompt=2",
    "rollout.max_new_tokens=8", "rollout.progress=false", "data.synthetic_num_prompts=8",
    "logging.tensorboard=false", "logging.timeline_plot=false", "parallel.timeout_s=120",
    "checkpoint.resume=off", "trainer.entropy_coef=0.01",  # a gradient whatever the rewards
]


def config(world, *overrides):
    from flexfloor.config import load_config

    return load_config(None, BASE + list(overrides)).resolve_world(world)


def alone(fn):
    """Run fn on rank 0 in a world of 1 (its own store), as a 1-worker job would."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return fn()
    finally:
        dist.destroy_process_group()


def compare(a, b) -> dict:
    """Entries of two dist-checkpoints that differ (needs a world of 1)."""
    from megatron.core.dist_checkpointing import load_plain_tensors

    from fault_compare import flat, same  # this folder's checkpoint comparison

    x, y = flat(load_plain_tensors(a)), flat(load_plain_tensors(b))
    differ = sorted(set(x) ^ set(y)) + [k for k in x if k in y and not same(x[k], y[k])]
    tensors = [k for k, v in x.items() if isinstance(v, torch.Tensor)]
    return {"optimizer_tensors": sum(k.startswith("optimizer") for k in tensors),
            "model_tensors": sum(not k.startswith("optimizer") for k in tensors),
            "differ": differ}


def main(out):
    from flexfloor.coordinator import Job
    from flexfloor.parallel import Parallel

    rank = int(os.environ["RANK"])
    d = {k: os.path.join(out, k) for k in "ABC"}
    res = {}

    def run_a():
        job = Job(config(1, "trainer.steps=2", f"checkpoint.dir={d['A']}",
                         f"logging.run_dir={out}/run_a"))
        job.step()  # step 1 of 2 (a 1-step run's schedule would end at lr 0)
        job.save()
        job.close()

    if rank == 0:
        alone(run_a)
    # B: 1 -> 2 workers (rank 1 waits here for rank 0 at the rendezvous)
    job = Job(config(2, "trainer.steps=2", f"checkpoint.load={d['A']}", f"checkpoint.dir={d['B']}",
                     f"logging.run_dir={out}/run_b"))
    res["b_loaded_step"] = job.step_index
    job.save()  # B/iter_1: what was loaded, saved again at 2 workers
    job.run()  # step 2 at 2 workers; saves B/iter_2
    res["b_ep_size"] = job.parallel.ep_size
    job.close()
    # B2: build again after B's destroy, EP = 2, same process (twice: any number of times)
    for _ in range(2):
        t0 = time.monotonic()
        par = Parallel.build(expert_parallel_size=2, timeout_s=60)
        probe = torch.ones(1)
        dist.all_reduce(probe, group=par.ep_group)
        res["b2"] = {"ep_size": par.ep_size, "all_reduce": probe.item(),
                     "build_s": round(time.monotonic() - t0, 2)}
        par.destroy()
    if rank != 0:
        return

    def run_c():
        job = Job(config(1, "trainer.steps=2", f"checkpoint.load={d['B']}",
                         f"checkpoint.dir={d['C']}", f"logging.run_dir={out}/run_c"))
        res["c_loaded_step"] = job.step_index
        job.save()  # C/iter_2: B/iter_2 loaded at 1 worker, saved again
        job.close()
        res["one_to_two"] = compare(f"{d['A']}/iter_0000001", f"{d['B']}/iter_0000001")
        res["two_to_one"] = compare(f"{d['B']}/iter_0000002", f"{d['C']}/iter_0000002")
        res["trained"] = compare(f"{d['B']}/iter_0000001", f"{d['B']}/iter_0000002")

    alone(run_c)
    return res


if __name__ == "__main__":
    run(main)
