"""Prompts (verl-format parquet or the synthetic task) and their rewards."""

from __future__ import annotations

from flexfloor.data.parquet import read_examples, write_examples
from flexfloor.data.reward import compute_score, register_reward, registered_rewards, reward_for
from flexfloor.data.synthetic import (
    SYNTHETIC_DATA_SOURCE,
    Example,
    make_synthetic_prompts,
    sft_response,
)

__all__ = [
    "SYNTHETIC_DATA_SOURCE",
    "Example",
    "compute_score",
    "load_prompts",
    "make_synthetic_prompts",
    "read_examples",
    "register_reward",
    "registered_rewards",
    "reward_for",
    "sft_response",
    "write_examples",
]


def load_prompts(train_files: list[str], synthetic_num_prompts: int,
                 synthetic_seed: int) -> list[Example]:
    """The prompts of `train_files` in order, or the synthetic task when there are none.

    Fails here, before any rollout, when two files share a uid or a data_source has no reward.
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
    for data_source in sorted({e.data_source for e in examples}):
        reward_for(data_source)
    return examples
