"""Bad inputs found when a Job starts (or at the step they occur), on 1 gloo worker, one launch.
Each case records the error's type and message, and whether anything was written.

Usage: torchrun --nproc-per-node 1 tests/workers/fault_inputs.py OUT_DIR
"""

import dataclasses
import hashlib
import json
import os
import shutil
import socket

import torch
import torch.distributed as dist

from flexfloor.checkpoint import LOCK_FILE, _shape_of, read_meta
from flexfloor.config import load_config
from flexfloor.coordinator import Job, error_origin
from flexfloor.data import make_synthetic_prompts, register_reward, write_examples
from flexfloor.parallel import Parallel

from _harness import run

BASE = [
    "trainer.steps=2", "trainer.prompts_per_step=2", "trainer.micro_batch_size=4",
    "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8", "rollout.progress=false",
    "data.synthetic_num_prompts=8", "logging.tensorboard=false", "logging.timeline_plot=false",
]


@register_reward("test/nan")
def nan_reward(response: str, ground_truth: str) -> float:
    return float("nan")  # a broken reward function: the loss becomes NaN


def path(out, *parts):
    return os.path.join(out, *parts)


def config(out, case, *overrides):
    return load_config(None, BASE + [f"logging.run_dir={path(out, case, 'run')}"]
                       + list(overrides)
                       ).resolve_world(dist.get_world_size())


def attempt(out, case, *overrides):
    """Build the Job; the error it raises, and what it left on disk."""
    try:
        Job(config(out, case, *overrides)).close()
        err = None
    except Exception as e:  # noqa: BLE001
        err = e
    return {"type": type(err).__name__ if err else None, "message": str(err) if err else None,
            "origin": error_origin(err) if err else None,
            "run_dir_written": os.path.exists(path(out, case, "run"))}


def fake_checkpoint(root, shape, files):
    """A checkpoint root whose manifest (flexfloor.json) says `shape` and lists `files`
    {name: (bytes on disk, bytes in the manifest)}: the checks that run before any tensor is read."""
    d = os.path.join(root, "iter_0000003")
    os.makedirs(d)
    manifest = {}
    for name, (real, said) in files.items():
        data = b"x" * real
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
        manifest[name] = {"bytes": said, "sha256": hashlib.sha256(b"x" * said).hexdigest()}
    with open(os.path.join(d, "flexfloor.json"), "w") as f:
        json.dump({"format_version": 1, "step": 3, "world_size": 1, "model_shape": shape,
                   "has_optimizer": True, "extra_state_keys": [], "files": manifest}, f)
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("iter_0000003\n")


def checkpoints(root):
    """What a checkpoint root holds, but the run's lock (checkpoint.dir/flexfloor.lock)."""
    if not os.path.exists(root):
        return []
    return sorted(n for n in os.listdir(root) if n != LOCK_FILE)


def weights(job):
    return {n: p.detach().clone() for n, p in job.model.named_parameters()}


def nan_step(out, case, policy):
    """One step whose rewards are NaN under trainer.nan_policy=`policy`."""
    data = path(out, case, "nan.parquet")
    os.makedirs(path(out, case))
    write_examples([dataclasses.replace(e, data_source="test/nan")
                    for e in make_synthetic_prompts(8, 0)], data)
    job = Job(config(out, case, f"data.train_files=[{data}]", f"trainer.nan_policy={policy}",
                     f"checkpoint.dir={path(out, case, 'ckpt')}", "checkpoint.save_interval=1"))
    before = weights(job)
    res = {}
    try:
        m = job.step()
        res.update(error=None, loss=m["actor/loss"], step_index=job.step_index)
    except Exception as e:  # noqa: BLE001
        res.update(error=str(e), type=type(e).__name__, origin=error_origin(e))
    after = weights(job)
    res["weights_unchanged"] = all(torch.equal(before[n], after[n]) for n in before)
    ckpt = path(out, case, "ckpt")
    res["checkpoints"] = checkpoints(ckpt)
    if policy == "skip":
        # a save that crashed after renaming iter_2 and before moving `latest` left an orphan:
        # the resumed run's own save of step 2 must replace it (never refuse, never load it)
        shutil.copytree(os.path.join(ckpt, "iter_0000001"), os.path.join(ckpt, "iter_0000002"))
        job.step()
        res["orphan_replaced"] = (read_meta(ckpt)["step"] == 2 and checkpoints(ckpt)
                                  == ["iter_0000001", "iter_0000002", "latest"])
    job.close()
    return res


def save_fails(out, case):
    """A checkpoint write that fails in dist-checkpointing's writer (files capped at 100 kB, as
    a full disk would stop them): torch raises CheckpointException, a BaseException."""
    import resource

    job = Job(config(out, case, f"checkpoint.dir={path(out, case, 'ckpt')}",
                     "checkpoint.save_interval=1"))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))
    try:
        job.step()
        err = None
    except BaseException as e:  # noqa: BLE001 - what leaves the phase, whatever its class
        err = e
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    res = {"type": type(err).__name__ if err else None, "message": str(err) if err else None,
           "origin": error_origin(err) if err else None,
           "checkpoints": sorted(os.listdir(path(out, case, "ckpt")))}  # the lock too: still held
    job.close()
    return res


def main(out):
    Parallel.build()  # the world (the harness tears it down)
    os.makedirs(out, exist_ok=True)
    res = {}
    res["prompt_too_long"] = attempt(out, "prompt_too_long", "data.max_prompt_len=8")

    empty = path(out, "empty.parquet")
    write_examples([], empty)
    res["empty_data"] = attempt(out, "empty_data", f"data.train_files=[{empty}]")

    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist([{"data_source": "x", "prompt": [
        {"role": "user", "content": "hi"}]}]), path(out, "columns.parquet"))
    res["missing_columns"] = attempt(out, "missing_columns",
                                     f"data.train_files=[{path(out, 'columns.parquet')}]")

    res["tokenizer_vocab"] = attempt(out, "tokenizer_vocab", "model.vocab_size=64")

    def prompts_file(name, prompts):
        rows = [{"data_source": "synthetic/running_sum", "prompt": p,
                 "reward_model": {"style": "rule", "ground_truth": "1"},
                 "extra_info": {"index": i, "split": "train"}} for i, p in enumerate(prompts)]
        pq.write_table(pa.Table.from_pylist(rows), path(out, name))
        return path(out, name)

    res["parquet_type"] = attempt(out, "parquet_type",
                                  f"data.train_files=[{prompts_file('type.parquet', [7, 8])}]")
    empty_prompt = prompts_file("empty_prompt.parquet", ["1 2 =", "   "])
    res["parquet_empty_prompt"] = attempt(out, "parquet_empty_prompt",
                                          f"data.train_files=[{empty_prompt}]")

    with open(path(out, "a_file"), "w") as f:
        f.write("not a directory")
    res["ckpt_dir_unwritable"] = attempt(out, "ckpt_dir_unwritable",
                                         f"checkpoint.dir={path(out, 'a_file', 'ckpt')}")
    busy = path(out, "busy_ckpt")
    os.makedirs(busy)
    with open(os.path.join(busy, LOCK_FILE), "w") as f:  # a live job (the launcher) holds it
        json.dump({"host": socket.gethostname(), "pid": os.getppid(),
                   "started": "2026-01-01T00:00:00Z"}, f)
    res["ckpt_dir_in_use"] = attempt(out, "ckpt_dir_in_use", f"checkpoint.dir={busy}")
    res["ckpt_dir_in_use"]["files"] = sorted(os.listdir(busy))

    cfg = config(out, "shape")
    other = dict(_shape_of(cfg.model), num_layers=cfg.model.num_layers + 1)
    fake_checkpoint(path(out, "shape_ckpt"), other, {})
    res["checkpoint_shape"] = attempt(out, "shape", f"checkpoint.dir={path(out, 'shape_ckpt')}")

    fake_checkpoint(path(out, "trunc_ckpt"), _shape_of(cfg.model), {"__0_0.distcp": (500, 1000)})
    res["checkpoint_truncated"] = attempt(out, "truncated",
                                          f"checkpoint.load={path(out, 'trunc_ckpt')}")

    res["save_fails"] = save_fails(out, "save_fails")
    res["nan_stop"] = nan_step(out, "nan_stop", "stop")
    res["nan_skip"] = nan_step(out, "nan_skip", "skip")

    return res


if __name__ == "__main__":
    run(main)
