"""Expert weights stored [in, out]: `build_model` keeps each expert parameter [out, in] as a
transposed view of its layer's [experts, in, out] stack (`flexfloor.model.stack_experts`).

In one process (one gloo rank, the default tiny model), against the same model with every
expert weight made contiguous ([out, in] row-major, each its own storage: the layout before):
a training step has the same loss and the same gradients up to the last bits (a GEMM reads
W in the other order, forward `x @ W^T` and backward `grad @ W`, and the CPU's sgemm may then
sum in another order: bit-equal on some CPUs, one ulp apart on others, e.g. an AMD EPYC), and
a rollout gives the same tokens, greedy and sampled, with log-probs equal to fp32 rounding.
"""

import pytest
import torch
import torch.nn.functional as F

from flexfloor.rollout.types import Request, SamplingParams


@pytest.fixture(scope="module")
def parts():
    from distributed import one_rank_world
    from flexfloor.config import ModelConfig, RolloutConfig
    from flexfloor.model import build_model
    from flexfloor.rollout.stack import RolloutStack

    with one_rank_world() as par:
        model = build_model(ModelConfig(), par)
        stack = RolloutStack.build(par, model, rollout=RolloutConfig(progress=False))
        yield model, stack.moe
        stack.close()


def _expert_params(model):
    return [p for n, p in model.named_parameters() if ".local_experts." in n]


class _Contiguous:
    """Inside: every expert weight row-major in its own storage (the layout before), the
    rollout's expert stacks forgotten; the stacked storage comes back on exit."""

    def __init__(self, model, moe):
        self.params, self.moe = _expert_params(model), moe

    def __enter__(self):
        self.saved = [p.data for p in self.params]
        for p in self.params:
            p.data = p.data.clone(memory_format=torch.contiguous_format)
        self.moe.forget_stacks()

    def __exit__(self, *exc):
        for p, data in zip(self.params, self.saved):
            p.data = data
        self.moe.forget_stacks()


def test_expert_parameters_are_transposed_views_of_one_stack_per_layer(parts):
    from megatron_ext.elastic_moe import stacked_weights

    model, moe = parts
    for layer in model.decoder.layers:
        experts = layer.mlp.experts.local_experts
        for name in ("linear_fc1", "linear_fc2"):
            weights = [getattr(e, name).weight for e in experts]
            out, inp = weights[0].shape
            assert all(w.stride() == (1, out) for w in weights)
            stack = stacked_weights(weights)  # [experts, out, in]
            assert stack is not None and stack.transpose(1, 2).is_contiguous()
            assert all(stack[i].data_ptr() == w.data_ptr() for i, w in enumerate(weights))
    assert moe.grouped_layers(torch.float32) == len(model.decoder.layers)


def _train_step(model, tokens):
    from flexfloor.model import forward_logits

    model.train()
    model.zero_grad(set_to_none=True)
    logits = forward_logits(model, tokens)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                           tokens[:, 1:].reshape(-1))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model.eval()
    return loss.detach(), grads


def test_a_training_step_matches_the_contiguous_layout(parts):
    model, moe = parts
    tokens = torch.randint(0, model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    loss, grads = _train_step(model, tokens)
    with _Contiguous(model, moe):
        want_loss, want_grads = _train_step(model, tokens)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    assert grads.keys() == want_grads.keys()
    for name, g in grads.items():
        assert g.shape == want_grads[name].shape
        torch.testing.assert_close(g, want_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def _requests(vocab):
    g = torch.Generator().manual_seed(5)
    kinds = [SamplingParams(greedy=True), SamplingParams(temperature=0.9, top_k=20)]
    return [Request(prompt_uid=i, sample_index=0, max_new_tokens=12, sampling=kinds[i % 2],
                    seed=1, step=0, prompt_ids=tuple(torch.randint(
                        1, vocab, (3 + i,), generator=g).tolist())) for i in range(6)]


def test_a_rollout_matches_the_contiguous_layout(parts):
    from flexfloor.rollout.engine import RolloutEngine, StaticMembership

    model, moe = parts
    model.eval()

    def decode():
        out = RolloutEngine(model, moe, rank=0).generate(_requests(model.vocab_size),
                                                          StaticMembership())
        return {r.request_id: (r.token_ids, r.logprobs) for r in out.results}

    got = decode()
    with _Contiguous(model, moe):
        assert moe.grouped_layers(torch.float32) == 0  # one GEMM per expert, [out, in]
        want = decode()
    assert got.keys() == want.keys()
    for rid, (tokens, logprobs) in got.items():
        assert tokens == want[rid][0]
        torch.testing.assert_close(logprobs, want[rid][1], rtol=0, atol=1e-5)
