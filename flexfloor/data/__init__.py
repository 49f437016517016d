"""Prompts (verl-format parquet or the synthetic task) and their rewards."""

from __future__ import annotations

from dataclasses import dataclass

from flexfloor.config import DataConfig, DataSource
from flexfloor.data.parquet import read_examples, write_examples
from flexfloor.data.reward import (Scorer, compute_score, register_reward, registered_rewards,
                                   reward_for)
from flexfloor.data import synthetic, tasks  # tasks registers the \boxed{} math rewards
from flexfloor.data.synthetic import SYNTHETIC_DATA_SOURCE, Example, make_synthetic_prompts

__all__ = [
    "SYNTHETIC_DATA_SOURCE",
    "Example",
    "PromptSets",
    "Scorer",
    "compute_score",
    "held_out",
    "load_data",
    "load_prompts",
    "make_synthetic_prompts",
    "read_examples",
    "register_reward",
    "registered_rewards",
    "reward_for",
    "sft_response",
    "write_examples",
]


def sft_response(example: Example) -> str:
    """The correct response to a prompt, for the supervised warm start: a reasoning-gym
    prompt's answer, the synthetic task's worked running sums (other data cannot warm start)."""
    answer = tasks.warm_start_response(example)
    return answer if answer is not None else synthetic.sft_response(example)


def load_prompts(train_files: list[str], synthetic_num_prompts: int,
                 synthetic_seed: int) -> list[Example]:
    """The prompts of `train_files` in order, or the synthetic task when there are none.

    Fails here, before any rollout, when two files share a uid (that every data_source has a
    reward is `Scorer.check`'s, at set-up).
    """
    if not train_files:
        return make_synthetic_prompts(synthetic_num_prompts, synthetic_seed)
    examples, file_of_uid = [], {}
    for path in train_files:
        for example in read_examples(path):
            if example.uid in file_of_uid:
                raise ValueError(f"extra_info.index {example.uid} appears in both "
                                 f"{file_of_uid[example.uid]} and {path}; uids must be unique "
                                 "across train_files: renumber one file's extra_info.index")
            file_of_uid[example.uid] = path
            examples.append(example)
    return examples


@dataclass(frozen=True)
class PromptSets:
    """The training prompts and the validation prompts (no val prompt's text is a training
    prompt's, so none is ever trained on); `note` says what was dropped to make it so."""

    train: list[Example]
    val: list[Example]
    note: str | None = None


def load_data(cfg: DataConfig) -> PromptSets:
    """The prompts of the configured source, and the val prompts (data.val_files or a held-out
    split of a generated source, data.val_size)."""
    source = cfg.source
    if source == DataSource.AUTO:
        source = DataSource.PARQUET if cfg.train_files else DataSource.SYNTHETIC
    if source == DataSource.PARQUET:
        train = load_prompts(cfg.train_files, 0, 0)
        if cfg.val_size:
            raise ValueError(f"data.val_size={cfg.val_size}: a held-out split is generated, so "
                             "only for generated sources (synthetic, reasoning_gym); for parquet "
                             "data set data.val_size=0 and give data.val_files")
        return _with_val_files(train, cfg.val_files)
    if source == DataSource.SYNTHETIC:
        generate = lambda n: make_synthetic_prompts(n, cfg.synthetic_seed)  # noqa: E731
        size = cfg.synthetic_num_prompts
    else:
        from flexfloor.data.tasks import reasoning_gym_prompts

        generate = lambda n: reasoning_gym_prompts(cfg.task, n, cfg.synthetic_seed)  # noqa: E731
        size = cfg.size
    if not cfg.val_size:
        return _with_val_files(generate(size), cfg.val_files)
    # a generator's first `size` prompts do not depend on how many follow: the training prompts
    # are the same with or without a held-out split
    pool = generate(size + 4 * cfg.val_size + 64)
    train = pool[:size]
    val = held_out(train, pool[size:], cfg.val_size)
    if len(val) < cfg.val_size:
        raise ValueError(f"data.val_size={cfg.val_size}: the generator gave only {len(val)} "
                         "prompts that are not training prompts; lower data.val_size")
    return PromptSets(train, val)


def held_out(train: list[Example], candidates: list[Example], n: int) -> list[Example]:
    """The first `n` candidates whose prompt text is neither a training prompt's nor an earlier
    pick's."""
    seen, out = {e.prompt for e in train}, []
    for e in candidates:
        if len(out) == n:
            break
        if e.prompt not in seen:
            seen.add(e.prompt)
            out.append(e)
    return out


def _with_val_files(train: list[Example], val_files: list[str]) -> PromptSets:
    if not val_files:
        return PromptSets(train, [])
    val = load_prompts(val_files, 0, 0)
    kept = held_out(train, val, len(val))
    note = None
    if len(kept) < len(val):
        note = (f"data.val_files: {len(val) - len(kept)} of {len(val)} val prompts repeat a "
                "training prompt (or another val prompt) and are not validated on")
    if not kept:
        raise ValueError(f"data.val_files {val_files}: every val prompt is also a training "
                         "prompt; give held-out prompts")
    return PromptSets(train, kept, note)
