"""What every test worker does around its cases, written once.

A worker is `tests/workers/<name>.py OUT_DIR [ARGS...]`, launched on N local gloo workers by
`distributed.launch()` (tests/distributed.py), which reads back what rank 0 wrote:

    from _harness import gather, run, write

    def main(out, *args):          # OUT_DIR and the remaining arguments
        par = Parallel.build(...)
        res = {...}                # this rank's cases
        return gather(res)         # rank 0 writes it as OUT_DIR/results.json

    if __name__ == "__main__":
        run(main)

`run` tears down whatever process group is still up when `main` returns or raises, so a failed
case leaves no group behind and exits non-zero with its traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Callable

import torch.distributed as dist

RESULTS = "results.json"


def rank() -> int:
    """This worker's rank in the launch (before or after any process group exists)."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def gather(obj, group=None) -> list:
    """Every rank's `obj` (picklable), in rank order, on every rank of `group`."""
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, obj, group=group)
    return parts


def broadcast(obj, src: int = 0):
    """Rank `src`'s `obj` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def write(out: str, name: str, obj, every_rank: bool = False) -> str:
    """Write `obj` as JSON to out/name on rank 0 (or on `every_rank`); returns the path."""
    path = os.path.join(out, name)
    if every_rank or rank() == 0:
        os.makedirs(out, exist_ok=True)
        with open(path, "w") as f:
            json.dump(obj, f, indent=1)
    return path


@contextlib.contextmanager
def timed(label: str):
    """Rank 0 prints how long the block took, `[time] LABEL: S s`: where a launch's seconds go
    (the suite's budget), in its output."""
    start = time.perf_counter()
    try:
        yield
    finally:
        if rank() == 0:
            print(f"[time] {label}: {time.perf_counter() - start:.1f} s", flush=True)


def launch_store() -> dist.TCPStore:
    """The launcher's own store (torchrun's agent store), reachable before any world is built."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False)


def wait_for(store: dist.TCPStore, key: str, world_size: int) -> None:
    """A barrier over the store: count this rank in `key`, return once every rank is."""
    store.add(key, 1)
    while store.add(key, 0) < world_size:
        time.sleep(0.05)


def out_dir() -> str:
    """OUT_DIR, the worker's first argument (for paths a worker names at module level)."""
    if len(sys.argv) < 2:
        raise SystemExit(f"usage: {os.path.basename(sys.argv[0])} OUT_DIR [ARGS...]")
    return sys.argv[1]


def run(main: Callable[..., object]) -> None:
    """`main(OUT_DIR, *ARGS)`; what it returns (unless None) is OUT_DIR/results.json on rank 0.
    Process groups still up afterwards are destroyed, also when `main` raises."""
    out, args = out_dir(), sys.argv[2:]
    try:
        results = main(out, *args)
        if results is not None:
            write(out, RESULTS, results)
    finally:
        teardown()


def teardown() -> None:
    """Destroy Megatron's model-parallel groups and torch.distributed's world, if up."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None:  # Parallel.build() ran: its model-parallel groups
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def rollout_outcome(stack, policy, reqs, **start) -> dict:
    """One rollout of this rank's requests under `policy` on a `RolloutStack` (`start`: more of
    `RolloutStack.start`'s arguments), then resync: its tokens and log-probs by request id, its
    record and the membership's release timeline."""
    run = stack.start(policy, **start)
    out = run.generate(reqs)
    run.resync(timeout_s=60)
    return {"tokens": {r.request_id: r.token_ids for r in out.results},
            "logprobs": {r.request_id: r.logprobs for r in out.results},
            "record": out.record.as_dict(), "timeline": getattr(run.membership, "timeline", [])}
