"""Moved requests take their K/V along (flexfloor/rollout/kv.py's export/import, the engine's
migration, elastic.move_kv). On 4 real gloo workers, one launch shared with the session's other
4-worker tests (tests/workers/kvmove.py): tail consolidation inside the group and the migration
at release, every move a KV transfer, give the static policy's tokens and log-probs bit for bit
(fp32), greedy and sampled, with requests moved twice; the givers' blocks go back (the engine
refuses to end a rollout holding blocks) and no pool outgrows its budget; forced re-prefill
moves the same requests with the same tokens. In process: the pool's export and import, the
prices that choose a move's kind, and the modelled seconds of a transfer (`price_trace`)."""

import math

import pytest
import torch

from distributed import Worker, by_request as merged
from flexfloor.config import ConfigError, ElasticConfig, MoveKV, load_config
from flexfloor.rollout.consolidate import MoveKind
from flexfloor.rollout.kv import BlockPool, blocks_for
from flexfloor.rollout.tails import MoveCosts
from flexfloor.rollout.types import MoveTrace, RolloutError, StepTrace
from flexfloor.sim.cost import UnitCost, cost_model, price_trace

WORKER = Worker("kvmove.py", 4, timeout=300)
KINDS = ["greedy", "sampled"]


@pytest.fixture(scope="module")
def res(shared):
    return shared.run(WORKER).results


def moves(parts, policy):
    """Every move the ranks recorded: (giver's record, taker's record) per move."""
    recs = [p[policy]["record"] for p in parts]
    given = [m for r in recs for m in r["trace"]["moves"] if m["src"] == r["rank"]]
    taken = [m for r in recs for m in r["trace"]["moves"] if m["dst"] == r["rank"]]
    key = lambda m: (m["step"], m["request_id"])
    return sorted(given, key=key), sorted(taken, key=key)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", ["consolidate", "migrate"])
def test_kv_transfer_gives_the_static_tokens_and_logprobs_bit_for_bit(res, case, kind):
    parts = res[f"{case}_{kind}"]
    static = merged(parts, "static", "tokens")
    assert merged(parts, "transfer", "tokens") == static and len(static) == 19
    assert merged(parts, "transfer", "logprobs") == merged(parts, "static", "logprobs")
    given, taken = moves(parts, "transfer")
    assert given and len(given) == len(taken)
    per_token = res["kv_bytes_per_token"]
    for g, t in zip(given, taken):
        assert (g["request_id"], g["src"], g["dst"]) == (t["request_id"], t["src"], t["dst"])
        assert g["kind"] == t["kind"] == MoveKind.KV_TRANSFER.value
        # all but its last sampled token, which the taker feeds at its next step
        assert g["kv_tokens"] == t["kv_tokens"] == g["tokens"] - 1 > 0
        assert g["kv_bytes"] == g["kv_tokens"] * per_token
    recs = [p["transfer"]["record"] for p in parts]
    assert sum(r["migrated_out"] for r in recs) == sum(r["adopted"] for r in recs) == len(given)
    # the givers left at once: fewer occupied steps, the rollout no longer
    steps = lambda policy: [p[policy]["record"]["steps"] for p in parts]
    assert sum(steps("transfer")) < sum(steps("static"))
    assert max(steps("transfer")) == max(steps("static"))
    # no pool outgrew its budget (the moved K/V and the borrowed experts' room together)
    assert max(r["kv_peak_bytes"] for r in recs) <= res["budget_bytes"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_request_moves_twice_with_its_kv(res, kind):
    given, _ = moves(res[f"consolidate_{kind}"], "transfer")
    hops = {}
    for m in given:
        hops.setdefault(m["request_id"], []).append((m["step"], m["src"], m["dst"]))
    # rank 3's four requests: to rank 0 at the first boundary, on to rank 1 at the sixth
    assert {rid: [(s, a, b) for s, a, b in h] for rid, h in hops.items()} == {
        f"3{i}/0": [(1, 3, 0), (6, 0, 1)] for i in range(4)}


def test_forced_reprefill_moves_the_same_requests_with_the_same_tokens(res):
    parts = res["consolidate_sampled"]
    assert merged(parts, "reprefill", "tokens") == merged(parts, "static", "tokens")
    got, ref = merged(parts, "reprefill", "logprobs"), merged(parts, "static", "logprobs")
    # recomputed in another batch shape: equal to fp32 rounding
    assert {k: pytest.approx(v, abs=1e-5) for k, v in ref.items()} == got
    re_given, re_taken = moves(parts, "reprefill")
    kv_given, _ = moves(parts, "transfer")
    where = lambda ms: [(m["step"], m["request_id"], m["src"], m["dst"]) for m in ms]
    assert where(re_given) == where(kv_given)  # the kind does not change the decision
    assert {m["kind"] for m in re_given + re_taken} == {MoveKind.REPREFILL.value}
    assert all(m["kv_tokens"] == m["kv_bytes"] == 0 for m in re_given + re_taken)


# ------------------------------------------------------------------------------------------
# in process: the pool


def pool(capacity=None, block_tokens=4):
    return BlockPool(num_layers=2, groups=2, head_dim=3, dtype=torch.float32, device="cpu",
                     block_tokens=block_tokens, capacity=capacity)


def filled(p: BlockPool, tokens: int, seed: int):
    """A request's block table of `tokens` tokens in `p`, its K/V written slot by slot with
    random values (as the forward stores them); returns (table, K [layers, tokens, G, D], V)."""
    table = p.allocate(blocks_for(tokens, p.block_tokens))
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(2, tokens, 2, 3, generator=g)
    v = torch.randn(2, tokens, 2, 3, generator=g)
    for pos, slot in enumerate(p.slots(table, 0, tokens)):
        p.k[:, slot], p.v[:, slot] = k[:, pos], v[:, pos]
    return table, k, v


def test_export_then_import_stores_exactly_the_requests_kv_in_the_takers_blocks():
    giver, taker = pool(), pool()
    filled(giver, 5, seed=1)  # other requests' blocks around it: its table is not 0..n
    table, k, v = filled(giver, 10, seed=2)
    filled(taker, 7, seed=3)
    kv = giver.export_kv(table, 10)
    assert kv.shape == (2, 2, 10, 2, 3)
    assert torch.equal(kv[0], k) and torch.equal(kv[1], v)
    giver.free(table)  # the giver's blocks go back at once; the export is its own tensor
    filled(giver, 10, seed=4)  # and may be overwritten
    assert torch.equal(kv[0], k)
    used = taker.used
    mine = taker.import_kv(kv, request_id="7/0")
    assert len(mine) == blocks_for(10, 4) and taker.used == used + 3
    slots = taker.slots(mine, 0, 10)
    assert torch.equal(taker.k[:, slots], k) and torch.equal(taker.v[:, slots], v)
    # exactly `length` tokens: a table may hold a partly filled last block
    assert torch.equal(taker.export_kv(mine, 10), kv)
    assert giver.export_kv(table, 0).shape == (2, 2, 0, 2, 3)
    with pytest.raises(RolloutError, match="block table of 2 blocks"):
        giver.export_kv(table[:2], 10)


def test_import_is_refused_naming_the_request_and_the_budget_when_it_does_not_fit():
    taker = pool(capacity=4)
    filled(taker, 6, seed=1)  # 2 of 4 blocks taken
    giver = pool()
    kv = giver.export_kv(filled(giver, 9, seed=2)[0], 9)  # needs 3 blocks
    with pytest.raises(RolloutError, match=r"request 4/1: .*3 KV blocks.*only 2 are free"
                                           r".*rollout\.kv_budget_tokens"):
        taker.import_kv(kv, request_id="4/1")
    assert taker.used == 2  # nothing taken
    assert len(taker.import_kv(kv[:, :, :8], request_id="4/1")) == 2  # 8 tokens fit
    other = BlockPool(num_layers=2, groups=1, head_dim=3, dtype=torch.float32, device="cpu",
                      block_tokens=4, capacity=None)
    with pytest.raises(RolloutError, match="request 4/2: moved K/V of shape"):
        other.import_kv(kv, request_id="4/2")


# ------------------------------------------------------------------------------------------
# in process: the prices and the config


def test_the_prices_choose_the_kind_and_cost_no_engine_step():
    per_token = 512
    auto = MoveCosts(MoveKV.AUTO, link_bytes_per_s=1e9, reprefill_s_per_token=1e-5)
    # 512 B over 1 GB/s is 0.5 us a token against 10 us of prefill: the transfer
    assert auto.prices(per_token).of(100) == (MoveKind.KV_TRANSFER, 0.0)
    slow = MoveCosts(MoveKV.AUTO, link_bytes_per_s=1e6, reprefill_s_per_token=1e-5)
    assert slow.prices(per_token).of(100) == (MoveKind.REPREFILL, 0.0)
    # forced either way whatever the link
    assert MoveCosts(MoveKV.TRANSFER, 1e3, 1e-9).prices(per_token).of(100)[0] == \
        MoveKind.KV_TRANSFER
    assert MoveCosts(MoveKV.REPREFILL, 1e15, 1.0).prices(per_token).of(100)[0] == \
        MoveKind.REPREFILL
    # the real prices, kept for what reads them: bytes per token and the link
    p = auto.prices(per_token)
    assert (p.kv_bytes_per_token, p.transfer_bytes_per_s) == (512, 1e9)
    assert MoveCosts.of(None) == MoveCosts.of(ElasticConfig())
    assert MoveCosts.of(ElasticConfig(move_kv=MoveKV.REPREFILL)).mode == MoveKV.REPREFILL


def test_the_config_names_a_bad_move_field(tmp_path):
    with pytest.raises(ConfigError, match="elastic.kv_link_bytes_per_s: must be > 0"):
        ElasticConfig(kv_link_bytes_per_s=0).validate()
    with pytest.raises(ConfigError, match="elastic.reprefill_s_per_token: must be > 0"):
        ElasticConfig(reprefill_s_per_token=-1.0).validate()
    with pytest.raises(ConfigError, match="elastic.move_kv.*auto, transfer, reprefill"):
        ElasticConfig(move_kv="sometimes").validate()
    cfg = tmp_path / "c.yaml"
    cfg.write_text("elastic:\n  move_kv: transfer\n")
    assert load_config(str(cfg)).elastic.move_kv == MoveKV.TRANSFER
    with pytest.raises(ConfigError, match="elastic.move_kv.*auto, transfer, reprefill"):
        load_config(str(cfg), ["elastic.move_kv=always"])
    assert ElasticConfig().move_kv == MoveKV.AUTO and math.isfinite(
        ElasticConfig().kv_link_bytes_per_s)


# ------------------------------------------------------------------------------------------
# in process: the modelled seconds of a move


def moved_trace(ranks, kind, kv_tokens=300):
    """rank -> its trace: the group `ranks` decodes two steps, then the second rank hands one
    request to the first (`kind`, as both record it) and leaves; the first steps once more."""
    giver, taker = ranks[1], ranks[0]
    out = {}
    for r in ranks:
        t = StepTrace(num_experts=8, num_layers=2, expert_bytes=1000)
        for _ in range(2):
            t.enter_group(ranks, (taker,) * 4 + (giver,) * 4)
            t.add_step([(100, 1)] * 2, experts_touched=2)
        t.moves.append(MoveTrace(2, "5/0", giver, taker, kv_tokens + 1, kind=kind.value,
                                 kv_tokens=kv_tokens if kind == MoveKind.KV_TRANSFER else 0))
        out[r] = t
    t = out[taker]
    t.enter_group((taker,), (taker,) * 8)
    t.add_step([(100, 1)] * 3, experts_touched=2)
    return out


def test_a_kv_transfer_is_priced_as_its_bytes_over_the_link_the_two_ranks_share():
    h800 = cost_model("H800", "qwen3-30b-a3b")
    a, m, eff = h800.accel, h800.model, h800.params.link_efficiency
    for ranks, bw in (((0, 1), a.nvlink_bytes_per_s), ((0, a.gpus_per_node), a.network_bytes_per_s)):
        kv = price_trace(moved_trace(ranks, MoveKind.KV_TRANSFER), h800)
        re = price_trace(moved_trace(ranks, MoveKind.REPREFILL), h800)
        link = 300 * m.kv_bytes_per_token / (bw * eff)  # once: the taker's record is not priced
        # every rank of the group waits for it at that boundary, the giver before it leaves
        for r in ranks:
            assert kv.occupied_s[r] - re.occupied_s[r] == pytest.approx(link, rel=1e-9)
    # NVLink inside a node is the cheaper link; unit cost counts steps only
    inside = price_trace(moved_trace((0, 1), MoveKind.KV_TRANSFER), h800).rollout_s
    across = price_trace(moved_trace((0, a.gpus_per_node), MoveKind.KV_TRANSFER), h800).rollout_s
    assert across > inside
    unit = price_trace(moved_trace((0, 1), MoveKind.KV_TRANSFER), UnitCost())
    assert unit.occupied_s == {0: 3.0, 1: 2.0}
