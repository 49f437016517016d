"""Several workers of one world size in one launch: each process imports torch and Megatron-Core
once (seconds per process) instead of once per worker.

Usage: torchrun --nproc-per-node N tests/workers/_shared.py OUT_DIR SCRIPT[:ARG,...] ...

Each SCRIPT (a worker of this folder whose main builds its world with `Parallel.build` and
leaves it to the harness's teardown) runs as `main(OUT_DIR/SCRIPT, *ARGS)`, in the order given;
what it returns is that folder's results.json, as a launch of its own would write it, and each
rank that got through it leaves a file finished_rank<R> there. A worker that raises leaves its
traceback in OUT_DIR/SCRIPT/error_rank<R>.txt instead, its world is torn down, and the next one
starts once every rank is done with it (ranks left waiting on the failed one's collectives fail
by their timeout): a worker's failure fails that worker's tests only. Not so when a worker fails
on some ranks before every rank has built its world (an exception ahead of Parallel.build on one
rank): gloo's next world can then dial the dead one's sockets, and the workers after it in the
launch fail too, each with its traceback. The pytest side is `distributed.SharedLaunches`.
"""

import importlib
import os
import sys
import time
import traceback

import psutil

from _harness import RESULTS, launch_store, rank, teardown, wait_for, write


def run_one(out: str, spec: str) -> None:
    script, _, args = spec.partition(":")
    folder = os.path.join(out, script)
    os.makedirs(folder, exist_ok=True)
    start = time.monotonic()
    imported = start
    try:
        main = importlib.import_module(script[:-3]).main  # this folder is sys.path[0]
        imported = time.monotonic()
        results = main(folder, *(args.split(",") if args else ()))
        if results is not None:
            write(folder, RESULTS, results)
        open(os.path.join(folder, f"finished_rank{rank()}"), "w").close()
    except BaseException:  # noqa: BLE001 - recorded for that worker's tests, the others go on
        with open(os.path.join(folder, f"error_rank{rank()}.txt"), "w") as f:
            f.write(traceback.format_exc())
    finally:
        teardown()
        if rank() == 0:  # where a launch's time goes (the suite's budget), in its output
            print(f"[shared] {spec}: {time.monotonic() - start:.1f} s (import "
                  f"{imported - start:.1f} s)", flush=True)


def main() -> None:
    out, specs = sys.argv[1], sys.argv[2:]
    if rank() == 0:  # the interpreter's and torch's start, before any worker's own imports
        print(f"[shared] start-up: {time.time() - psutil.Process().create_time():.1f} s",
              flush=True)
    store = launch_store()
    for index, spec in enumerate(specs):
        run_one(out, spec)
        # every rank is done with this worker (passed or failed) before the next one starts
        wait_for(store, f"flexfloor_tests/shared/done_{index}", int(os.environ["WORLD_SIZE"]))


if __name__ == "__main__":
    main()
