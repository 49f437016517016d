"""Rule-based rewards, one function per data_source.

Add your own with the decorator; the function takes (response, ground_truth) and returns a float:

    @register_reward("openai/gsm8k")
    def gsm8k_score(response: str, ground_truth: str) -> float: ...

The module that defines it must be imported before the job starts (`Scorer.check` runs at set-up,
before any rollout, for every data_source of the data). Or, as in verl, one function for every
data_source in a file of your own: `reward.custom_fn: path/to/file.py:compute_score`, called as
compute_score(data_source, solution_str, ground_truth, extra_info) (`Scorer`).
"""

from __future__ import annotations

import string
import importlib.util
import inspect
import os
from typing import Callable, Iterable

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


CustomFn = Callable[[str, str, str, dict], float]


def custom_fn_file_missing(spec: str) -> str | None:
    """What is wrong with reward.custom_fn `spec`'s file, with the fix, or None when it is
    there."""
    path = spec.rpartition(":")[0]
    if os.path.isfile(path):
        return None
    return (f"{spec}: file {path} not found; give the path of a .py file, e.g. "
            "reward.custom_fn=my_reward.py:compute_score")


def load_custom_fn(spec: str) -> CustomFn:
    """The function of reward.custom_fn, "path/to/file.py:function" (verl's interface)."""
    path, _, name = spec.rpartition(":")
    missing = custom_fn_file_missing(spec)
    if missing:
        raise FileNotFoundError(f"reward.custom_fn={missing}")
    module_spec = importlib.util.spec_from_file_location(
        f"flexfloor_custom_reward_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        e.add_note(f"[flexfloor] while loading reward.custom_fn={spec}")
        raise
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(n for n, v in vars(module).items()
                       if inspect.isfunction(v) and v.__module__ == module.__name__)
        raise AttributeError(f"reward.custom_fn={spec}: {path} has no function {name!r} "
                             f"(functions there: {found}); fix the name after ':'")
    return fn


class Scorer:
    """How a response is scored: reward.custom_fn when set, else the reward registered for the
    prompt's data_source."""

    def __init__(self, custom_fn: str | None = None):
        self.custom = load_custom_fn(custom_fn) if custom_fn else None

    def check(self, data_sources: Iterable[str]) -> None:
        """Fail before any rollout when a data_source has no reward."""
        if self.custom is None:
            for data_source in sorted(set(data_sources)):
                reward_for(data_source)

    def __call__(self, example, response: str) -> float:
        if self.custom is not None:
            return float(self.custom(example.data_source, response, example.ground_truth,
                                     {"index": example.uid}))
        return compute_score(example.data_source, response, example.ground_truth)


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
