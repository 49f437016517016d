"""Training from a converted HF checkpoint (checkpoint.init_from) on 2 gloo workers, one launch.

Rank 0 saves a tiny random `transformers` Qwen3-MoE model (vocab 128: the bundled tokenizer
fits) and its logits, and writes the synthetic prompts with a reward a random model earns
unevenly; both ranks convert the model with the CLI at EP=2; rank 0 writes the run's YAML as
docs/convert.md says (examples/configs/grpo_tiny.yaml with the model section of
CKPT/model.yaml). Then, each a fresh Job:
  1. init_from: the logits before training equal transformers'; one GRPO step with a KL to the
     reference changes the weights and keeps the reference at the converted weights; saved;
  2. the same config again: checkpoint.dir/latest exists, so the resume wins over init_from;
  3. checkpoint.load of the converted checkpoint: refused, pointing at checkpoint.init_from;
  4. init_from with a config of another shape: refused, naming the field.
Results: OUT_DIR/results.json (every rank's).

Usage: torchrun --nproc-per-node 2 tests/workers/init_from.py OUT_DIR
"""

import dataclasses
import os
import sys
import warnings

import torch
import torch.distributed as dist
import yaml

warnings.filterwarnings("ignore")
REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, REPO)

from flexfloor.config import load_config  # noqa: E402
from flexfloor.convert.hf_reference import tiny_hf_model  # noqa: E402
from flexfloor.coordinator import Job  # noqa: E402
from flexfloor.trainer.warm_start import warm_start_key  # noqa: E402
from flexfloor.data import make_synthetic_prompts, write_examples  # noqa: E402
from flexfloor.model import forward_logits  # noqa: E402
from flexfloor.parallel import Parallel  # noqa: E402
from tools.convert_checkpoint import main as convert_cli  # noqa: E402

import _rewards  # noqa: E402,F401 - registers test/sevens
from _harness import broadcast, gather, run  # noqa: E402


def paths(out):
    """OUT_DIR/{hf, ckpt, run.yaml, sevens.parquet}: the HF model, its conversion, the run's
    YAML and the prompts."""
    return tuple(os.path.join(out, x) for x in ("hf", "ckpt", "run.yaml", "sevens.parquet"))


def small(out):
    """2 workers, one small GRPO step, no warm start, full lr at once."""
    *_, data = paths(out)
    return [
        "parallel.world_size=2", "parallel.expert_parallel_size=2", "trainer.steps=1",
        "trainer.prompts_per_step=4", "trainer.micro_batch_size=4", "trainer.ppo_epochs=1",
        "trainer.sft_warmup_steps=0", "trainer.lr_warmup_steps=0", f"data.train_files=[{data}]",
        "data.val_size=0",  # the YAML's held-out split is for its synthetic task
        "rollout.samples_per_prompt=4", "rollout.max_new_tokens=16", "rollout.progress=false",
        "logging.tensorboard=false", "logging.timeline_plot=false", f"logging.run_dir={out}/run",
    ]


def job(out, *overrides):
    _, _, run_yaml, _ = paths(out)
    return Job(load_config(run_yaml, small(out) + list(overrides)).resolve_world(2))


def attempt(out, *overrides):
    try:
        job(out, *overrides)
        return None
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def weights(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def main(out):
    Parallel.build()  # the world (the harness tears it down)
    rank = dist.get_rank()
    hf_dir, ckpt, run_yaml, data = paths(out)
    tokens = torch.randint(1, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    hf_logits = None
    if rank == 0:
        write_examples([dataclasses.replace(e, data_source="test/sevens")
                        for e in make_synthetic_prompts(16, 0)], data)
        hf = tiny_hf_model("qwen3_moe", seed=5)
        hf.save_pretrained(hf_dir, safe_serialization=True)
        with torch.no_grad():
            hf_logits = hf(tokens).logits
    hf_logits = broadcast(hf_logits)
    assert 0 == convert_cli(["hf-to-flexfloor", "--hf", hf_dir, "--out", ckpt, "--ep", "2"])
    if rank == 0:  # the run's YAML: the example with the model section of ckpt/model.yaml
        with open(os.path.join(REPO, "examples", "configs", "grpo_tiny.yaml")) as f:
            run = yaml.safe_load(f)
        with open(os.path.join(ckpt, "model.yaml")) as f:
            run["model"] = yaml.safe_load(f)["model"]
        with open(run_yaml, "w") as f:
            yaml.safe_dump(run, f, sort_keys=False)
    dist.barrier()
    res = {}

    # 1. weights from the converted checkpoint, fresh optimizer, step 0; one step trains
    init = [f"checkpoint.init_from={ckpt}", f"checkpoint.dir={out}/run_ckpt",
            "trainer.kl_coef=0.05"]
    j = job(out, *init)
    res["start_step"], res["start_cursor"] = j.step_index, j.cursor.state_dict()
    opt = j.train_state.optimizer
    res["optimizer_fresh"] = all(not o.optimizer.state
                                 for o in getattr(opt, "chained_optimizers", [opt]))
    was_training = j.model.training
    j.model.eval()
    with torch.no_grad():
        logits = forward_logits(j.model, tokens)
    j.model.train(was_training)
    res["logits_max_abs_diff"] = float((logits - hf_logits).abs().max())
    res["logits_max_abs"] = float(hf_logits.abs().max())
    w0 = weights(j.model)
    m = j.step()
    res["loss"], res["step"] = m["actor/loss"], j.step_index
    w1 = weights(j.model)
    res["changed"] = not same(w0, w1)
    res["reference_is_init"] = same(w0, weights(j.reference))
    res["warm_start_key_differs"] = (
        warm_start_key(j.cfg) != warm_start_key(load_config(run_yaml, small(out)).resolve_world(2)))
    j.parallel.destroy()

    # 2. checkpoint.dir/latest exists now: the resume wins over init_from
    j = job(out, *init)
    res["resumed_step"], res["resumed_equals_trained"] = j.step_index, same(weights(j.model), w1)
    j.parallel.destroy()

    # 3, 4. refused
    res["load_converted_error"] = attempt(out, f"checkpoint.load={ckpt}")
    res["other_shape_error"] = attempt(out, f"checkpoint.init_from={ckpt}", "model.num_layers=1")

    return gather(res)


if __name__ == "__main__":
    run(main)
