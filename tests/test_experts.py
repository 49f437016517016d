"""The rollout's expert GEMMs: grouped over the stacked own experts, per expert for the others.

Pure tensor tests (no process group): `stacked_weights` finds the stack
`flexfloor.model.stack_experts` stores, and `PlacedMoE._project` gives the same rows grouped as
one raw GEMM per expert, with borrowed experts before and after the stacked range and experts
that received no rows. Also the rollout step's raw RoPE against Megatron's.
"""

import pytest
import torch
import torch.nn.functional as F

from flexfloor.model import stack_experts
from megatron_ext import cpu_kernels
from megatron_ext.elastic_moe import ExpertStack, PlacedMoE, _grouped_mm_runs, stacked_weights


class _Expert(torch.nn.Module):
    """An expert's two projections as torch linears (the attributes `_project` reads)."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.linear_fc1 = torch.nn.Linear(hidden, 2 * ffn, bias=False)
        self.linear_fc2 = torch.nn.Linear(ffn, hidden, bias=False)


def _groups(experts_by_id, counts):
    groups, start = [], 0
    for e, n in enumerate(counts):
        if n:
            groups.append((e, experts_by_id[e], start, n))
            start += n
    return groups


@pytest.mark.parametrize("transposed", [True, False], ids=["in-out", "out-in"])
def test_stacked_weights_is_a_view_of_the_parameters_only_when_they_are_stacked(transposed):
    torch.manual_seed(0)
    experts = [_Expert(16, 8) for _ in range(3)]
    loose = [e.linear_fc1.weight for e in experts]
    assert stacked_weights(loose) is None  # three separate storages
    before = [w.detach().clone() for w in loose]
    stack_experts(experts, transposed=transposed)
    for e, want in zip(experts, before):  # the same values, [out, in], stored as asked
        assert torch.equal(e.linear_fc1.weight, want)
        assert e.linear_fc1.weight.stride() == ((1, 16) if transposed else (16, 1))
    w = stacked_weights([e.linear_fc1.weight for e in experts])
    assert w is not None and w.shape == (3, 16, 16)
    for i, e in enumerate(experts):
        assert w[i].data_ptr() == e.linear_fc1.weight.data_ptr()  # a view: no copy
        assert torch.equal(w[i], e.linear_fc1.weight)
    with torch.no_grad():  # the trainer's update is what the rollout reads
        experts[1].linear_fc1.weight.add_(1.0)
    assert torch.equal(w[1], experts[1].linear_fc1.weight)
    # out of order: not one stack in expert order
    assert stacked_weights([experts[1].linear_fc1.weight, experts[0].linear_fc1.weight]) is None


@pytest.mark.skipif(not _grouped_mm_runs(torch.device("cpu"), torch.float32),
                    reason="this torch has no CPU grouped GEMM")
@pytest.mark.parametrize("counts", [
    [3, 0, 5, 2, 0, 4, 1, 6],  # own experts 2..5 with an empty one; borrowed 0, 1, 6, 7 around
    [0, 0, 4, 7, 1, 2, 0, 0],  # only own experts received rows
    [2, 1, 0, 0, 0, 0, 3, 0],  # no own expert received rows
])
@pytest.mark.parametrize("transposed", [True, False], ids=["in-out", "out-in"])
def test_grouped_projection_equals_one_gemm_per_expert(counts, transposed):
    torch.manual_seed(1)
    hidden, ffn = 32, 24
    experts = {e: _Expert(hidden, ffn) for e in range(8)}
    own = [experts[e] for e in range(2, 6)]
    stack_experts(own, transposed=transposed)
    stack = ExpertStack(2, 4, {n: stacked_weights([getattr(m, n).weight for m in own])
                               for n in ("linear_fc1", "linear_fc2")})
    assert all(w is not None for w in stack.weights.values())
    x = torch.randn(sum(counts), hidden)
    groups = _groups(experts, counts)
    with torch.no_grad():
        for name, inp in (("linear_fc1", x), ("linear_fc2", torch.randn(sum(counts), ffn))):
            grouped = PlacedMoE._project(inp, groups, counts, stack, name)
            loop = PlacedMoE._project(inp, groups, counts, None, name)
            assert grouped.shape == loop.shape
            torch.testing.assert_close(grouped, loop, rtol=1e-6, atol=1e-6)
            if cpu_kernels.available():  # one kernel for every float32 expert GEMM: the same bits
                assert torch.equal(grouped, loop)
            # and each row is its own expert's projection
            s = 0
            for e, n in enumerate(counts):
                ref = torch.nn.functional.linear(inp[s:s + n], getattr(experts[e], name).weight)
                torch.testing.assert_close(grouped[s:s + n], ref, rtol=1e-6, atol=1e-6)
                s += n


def test_float64_runs_one_gemm_per_expert():
    """No grouped kernel for float64 on CPU: the probe says so and the loop runs instead."""
    assert not _grouped_mm_runs(torch.device("cpu"), torch.float64)


@pytest.mark.parametrize("rot", [16, 8])  # full head, and a partial rotary dimension
def test_rollout_rope_is_megatrons_bit_for_bit(rot):
    """The rollout step's RoPE (one roll with a signed sine, `rope_terms` once per engine) gives
    Megatron's `_apply_rotary_pos_emb_bshd` exactly, in float32 and float64."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from flexfloor.rollout.engine import _rope, rope_terms

    torch.manual_seed(2)
    for dtype in (torch.float32, torch.float64):
        t = torch.randn(5, 3, 16, dtype=dtype)  # [T, heads, head_dim]
        freqs = torch.randn(5, 1, rot) * 3  # [T, 1, rot], Megatron's [S, 1, 1, rot] less a dim
        cos, sin = rope_terms(freqs, dtype)
        ref = _apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs.unsqueeze(1))[:, 0]
        assert torch.equal(_rope(t, cos, sin), ref)


def test_rollout_rms_norm_is_f_rms_norm_bit_for_bit():
    """The rollout step's RMSNorm as its own CPU ops (`rms_norm`) gives `F.rms_norm` exactly in
    float32 and float64: widths that are and are not powers of two, strided inputs, no weight,
    the default eps; other dtypes go to `F.rms_norm` itself."""
    from flexfloor.rollout.engine import rms_norm

    torch.manual_seed(4)
    for dtype in (torch.float32, torch.float64):
        for width in (64, 100, 256, 3000):
            x = torch.randn(9, 3, width + 4, dtype=dtype)[:, :, 2: width + 2] * 4  # strided
            weight = 1 + 0.3 * torch.randn(width, dtype=dtype)
            for eps in (1e-6, 1e-5, None):
                for w in (weight, None):
                    assert torch.equal(rms_norm(x, width, w, eps),
                                       F.rms_norm(x, (width,), w, eps)), (dtype, width, eps)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    assert torch.equal(rms_norm(x, 64, None, 1e-6), F.rms_norm(x, (64,), None, 1e-6))


@pytest.mark.parametrize("norms", ["per_head", "none", "full_width", "q_only"])
def test_qk_norm_rope_over_heads_and_keys_together_is_bit_for_bit_apart(norms):
    """The rollout step's q/k norms and RoPE over every query head and key of a group at once
    (`qk_norm_rope`) give exactly each norm's own call and one RoPE per tensor, in float32 and
    float64, GQA with 3 query heads per group and a partial rotary dimension."""
    from flexfloor.model import FullWidthRMSNorm
    from flexfloor.rollout.engine import _rope, qk_norm_rope, rope_terms

    torch.manual_seed(3)
    T, G, r, D = 7, 2, 3, 16
    for dtype in (torch.float32, torch.float64):
        for rot in (16, 8):
            mixed = torch.randn(T, G, r + 2, D, dtype=dtype)
            cos, sin = rope_terms(torch.randn(T, 1, rot) * 3, dtype)
            q_norm = k_norm = None
            if norms in ("per_head", "q_only"):
                q_norm = torch.nn.RMSNorm(D, eps=1e-6, dtype=dtype)
            if norms == "per_head":
                k_norm = torch.nn.RMSNorm(D, eps=1e-6, dtype=dtype)
            if norms == "full_width":
                q_norm = FullWidthRMSNorm(None, D, eps=1e-6, heads=G * r).to(dtype)
                k_norm = FullWidthRMSNorm(None, D, eps=1e-6, heads=G).to(dtype)
            with torch.no_grad():
                for m in (q_norm, k_norm):
                    if m is not None:
                        m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape))
                q, k, v = qk_norm_rope(mixed, q_norm, k_norm, cos, sin)
                ref_q = mixed[:, :, :r].reshape(T, G * r, D)
                ref_k = mixed[:, :, r]
                ref_q = ref_q if q_norm is None else q_norm(ref_q)
                ref_k = ref_k if k_norm is None else k_norm(ref_k)
            assert torch.equal(q, _rope(ref_q, cos, sin))
            assert torch.equal(k, _rope(ref_k, cos, sin))
            assert torch.equal(v, mixed[:, :, r + 1])
