"""Rewards the test workers train with, registered once per process (a shared launch,
tests/workers/_shared.py, imports several workers into one process; a second registration of
a name is an error)."""

from flexfloor.data import register_reward


@register_reward("test/sevens")
def sevens(response: str, ground_truth: str) -> float:
    """A reward a random model already earns unevenly: the share of '7's in the response."""
    return response.count("7") / max(1, len(response))
