"""Real tasks offline: reasoning-gym's procedural generators with their own scorers, and a
math-verify scorer for \\boxed{} answers (GSM8K, MATH).

data.source=reasoning_gym generates data.size prompts of data.task (plus data.val_size held out)
from the installed `reasoning-gym` package with the seed data.synthetic_seed: nothing is
downloaded. Each prompt's data_source is "reasoning_gym/<task>", its ground truth the task's
answer, and its reward the task's own `score_answer` (registered on first use). The prompt is the
task's question as is, the response is scored as the answer (what the warm start teaches).
"""

from __future__ import annotations

import re

from flexfloor.data.reward import register_reward, registered_rewards
from flexfloor.data.synthetic import Example

REASONING_GYM_PREFIX = "reasoning_gym/"
MATH_DATA_SOURCES = ("openai/gsm8k", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval",
                     "HuggingFaceH4/MATH-500", "math")


def _reasoning_gym():
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError("data.source=reasoning_gym needs the reasoning-gym package (in "
                          "requirements.txt): pip install reasoning-gym==0.1.25") from e
    return reasoning_gym


def reasoning_gym_tasks() -> list[str]:
    """The task names reasoning-gym can generate."""
    return sorted(_reasoning_gym().factory.DATASETS)


def reasoning_gym_prompts(task: str, n: int, seed: int) -> list[Example]:
    """`n` prompts of reasoning-gym's `task` (uids 0..n-1); the first k do not depend on n."""
    rg = _reasoning_gym()
    try:
        dataset = rg.create_dataset(task, size=n, seed=seed)
    except Exception as e:  # an unknown task name is a ValueError naming the known ones
        raise ValueError(f"data.task={task!r}: reasoning-gym cannot generate it ({e}); e.g. "
                         "data.task=basic_arithmetic, chain_sum or simple_equations") from None
    data_source = REASONING_GYM_PREFIX + task
    if data_source not in registered_rewards():
        score = rg.get_score_answer_fn(task)

        @register_reward(data_source)
        def reasoning_gym_score(response: str, ground_truth: str) -> float:
            return float(score(response.strip(), {"answer": ground_truth, "metadata": {}}))

    return [Example(uid=i, prompt=entry["question"], ground_truth=str(entry["answer"]),
                    data_source=data_source) for i, entry in enumerate(dataset)]


def warm_start_response(example: Example) -> str | None:
    """The answer of a reasoning-gym prompt (what the supervised warm start teaches), or None
    for another data_source."""
    return example.ground_truth if example.data_source.startswith(REASONING_GYM_PREFIX) else None


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} of `text` (braces balanced), or None."""
    start = None
    for m in re.finditer(r"\\boxed\s*\{", text):
        start = m.end()
    if start is None:
        return None
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


def boxed_math_score(response: str, ground_truth: str) -> float:
    """1.0 when the response's last \\boxed{} answer equals the ground truth mathematically
    (math-verify: 0.5 == 1/2, 72 == 72.0), else 0.0; a response with no \\boxed{} earns 0."""
    from math_verify import parse, verify

    answer = last_boxed(response)
    if answer is None:
        return 0.0
    gold = ground_truth if "\\boxed" in ground_truth else f"\\boxed{{{ground_truth}}}"
    return float(verify(parse(gold), parse(f"\\boxed{{{answer}}}")))


for _source in MATH_DATA_SOURCES:
    register_reward(_source)(boxed_math_score)
