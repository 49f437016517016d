"""The synthetic task: running sums mod 10 over a labelled list of digits, shown step by step.

Format (no spaces; one character is one token of the bundled tokenizer):

    prompt        [a3b5c2d7]
    response      a3b8c0d7=7
    ground_truth  3807

The prompt is a list of n digits, each behind a label (a..z, then A..Z). The response repeats each
label followed by the running sum mod 10 up to that item (3, 3+5=8, 8+2=0, 0+7=7), then "=" and the
final answer. The ground truth is the string of correct running sums, so a reward can check every
step as well as the final answer (its last digit).

Why labels: each step of the response needs the prompt's digit with the same label; a two-layer
transformer finds it by matching the label it just wrote (an induction head), where a bare digit
list would need position arithmetic that depends on n. The previous running sum sits two tokens
back. So the task stays learnable by a tiny model for every n.

Lengths: n is drawn once per prompt from a lognormal (median 4, sigma 1), capped at 48, so the
correct response of a prompt always has 2n + 2 tokens: long-tailed over prompts and the same for a
prompt in every epoch. The longest prompt + response is 2 * 48 + 2 + 2 * 48 + 2 = 196 tokens.
Sampling uses only the standard library's `random` and `statistics`, so a seed gives the same
prompts on every machine and Python version.
"""

from __future__ import annotations

import math
import random
import statistics
import string
from dataclasses import dataclass

SYNTHETIC_DATA_SOURCE = "synthetic/running_sum"
LABELS = string.ascii_lowercase + string.ascii_uppercase
MAX_LIST_LENGTH = 48
MEDIAN_LIST_LENGTH = 4
LIST_LENGTH_SIGMA = 1.0


@dataclass(frozen=True)
class Example:
    """One prompt. `uid` is stable across epochs (it is the parquet's extra_info.index) and keys
    the prompt's length history in the scheduler."""

    uid: int
    prompt: str
    ground_truth: str
    data_source: str


def make_synthetic_prompts(num_prompts: int, seed: int) -> list[Example]:
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    rng = random.Random(seed)
    normal = statistics.NormalDist(mu=math.log(MEDIAN_LIST_LENGTH), sigma=LIST_LENGTH_SIGMA)
    examples = []
    for uid in range(num_prompts):
        # 1 - random() lies in (0, 1], so inv_cdf never sees 0.
        length = round(math.exp(normal.inv_cdf(1.0 - rng.random())))
        length = min(max(length, 1), MAX_LIST_LENGTH)
        digits = [rng.randrange(10) for _ in range(length)]
        prompt = "[" + "".join(f"{LABELS[i]}{d}" for i, d in enumerate(digits)) + "]"
        examples.append(Example(uid=uid, prompt=prompt,
                                ground_truth="".join(str(s) for s in running_sums(digits)),
                                data_source=SYNTHETIC_DATA_SOURCE))
    return examples


def running_sums(digits: list[int]) -> list[int]:
    sums, total = [], 0
    for d in digits:
        total = (total + d) % 10
        sums.append(total)
    return sums


def parse_prompt(prompt: str) -> list[int]:
    """The digits of a synthetic prompt, "[a3b5]" -> [3, 5]."""
    body = prompt[1:-1] if prompt.startswith("[") and prompt.endswith("]") else None
    if not body or len(body) % 2 or len(body) // 2 > len(LABELS) \
            or any(body[2 * i] != LABELS[i] or body[2 * i + 1] not in string.digits
                   for i in range(len(body) // 2)):
        raise ValueError(f"not a {SYNTHETIC_DATA_SOURCE} prompt (expected like '[a3b5c2]'): "
                         f"{prompt!r}")
    return [int(c) for c in body[1::2]]


def format_response(sums: list[int]) -> str:
    return "".join(f"{LABELS[i]}{s}" for i, s in enumerate(sums)) + f"={sums[-1]}"


def sft_response(example: Example) -> str:
    """The correct response, computed from the prompt, for the supervised warm start."""
    return format_response(running_sums(parse_prompt(example.prompt)))
