"""Foundation cases on 4 gloo workers, one launch: model forward/backward, logits identical at
EP=1/2/4, checkpoint saved at EP=4 loaded at EP=2, corrupted/mismatched checkpoints refused,
a crash in the middle of a save leaves the previous checkpoint the one that loads.

Usage: torchrun --nproc-per-node 4 tests/workers/foundation.py OUT_DIR
"""

import dataclasses
import os
import shutil

import torch
import torch.distributed as dist
import torch.nn.functional as F

from flexfloor.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from flexfloor.config import ModelConfig, TrainerConfig
from flexfloor.model import build_model, forward_logits
from flexfloor.parallel import Parallel
from flexfloor.trainer.optim import build_train_state

from _harness import rank, run

MODEL = ModelConfig()  # the tiny preset: 2 layers, 8 experts, top-2
TRAINER = dataclasses.replace(TrainerConfig(), lr=1e-2, clip_grad=1.0)


def rank_tokens(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(0, MODEL.vocab_size, (2, 12), generator=g)


def stacked(t: torch.Tensor) -> torch.Tensor:
    """Every rank's tensor, stacked in rank order."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.stack(parts)


def save0(out: str, name: str, obj) -> None:
    if rank() == 0:
        torch.save(obj, os.path.join(out, name))


def lm_loss(model, tokens):
    logits = forward_logits(model, tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def train_step(state, tokens):
    state.zero_grad()
    lm_loss(state.model, tokens).backward()
    return state.step()


def expect_error(fn) -> str:
    try:
        fn()
    except CheckpointError as e:
        return str(e)
    return ""


def main(out):
    results = {}
    tokens = rank_tokens(rank())

    # 1. the same weights at EP = 1, 2, 4: logits and a backward pass
    for ep in (1, 2, 4):
        par = Parallel.build(expert_parallel_size=ep)
        model = build_model(MODEL, par)
        logits = forward_logits(model, tokens)
        loss = lm_loss(model, tokens)
        loss.backward()
        grads_ok = all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        save0(out, f"logits_ep{ep}.pt", stacked(logits.detach()))
        # float64: batch-shape-dependent BLAS summation order cannot hide in the last bit
        model64 = build_model(MODEL, par, params_dtype="float64")
        save0(out, f"logits64_ep{ep}.pt", stacked(forward_logits(model64, tokens).detach()))
        del model64
        results[f"ep{ep}"] = {"loss": loss.item(), "grads_finite": bool(grads_ok),
                              "local_experts": model.decoder.layers[0].mlp.num_local_experts}
        del model
    # Megatron-Core's jit_fuser on CPU: its no-op decorator (megatron_ext.cpu_compat), so the
    # one decorated function the model calls is the plain function, not a torch.compile wrapper
    from megatron.core import jit
    from megatron.core.transformer.moe.router import TopKRouter
    results["jit_fuser"] = jit.jit_fuser.__name__
    results["expert_bias_compiled"] = hasattr(TopKRouter._apply_expert_bias, "__wrapped__")

    # 2. train one step at EP=4, save; load at EP=2: same logits; one more step on each layout
    ckpt = os.path.join(out, "ckpt")
    par = Parallel.build(expert_parallel_size=4)
    model = build_model(MODEL, par)
    state = build_train_state(model, TRAINER, par, total_steps=10)
    results["step1_applied"] = train_step(state, tokens)[0]
    save_checkpoint(ckpt, 1, model=model, model_cfg=MODEL, optimizer=state.optimizer,
                    extra_state={"data_position": 7, "scheduler": state.state_dict()})
    save0(out, "ckpt_ep4.pt", stacked(forward_logits(model, tokens).detach()))
    train_step(state, tokens)
    save0(out, "step2_ep4.pt", stacked(forward_logits(model, tokens).detach()))
    del model, state

    par = Parallel.build(expert_parallel_size=2)
    model = build_model(MODEL, par)
    state = build_train_state(model, TRAINER, par, total_steps=10)
    step, extra = load_checkpoint(ckpt, model=model, model_cfg=MODEL, optimizer=state.optimizer)
    state.load_state_dict(extra["scheduler"])
    results["loaded_step"] = step
    results["loaded_data_position"] = extra["data_position"]
    save0(out, "ckpt_ep2.pt", stacked(forward_logits(model, tokens).detach()))
    train_step(state, tokens)
    save0(out, "step2_ep2.pt", stacked(forward_logits(model, tokens).detach()))

    # 3. refused: another model shape, a truncated shard, an unfinished save
    other = dataclasses.replace(MODEL, num_layers=3)
    results["shape_error"] = expect_error(
        lambda: load_checkpoint(ckpt, model=model, model_cfg=other))
    bad = os.path.join(out, "ckpt_bad")
    if rank() == 0:
        shutil.copytree(ckpt, bad)
        shard = sorted(f for f in os.listdir(os.path.join(bad, "iter_0000001")) if f.endswith(".distcp"))[0]
        path = os.path.join(bad, "iter_0000001", shard)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    dist.barrier()
    results["truncated_error"] = expect_error(
        lambda: load_checkpoint(bad, model=model, model_cfg=MODEL))
    results["tmp_error"] = expect_error(
        lambda: load_checkpoint(os.path.join(ckpt, "iter_0000001") + ".tmp", model=model, model_cfg=MODEL))
    return results


if __name__ == "__main__":
    run(main)
