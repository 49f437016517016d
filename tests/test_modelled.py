"""Modelled seconds of traced engine steps (flexfloor.sim.cost.price_trace) and the typed rank
record, without processes. The real engine's traces are priced in tests/test_bench.py and
tests/test_sim.py (their benchmark launches)."""

import pytest

from flexfloor.rollout.metrics import MODELLED_FIGURES, rollout_metrics
from flexfloor.rollout.types import RankRecord, ShrinkTrace, StepTrace
from flexfloor.sim.cost import CostParams, UnitCost, cost_model, price_trace

RANKS = (0, 1, 2, 3)
OWNER = (0, 0, 1, 1, 2, 2, 3, 3)  # the tiny model's 8 experts, two a rank


def traces(steps: list[dict[int, list[tuple[int, int]]]], shrinks=()) -> dict[int, StepTrace]:
    """rank -> its trace of `steps` (per step: rank -> (stored, new) of each running request)
    in one group of RANKS; `shrinks`: (rank, ShrinkTrace)."""
    out = {}
    for r in RANKS:
        t = StepTrace(num_experts=len(OWNER), num_layers=2, expert_bytes=1000)
        for step in steps:
            t.enter_group(RANKS, OWNER)
            t.add_step(step.get(r, []), experts_touched=2)
        out[r] = t
    for r, sh in shrinks:
        out[r].shrinks.append(sh)
    return out


def decoding(n: int, context: int) -> list[tuple[int, int]]:
    return [(context, 1)] * n


H800 = cost_model("H800", "qwen3-30b-a3b")


def test_a_step_costs_more_with_a_larger_batch_and_more_kv():
    small = price_trace(traces([{0: decoding(4, 1000)}]), H800)
    big = price_trace(traces([{0: decoding(384, 1000)}]), H800)
    long_ctx = price_trace(traces([{0: decoding(4, 30000)}]), H800)
    assert big.rollout_s > small.rollout_s
    assert long_ctx.rollout_s > small.rollout_s
    # lockstep: every rank of the group is occupied for the slowest rank's step
    assert set(big.occupied_s.values()) == {big.rollout_s}
    # a prefill of 384 tokens reads weights once but computes more than one decode token
    prefill = price_trace(traces([{0: [(0, 384)]}]), H800)
    one = price_trace(traces([{0: decoding(1, 384)}]), H800)
    assert prefill.rollout_s > one.rollout_s


def test_trace_counts_decode_prefill_kv_and_pairs():
    t = StepTrace()
    t.add_step([(10, 1), (0, 3)], experts_touched=5)  # one decoding, one 3-token prefill
    assert (t.decode_tokens, t.prefill_tokens, t.kv_tokens) == ([1], [3], [14])
    assert t.attention_pairs == [11 + 6]  # 1 x (10 + 1); 1 + 2 + 3
    assert StepTrace.from_dict(t.as_dict()) == t


def test_unit_cost_counts_steps_and_a_held_rank_is_occupied_to_the_end():
    # rank 3 leaves after one step (its experts to rank 2); ranks 0-2 take two more
    shrunk = (0, 0, 1, 1, 2, 2, 2, 2)
    tr = {}
    for r in RANKS:
        t = tr[r] = StepTrace(num_experts=8, num_layers=2, expert_bytes=1000)
        t.enter_group(RANKS, OWNER)
        t.add_step(decoding(1, 5) if r == 0 else [], 2)
        t.shrinks.append(ShrinkTrace(1, RANKS, 2000 if r == 3 else 0, 2000 if r == 2 else 0, 0))
        for _ in range(2 if r < 3 else 0):
            t.enter_group((0, 1, 2), shrunk)
            t.add_step(decoding(1, 6), 2)
    priced = price_trace(tr, UnitCost())
    assert priced.occupied_s == {0: 3.0, 1: 3.0, 2: 3.0, 3: 1.0} and priced.rollout_s == 3.0
    # the same rank held after it stopped stepping (its record counts the rollout's steps)
    held = price_trace(tr, UnitCost(), held_steps={0: 3, 1: 3, 2: 3, 3: 3})
    assert held.occupied_s[3] == 3.0
    # on an accelerator the leaver pays its shrink, the survivors it and their two steps
    h800 = price_trace(tr, H800)
    assert h800.occupied_s[0] == h800.rollout_s > h800.occupied_s[3] > 0


def test_a_shrink_charges_moved_experts_and_the_group_the_code_built():
    def shrink(created: int, moved: int):
        # rank 3 sends `moved` traced experts to rank 2 at the boundary after step 1
        sh = [(3, ShrinkTrace(1, RANKS, moved * 1000, 0, created)),
              (2, ShrinkTrace(1, RANKS, 0, moved * 1000, created))]
        sh += [(r, ShrinkTrace(1, RANKS, 0, 0, created)) for r in (0, 1)]
        return price_trace(traces([{0: decoding(8, 100)}] * 2, sh), H800).rollout_s

    none = price_trace(traces([{0: decoding(8, 100)}] * 2), H800).rollout_s
    p = CostParams()
    assert shrink(0, 0) - none == pytest.approx(p.switch_s)
    assert shrink(1, 0) - none == pytest.approx(p.group_create_s)
    assert shrink(0, 2) > shrink(0, 1) > shrink(0, 0)


def test_a_missing_rank_trace_is_refused():
    tr = traces([{0: decoding(2, 5)}])
    del tr[2]
    with pytest.raises(ValueError, match=r"traced by ranks \[0, 1, 3\] only"):
        price_trace(tr, H800)


def test_bad_cost_model_names_the_choices():
    with pytest.raises(ValueError, match="H800"):
        cost_model("TPU", "qwen3-30b-a3b")
    with pytest.raises(ValueError, match="qwen3-30b-a3b"):
        cost_model("H800", "nope")


def test_rank_record_json_names_and_typed_fields():
    rec = RankRecord(rank=1, requests=3)
    d = rec.as_dict()
    # the names the benchmark's JSON and the tools read (unset optional figures are left out)
    assert {"rank", "start_s", "local_finish_s", "release_s", "steps", "busy_steps", "tokens",
            "requests", "kv_peak_bytes", "preempted", "floor_hits", "migrated_out", "adopted",
            "migrated_across", "adopted_across",
            "plan_s", "transfer_s", "switch_s", "sent_bytes", "start_sent_bytes",
            "groups_created_during_rollout",
            "switch_s_per_shrink", "trace"} == set(d)
    rec.note(release_step=4, resident_bytes_before_release=10, resident_bytes_after_release=2,
             groups_created_during_rollout=1)
    assert {"release_step", "resident_bytes_before_release",
            "resident_bytes_after_release"} <= set(rec.as_dict())
    with pytest.raises(TypeError, match="no field \\['release_steps'\\]"):
        rec.note(release_steps=4)


def test_rollout_metrics_prices_records_and_summed_records():
    from flexfloor.rollout.metrics import summed_records

    tr = traces([{0: decoding(3, 10), 1: decoding(1, 10)}] * 2)
    records = [{**RankRecord(rank=r, steps=2, release_s=1.0).as_dict(),
                "trace": tr[r].as_dict()} for r in RANKS]
    one = rollout_metrics(records, [], H800)
    assert set(MODELLED_FIGURES) <= set(one)
    assert one["modelled_occupied_gpu_seconds"] == pytest.approx(
        sum(r["modelled_occupied_s"] for r in one["per_rank"]))
    two = rollout_metrics(summed_records([records, records]), [], H800)
    assert two["modelled_occupied_gpu_seconds"] == pytest.approx(
        2 * one["modelled_occupied_gpu_seconds"])
    assert two["modelled_rollout_seconds"] == pytest.approx(2 * one["modelled_rollout_seconds"])
    assert "modelled_occupied_gpu_seconds" not in rollout_metrics(records, [])


def test_experts_touched_are_used_when_the_trace_is_of_the_cost_models_shape():
    """A trace of the cost model's own expert and layer counts (a real run of that model) is
    priced with the experts that really received rows; another model's, with the estimate."""
    shape = H800.model

    def priced(num_experts: int, touched_per_layer: int) -> float:
        owner = tuple(r for r in RANKS for _ in range(num_experts // len(RANKS)))
        tr = {}
        for r in RANKS:
            t = tr[r] = StepTrace(num_experts=num_experts, num_layers=shape.num_layers,
                                  expert_bytes=1000)
            t.enter_group(RANKS, owner)
            t.add_step(decoding(2, 100), touched_per_layer * shape.num_layers)
        return price_trace(tr, H800).rollout_s

    e = shape.num_experts
    assert priced(e, 2) < priced(e, e // len(RANKS))  # the weights of more experts read
    assert priced(8, 1) == priced(8, 2)  # the tiny model's routing does not carry over
