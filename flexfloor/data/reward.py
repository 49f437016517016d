"""Rule-based rewards, one function per data_source.

Add your own with the decorator; the function takes (response, ground_truth) and returns a float:

    @register_reward("openai/gsm8k")
    def gsm8k_score(response: str, ground_truth: str) -> float: ...

The module that defines it must be imported before prompts are loaded (`load_prompts` checks that
every data_source of the data set has a reward).
"""

from __future__ import annotations

import string
from typing import Callable

from flexfloor.data.synthetic import LABELS, SYNTHETIC_DATA_SOURCE

RewardFn = Callable[[str, str], float]

_REWARDS: dict[str, RewardFn] = {}


def register_reward(data_source: str) -> Callable[[RewardFn], RewardFn]:
    def register(fn: RewardFn) -> RewardFn:
        if data_source in _REWARDS:
            raise ValueError(f"a reward for data_source {data_source!r} is already registered "
                             f"({_REWARDS[data_source].__qualname__}); pick another name")
        _REWARDS[data_source] = fn
        return fn
    return register


def registered_rewards() -> list[str]:
    return sorted(_REWARDS)


def reward_for(data_source: str) -> RewardFn:
    if data_source not in _REWARDS:
        raise KeyError(f"no reward registered for data_source {data_source!r}; registered: "
                       f"{registered_rewards()}. Add one with @register_reward({data_source!r})")
    return _REWARDS[data_source]


def compute_score(data_source: str, response: str, ground_truth: str) -> float:
    return float(reward_for(data_source)(response, ground_truth))


@register_reward(SYNTHETIC_DATA_SOURCE)
def running_sum_score(response: str, ground_truth: str) -> float:
    """1.0 when the final answer is right and all n steps are shown (labels a.. in order);
    otherwise 0.5 * (steps with the right label and running sum) / max(n, steps written), so a
    response that pads extra steps earns less, and garbage earns 0."""
    if not ground_truth or len(ground_truth) > len(LABELS) \
            or any(c not in string.digits for c in ground_truth):
        raise ValueError(f"{SYNTHETIC_DATA_SOURCE} ground_truth must be 1..{len(LABELS)} running "
                         f"sums as digits, like '3807', got {ground_truth!r}")
    expected = [int(c) for c in ground_truth]
    steps, final = _parse_running_sum(response)
    labels_in_order = all(label == LABELS[i] for i, (label, _) in enumerate(steps))
    if final == expected[-1] and len(steps) == len(expected) and labels_in_order:
        return 1.0
    correct = sum(1 for i, (label, value) in enumerate(steps[:len(expected)])
                  if label == LABELS[i] and value == expected[i])
    return 0.5 * correct / max(len(expected), len(steps))


def _parse_running_sum(response: str) -> tuple[list[tuple[str, int]], int | None]:
    """Steps (label, digit) up to the first malformed character, and the final answer: the digit
    after "=" when "=d" is all that follows the steps (surrounding whitespace aside)."""
    text = response.strip()
    steps, i = [], 0
    while i + 1 < len(text) and text[i] in LABELS and text[i + 1] in string.digits:
        steps.append((text[i], int(text[i + 1])))
        i += 2
    rest = text[i:]
    final = int(rest[1]) if len(rest) == 2 and rest[0] == "=" and rest[1] in string.digits else None
    return steps, final
