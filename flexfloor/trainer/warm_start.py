"""The supervised warm start: cross-entropy steps on correct responses before RL, cached by
what they depend on (model, data, the warm start's own settings, the world size, the starting
weights) in the run folder's parent, so a second run with the same settings loads them."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
from typing import Callable, Optional, Sequence

from flexfloor.checkpoint import load_checkpoint, read_meta, save_checkpoint
from flexfloor.config import Config, config_to_dict
from flexfloor.data import Example, sft_response
from flexfloor.trainer.actor import Actor, Sample, split_even
from flexfloor.trainer.optim import TrainState, build_train_state


def warm_start_key(cfg: Config) -> str:
    """The cache key: a hash of everything the warm-started weights depend on."""
    d = config_to_dict(cfg)
    key = {k: d[k] for k in ("model", "data")}
    for k in ("val_files", "val_size"):  # the warm start never sees the val prompts
        key["data"].pop(k)
    key["sft"] = {k: d["trainer"][k] for k in ("sft_warmup_steps", "sft_lr", "prompts_per_step",
                                               "micro_batch_size")}
    key["samples"] = d["rollout"]["samples_per_prompt"]
    key["world"] = d["parallel"]["world_size"]
    if cfg.checkpoint.init_from:  # the weights it starts from, by content (the files' sha256)
        key["init_from"] = read_meta(cfg.checkpoint.init_from)["files"]
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def warm_start(cfg: Config, *, model, train_state: TrainState, parallel,
               examples: Sequence[Example], prompt_ids: Sequence[Sequence[int]], tokenizer,
               say: Callable[[str], None], stop: Optional[Callable[[], bool]] = None) -> bool:
    """trainer.sft_warmup_steps supervised steps on `examples` (the training prompts only), or
    their cached result. The RL optimizer and schedule stay untouched (a separate one steps).
    `stop()` (every rank, after each supervised step: flexfloor.preemption) ends it early,
    nothing cached; returns whether it finished."""
    cache = os.path.join(os.path.dirname(os.path.abspath(cfg.logging.run_dir)), "sft_cache",
                         warm_start_key(cfg))
    if os.path.exists(os.path.join(cache, "latest")):
        load_checkpoint(cache, model=model, model_cfg=cfg.model)
        train_state.optimizer.reload_model_params()  # fp32 main params of a bf16 model
        say(f"warm start: loaded the cached supervised model from {cache}")
        return True
    from tqdm import tqdm

    rng = random.Random(cfg.data.synthetic_seed + 17)
    steps = cfg.trainer.sft_warmup_steps
    sft_cfg = dataclasses.replace(cfg.trainer, lr=cfg.trainer.sft_lr, min_lr=0.0,
                                  lr_warmup_steps=min(10, steps // 10))
    sft = Actor(build_train_state(model, sft_cfg, parallel, total_steps=steps,
                                  ddp=train_state.model),
                sft_cfg, parallel, valid_vocab=tokenizer.vocab_size)
    bar = tqdm(range(steps), desc="warm start (supervised)", disable=parallel.rank != 0,
               dynamic_ncols=True, mininterval=2.0)
    per_step = cfg.trainer.prompts_per_step * cfg.rollout.samples_per_prompt
    for done in bar:
        picks = [rng.randrange(len(examples)) for _ in range(per_step)]
        samples = [Sample(prompt_ids[i],
                          tokenizer.encode(sft_response(examples[i])) + [tokenizer.eos_id])
                   for i in picks]
        loss = sft.train_sft(split_even(samples, parallel.world_size)[parallel.rank])
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        if stop is not None and done + 1 < steps and stop():
            bar.close()
            say(f"warm start: stopped after {done + 1} of {steps} supervised steps (nothing "
                "cached: the next run does them again)")
            return False
    # RL keeps its own optimizer and schedule (untouched so far); the cache holds the weights
    train_state.optimizer.reload_model_params()
    save_checkpoint(cache, 0, model=model, model_cfg=cfg.model)
    say(f"warm start: {steps} supervised steps, cached in {cache}")
    return True
