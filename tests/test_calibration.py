"""The simulator's cost model against published decode figures of real serving engines.

Sources (public):
- ML.ENERGY Leaderboard (ml.energy/leaderboard), Qwen3-30B-A3B, bf16, vLLM, one NVIDIA H100:
  decode throughput 611 / 1,394 / 2,164 tokens/s at batch 8 / 32 / 64;
- vLLM on one NVIDIA A100 80GB, Qwen3-30B-A3B bf16, batch 1: 9.6-10.6 ms per output token
  (published vLLM benchmark results for the model).
The model must land within 35% (H100) and 50% (A100) of them. The context each request attends
over is an assumption: about 1,000 tokens (chat prompts plus the tokens produced so far).
"""

import pytest

from flexfloor.sim.cost import RankLoad, RooflineCost
from flexfloor.sim.hardware import ACCELERATORS, ModelShape

QWEN = ModelShape.from_preset("qwen3-30b-a3b")
CONTEXT = 1000


def decode_step_seconds(accelerator: str, batch: int) -> float:
    """One decode step of `batch` requests on one accelerator hosting every expert."""
    cost = RooflineCost(ACCELERATORS[accelerator], QWEN)
    load = RankLoad(0, batch, batch * CONTEXT, QWEN.num_experts, batch * CONTEXT)
    return cost.step_seconds([load], [0] * QWEN.num_experts)


@pytest.mark.parametrize("batch,published", [(8, 611), (32, 1394), (64, 2164)])
def test_h100_decode_throughput_matches_vllm(batch, published):
    tokens_per_s = batch / decode_step_seconds("H100", batch)
    assert tokens_per_s == pytest.approx(published, rel=0.35)


def test_a100_batch_one_latency_matches_vllm():
    ms = 1e3 * decode_step_seconds("A100", 1)
    assert 9.6 * 0.5 <= ms <= 10.6 * 1.5, ms
