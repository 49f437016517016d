"""The MoE combine sums a token's expert outputs in ascending expert order, whatever the top-k.

`PlacedMoE.route` leaves the router's choice in top-k order when k <= 2 (two terms add alike in
either order) and sorts it when k > 2, where the order of the sum changes its last bits: the
combine then adds a token's k outputs in ascending expert order, the order every placement
gives. One in-process gloo rank, the default tiny model with top-2 and with top-4 routing.
"""

import pytest
import torch


@pytest.mark.parametrize("topk", [2, 4])
def test_combine_adds_each_tokens_experts_in_ascending_order(topk):
    from distributed import one_rank_world
    from flexfloor.config import ModelConfig, RolloutConfig
    from flexfloor.model import build_model
    from flexfloor.rollout.stack import RolloutStack

    with one_rank_world() as par:
        model = build_model(ModelConfig(moe_router_topk=topk), par)
        model.eval()
        stack = RolloutStack.build(par, model, rollout=RolloutConfig(progress=False))
        moe = stack.moe
        torch.manual_seed(0)
        x = torch.randn(64, model.config.hidden_size)
        with torch.inference_mode():
            for layer in range(len(moe.layers)):
                routed = moe.route(layer, x)
                stack_ = moe._whole_stack(layer, x)
                handle = moe.dispatch(routed, host_counts=stack_ is None)
                rows = moe.compute(layer, handle, stack_)
                out = moe.combine(layer, handle, rows)
                # row of pair i (token i // k, its i % k-th choice) in the expert outputs
                pair_row = torch.empty_like(handle.order)
                pair_row[handle.order] = torch.arange(handle.order.numel())
                experts = routed.experts.view(-1, topk)
                for t in range(x.shape[0]):
                    chosen = sorted(range(topk), key=lambda j: int(experts[t, j]))
                    want = rows[pair_row[t * topk + chosen[0]]].clone()
                    for j in chosen[1:]:
                        want = want + rows[pair_row[t * topk + j]]
                    assert torch.equal(out[t], want), (layer, t)
        stack.close()
