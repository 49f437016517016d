"""Capture-ready decode steps (rollout.static_decode), proven on CPU with a sync/shape audit.

The audit (`flexfloor.rollout.capture.StepAudit`) records every aten op of a layer stack with
its shapes and flags host reads and data-dependent shapes. With static_decode a decode-only step
is padded to a bucket: its layer stack must have no flagged op, two steps of one bucket must run
the same op sequence with the same shapes (what a captured graph replays), and the tokens must
be those of the eager steps. In this process at EP=1 (one gloo rank, the default tiny model);
at EP=2 in one 2-worker launch (tests/workers/capture.py, shared with the session's other
2-worker modules): the fixed-capacity MoE dispatch, a rank stepping with no requests of its
own, a shrink and a migration.
"""

import collections

import pytest
import torch

from distributed import Worker, mixed_requests
from flexfloor.rollout.capture import StepAudit
from flexfloor.rollout.engine import decode_bucket
from flexfloor.rollout.kv import BlockPool

WORKER = Worker("capture.py", 2, timeout=300)


# --------------------------------------------------------------------------------------------
# the audit and the pieces, without Megatron


def test_the_audit_flags_host_reads_and_data_dependent_shapes_only():
    x = torch.tensor([1, 2, 3])
    flagged = {
        "item": lambda: x[0].item(), "int": lambda: int(x.sum()), "tolist": lambda: x.tolist(),
        "bincount": lambda: torch.bincount(x), "nonzero": lambda: x.nonzero(),
        "mask": lambda: x[x > 1], "unique": lambda: x.unique(),
        "masked_select": lambda: x.masked_select(x > 1),
        "repeat_interleave": lambda: x.repeat_interleave(x),
    }
    clean = {
        "scatter_add": lambda: torch.zeros(4, dtype=torch.long).scatter_add_(0, x, x),
        "argsort": lambda: torch.argsort(x, stable=True),
        "repeat_interleave_sized": lambda: x.repeat_interleave(x, output_size=6),
        "searchsorted": lambda: torch.searchsorted(x, torch.arange(5), right=True),
        "index_select": lambda: x.index_select(0, x - 1),
    }
    for name, fn in {**flagged, **clean}.items():
        with StepAudit() as audit:
            fn()
        assert bool(audit.flagged) == (name in flagged), (name, audit.flagged)
        assert audit.ops or name == "tolist"
    assert "tolist" not in torch.Tensor.__dict__  # the patch is gone with the audit
    # the signature holds every shape: another size is another sequence
    sigs = []
    for n in (3, 3, 4):
        with StepAudit() as audit:
            torch.arange(n) * 2
        sigs.append(audit.signature())
    assert sigs[0] == sigs[1] != sigs[2]


def test_buckets_are_powers_of_two_up_to_the_batch_size():
    assert [decode_bucket(n, 64) for n in (1, 2, 3, 5, 8, 9, 33, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert [decode_bucket(n, 12) for n in (5, 9, 12)] == [8, 12, 12]


def test_the_scratch_block_is_outside_the_budget_and_the_lanes():
    p = BlockPool(num_layers=2, groups=2, head_dim=8, dtype=torch.float32, device="cpu",
                  block_tokens=4, capacity=6, lane_blocks=3, scratch=True)
    assert p.scratch_slot == 0 and p.k.shape[1] == 4  # the scratch block alone
    lane = p.open_lane()
    blocks = p.allocate(3, lane=lane)
    p.k[:, p.slots(blocks, 0, 12)] = 1.0
    p.reserve(6)
    assert p.stored_blocks == 6 and p.scratch_slot == 24 and p.k.shape[1] == 7 * 4
    assert bool((p.k[:, p.slots(blocks, 0, 12)] == 1.0).all())  # kept across the growth
    assert p.free_blocks == 3 and p.capacity == 6  # counted nowhere
    p.k[:, p.scratch_slot:] = 5.0  # padding rows' K/V: in no lane view
    keys, _ = p.lane_view(0, 2, 3)
    assert not bool((keys == 5.0).any())
    plain = BlockPool(num_layers=1, groups=1, head_dim=4, dtype=torch.float32, device="cpu",
                      block_tokens=4, capacity=None)
    assert plain.k.shape[1] == 0


# --------------------------------------------------------------------------------------------
# the engine in this process: EP=1


@pytest.fixture(scope="module")
def one_rank():
    from distributed import one_rank_world
    from flexfloor.config import ModelConfig, RolloutConfig
    from flexfloor.model import build_model
    from flexfloor.rollout.stack import RolloutStack

    with one_rank_world() as par:
        models = {}
        for dtype in ("float32", "float64"):
            model = build_model(ModelConfig(), par, params_dtype=dtype)
            model.eval()
            stack = RolloutStack.build(par, model, rollout=RolloutConfig(progress=False))
            models[dtype] = (model, stack)
        yield models
        for _, stack in models.values():
            stack.close()


def _decode(one_rank, dtype, *, static, **engine_kw):
    from flexfloor.rollout.capture import audit_steps
    from flexfloor.rollout.engine import RolloutEngine, StaticMembership

    model, stack = one_rank[dtype]
    engine_kw = {"max_batch_size": 8, **engine_kw}
    if "kv_budget_blocks" in engine_kw:
        engine_kw["kv_budget_bytes"] = (engine_kw.pop("kv_budget_blocks") * 4
                                        * stack.engine.kv_bytes_per_token)
    engine = RolloutEngine(model, stack.moe, rank=0, block_tokens=4, static_decode=static,
                           **engine_kw)
    with audit_steps(engine) as steps:
        out = engine.generate(mixed_requests(model.vocab_size), StaticMembership())
    return {r.request_id: (r.token_ids, r.logprobs) for r in out.results}, steps, out.record


ENGINES = {"lanes": {}, "gathered": {"kv_lanes": False},
           # 14 blocks of 4 tokens for up to 8 running requests: preemption, requests outside
           # lanes, re-prefills between decode steps
           "preempting": {"kv_budget_blocks": 14}}


@pytest.mark.parametrize("kind", list(ENGINES))
def test_ep1_padded_decode_stack_has_no_flagged_op_and_one_op_sequence_per_bucket(one_rank, kind):
    _, steps, record = _decode(one_rank, "float32", static=True, **ENGINES[kind])
    padded = [s for s in steps if s.bucket is not None]
    assert len(padded) >= 10
    for s in padded:
        assert not s.flagged, (s.bucket, s.flagged[:3])
    by_bucket = collections.defaultdict(list)
    for s in padded:
        by_bucket[s.bucket].append(s)
    for bucket, same in by_bucket.items():
        assert len({s.signature for s in same}) == 1, bucket
    # some bucket really ran steps of other requests, positions and tokens
    assert any(len({(tuple(s.positions), tuple(s.tokens)) for s in same}) > 1
               for same in by_bucket.values())
    assert any(b[0] > 1 and b[0] != sum(p > 0 for p in s.positions)  # padding rows there
               for b, same in by_bucket.items() for s in same)
    if kind == "preempting":
        assert record.preempted > 0
    if kind == "gathered":
        assert all(b[1] is None for b in by_bucket)
    if kind == "lanes":
        assert any(b[1] is not None for b in by_bucket)


def test_ep1_eager_steps_are_flagged_where_they_read_on_the_host(one_rank):
    # the audit can fail: float64 has no CPU grouped GEMM, so the experts' counts are read on
    # the host, eager or padded (the documented fallback); eager decode steps differ in shape
    _, eager, _ = _decode(one_rank, "float64", static=False)
    assert all(s.flagged for s in eager)
    _, padded, _ = _decode(one_rank, "float64", static=True)
    assert any("tolist" in f.op for s in padded if s.bucket for f in s.flagged)
    # float32 eager steps read nothing on the host at EP=1, but their shapes follow the batch
    # and its contexts: steps of one batch size run other shapes as the contexts grow
    _, eager32, _ = _decode(one_rank, "float32", static=False)
    by_size = collections.defaultdict(set)
    for s in eager32:
        by_size[len(s.positions)].add(s.signature)
    assert any(len(sigs) > 1 for sigs in by_size.values())


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("float64", 1e-12)])
@pytest.mark.parametrize("kind", list(ENGINES))
def test_ep1_tokens_identical_with_static_decode_on_and_off(one_rank, dtype, tol, kind):
    want, _, _ = _decode(one_rank, dtype, static=False, **ENGINES[kind])
    got, steps, _ = _decode(one_rank, dtype, static=True, **ENGINES[kind])
    assert any(s.bucket for s in steps)
    assert {k: t for k, (t, _) in got.items()} == {k: t for k, (t, _) in want.items()}
    # CPU GEMMs split rows by the batch's row count: the padded rows may move a log-prob's
    # last bits, never a token here
    for rid, (_, logprobs) in got.items():
        assert max(abs(a - b) for a, b in zip(logprobs, want[rid][1], strict=True)) <= tol, rid


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_ep1_padded_moe_layer_gives_each_real_row_the_eager_output_bit_for_bit(one_rank, dtype):
    _, stack = one_rank[dtype]
    moe = stack.moe
    g = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        for li in range(len(moe.layers)):
            x = torch.randn(5, 1, moe.hidden, generator=g).to(moe._dtype)
            pad = 100 * torch.randn(3, 1, moe.hidden, generator=g).to(moe._dtype)
            eager = moe.forward(li, x)
            padded = moe.forward(li, torch.cat([x, pad]), torch.arange(8) < 5)
            assert torch.equal(padded[:5], eager) and bool((padded[5:] == 0).all()), li


def test_the_experts_touched_count_ignores_padding_rows(one_rank):
    _, _, eager = _decode(one_rank, "float32", static=False)
    _, _, padded = _decode(one_rank, "float32", static=True)
    assert padded.as_dict()["trace"] == eager.as_dict()["trace"]


# --------------------------------------------------------------------------------------------
# EP=2: two gloo workers


@pytest.fixture(scope="module")
def ep2(shared):
    return shared.run(WORKER).results


def _tokens(parts, key="tokens"):
    return {rid: t for p in parts for rid, t in p[key].items()}


@pytest.mark.parametrize("case", ["float32", "float64", "elastic", "migrate"])
def test_ep2_tokens_identical_with_static_decode_on_and_off(ep2, case):
    off, on = ep2[f"{case}_static0"], ep2[f"{case}_static1"]
    assert len(_tokens(off)) == 9
    assert _tokens(on) == _tokens(off)
    lp_on, lp_off = _tokens(on, "logprobs"), _tokens(off, "logprobs")
    tol = 1e-12 if case == "float64" else 1e-5
    assert max(abs(a - b) for r in lp_on for a, b in zip(lp_on[r], lp_off[r], strict=True)) <= tol
    assert any(s["bucket"] for p in on for s in p["steps"])
    if case in ("elastic", "migrate"):  # rank 1 was released (after handing over, or done)
        assert all(p["record"]["shrinks"] == 1 for p in on)
        assert on[1]["record"]["steps"] < on[0]["record"]["steps"]
    if case == "migrate":
        assert on[1]["record"]["migrated_out"] == 2 and on[0]["record"]["adopted"] == 2


@pytest.mark.parametrize("case", ["float32", "elastic", "migrate"])
def test_ep2_padded_steps_have_no_flagged_op_and_one_op_sequence_per_bucket(ep2, case):
    # elastic, migrate: after the shrink rank 0 decodes alone with borrowed experts, run
    # grouped from their own stacks (built at the shrink): still nothing read on the host
    for rank, part in enumerate(ep2[f"{case}_static1"]):
        padded = [s for s in part["steps"] if s["bucket"] and s["bucket"] != ["empty", None]]
        assert len(padded) >= part["record"]["steps"] - 3  # all but prefills
        by_bucket = collections.defaultdict(list)
        for s in padded:
            assert not s["flagged"], (rank, s["bucket"], s["flagged"])
            by_bucket[str((s["bucket"], s["ranks"]))].append(s)  # a graph is one layout's
        for bucket, same in by_bucket.items():
            assert len({s["signature"] for s in same}) == 1, (rank, bucket)
        if rank == 0:
            assert any(len({str(s["positions"]) for s in same}) > 1
                       for same in by_bucket.values())
        if case != "float32" and rank == 0:  # padded steps before and after the shrink
            assert {tuple(s["ranks"]) for s in padded} == {(0, 1), (0,)}
    if case == "float32":  # rank 1 ran out of requests first: it entered the group's padded
        empty = [s for s in ep2["float32_static1"][1]["steps"]  # steps with none
                 if s["bucket"] and s["bucket"][0] == "empty"]
        assert empty and all(s["bucket"][1] for s in empty)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_ep2_fixed_capacity_dispatch_gives_each_real_row_the_eager_output_bit_for_bit(ep2, dtype):
    for part in ep2[f"{dtype}_layers"]:
        assert part["group"] == [0, 1] and all(part["same"]) and all(part["zero"])


@pytest.mark.parametrize("case", ["elastic", "migrate"])
def test_shrunk_survivor_runs_borrowed_stacks_bit_for_bit(ep2, case):
    rank0, rank1 = ep2[f"{case}_static1"]
    layers = rank0["survivor_layers"]
    assert layers["group"] == [0] and rank1["survivor_layers"] is None  # rank 1 was released
    assert layers["borrowed_layers"] == len(layers["same"])  # every layer borrowed experts
    assert all(layers["same"]) and all(layers["zero"])


def test_ep2_eager_decode_steps_read_split_sizes_on_the_host(ep2):
    # the audit can fail: today's eager EP>1 dispatch reads each layer's split sizes
    for part in ep2["float32_static0"]:
        decode = [s for s in part["steps"] if s["bucket"] is None and s["positions"]
                  and min(s["positions"]) > 0]
        assert decode and all(any("split sizes" in f for f in s["flagged"]) for s in decode)
        assert all(any("tolist" in f for f in s["flagged"]) for s in decode)
