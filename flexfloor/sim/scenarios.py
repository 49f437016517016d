"""Scenarios: a cluster, a model, a length workload and the policies; `run()` simulates them.

The cluster runs R replicas (`Scenario.replicas`): each an EP group of world / R ranks holding
every expert, decoding its own requests independently of the others. Per training step, five
modes roll out the same requests (`Mode`):
- `static`: verl today: each sample routed to the replica, then the rank, with the fewest
  outstanding requests at submission (`least_outstanding`), every rank held to the end;
- `static_chunks`: verl's legacy SPMD split: the batch in equal contiguous chunks over the ranks
  (`PlacementPolicy.BASELINE`), on the same replicas, all held;
- `replica_release`: like `static`, but a replica is released when its own requests are done;
- `single_group`: one world-wide EP group, contiguous chunks, all held (the paper's setting);
- `elastic`: FlexFloor: its placement (`PlacementPolicy.FLEXFLOOR`, over every rank) and
  release decision (`flexfloor.rollout.release.decide`) shrinking inside each replica; a replica done is released whole.
The scheduler objects are the trainer's (`flexfloor.rollout.scheduler.Scheduler`): FlexFloor's
learns the lengths of each step and places the next from that history. Headline figures sum
steps 2..E (as `tools/bench_rollout.py` does) under the same metric names, plus:
- `ideal`: FlexFloor's schedule with every rank released the moment its own last response ends
  (no idle-but-occupied time at all): the bound release can approach;
- `ratios`: FlexFloor / static; `ratios_vs`: {baseline: FlexFloor / baseline}; `vs_static`:
  {mode: mode / static}.
"""

from __future__ import annotations

import dataclasses
import math
import types
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from flexfloor.config import MODEL_PRESETS, ElasticConfig, PlacementPolicy
from flexfloor.rollout.consolidate import ConsolidationRules, MovePrices, remaining_estimate
from flexfloor.rollout.release import RankLimits, ReleaseRules
from flexfloor.rollout.metrics import (
    MODELLED_FIGURES, chained_sha256, lengths_sha256, metrics_from_counts, modelled_figures, ratios,
    summed_records,
)
from flexfloor.rollout.replicas import (  # noqa: F401  (Mode, MODES, ...: re-exported)
    BASELINES, HELD, MODES, Mode, route_least_outstanding,
)
from flexfloor.rollout.scheduler import (
    LengthHistory, MemoryModel, PromptGroup, Scheduler, evidence_accuracy, round_robin,
)
from flexfloor.rollout.types import Request
from flexfloor.rollout.workload import dataset_batches, make_lengths, make_prompts, tail_stats
from flexfloor.rollout.survivors import creates_group, planned_survivor_sets
from flexfloor.sim.cost import CostParams, GroupSource, RooflineCost, UnitCost, kv_budget_bytes
from flexfloor.sim.hardware import ACCELERATORS, ModelShape
from flexfloor.sim.rollout import (
    SimRequest, TailConsolidation, replica_state, simulate_replicas, simulate_rollout,
)


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    model: str = "tiny"  # a model preset (flexfloor.config.MODEL_PRESETS) or deepseek-v3
    accelerator: Optional[str] = None  # key of ACCELERATORS; None: every step costs 1 (UnitCost)
    gpus: int = 4
    replicas: int = 1  # EP groups of gpus / replicas ranks, each holding every expert
    num_prompts: int = 32  # per training step
    samples_per_prompt: int = 8
    epochs: int = 4
    length_dist: str = "lognormal"
    length_params: dict = field(default_factory=dict)  # workload parameters (see workload.py)
    dataset_prompts: Optional[int] = None  # prompts of the dataset steps draw from (None: num_prompts)
    history_correlation: float = 1.0  # workload.MIX_PARAMS
    cap_fraction: float = 0.0
    max_len: int = 200  # response cap, tokens
    prompt_len: tuple[int, int] = (4, 8)
    max_batch_size: Optional[int] = None  # per rank; None: every request of the rollout
    kv_budget_tokens: Optional[int] = None  # per rank; None: from HBM (or unbounded on UnitCost)
    # KV block size of the engine's pool (allocated as tokens are produced); None: a request
    # reserves prompt + response at admission
    kv_block_tokens: Optional[int] = 16
    # count every request's blocks as the engine's pool does (a pass per step); False: half a
    # block per request on average (accelerator scenarios, where the unit-cost equality is not
    # claimed)
    kv_exact_blocks: bool = False
    min_active_ranks: int = 1  # the floor, per replica (at most its size)
    migrate_max_requests: int = 0
    # FlexFloor placement (flexfloor.config.SchedulerConfig): the product defaults; on
    # accelerators, a rank takes no more than its fair share of groups and keeps its peak KV load
    # under 0.7 of the baseline's fullest rank, so lockstep steps stay as fast as the baseline's
    max_share: float = 2.0
    load_cap: Optional[float] = None
    # FlexFloor across replicas, on accelerators: a rank's predicted finish at most this times
    # the static baseline's predicted end (SchedulerConfig's meaning)
    pace_margin: float = 0.9
    # tail consolidation across replicas (flexfloor.rollout.consolidate), elastic mode with
    # replicas on an accelerator
    consolidate: bool = False
    # with it, the online correction (a replica predicted past the plan's bound hands its
    # longest requests to replicas held anyway, or is lightened) and the evacuation's hedges
    # (takers within that bound, moved estimates counted 1.5x); on in the GPU scenarios
    # (docs/simulator.md)
    correct: bool = False
    # with the correction, a taker's own running requests counted at this times their estimate
    # when it takes requests, and those that outlived their prediction up to the cap
    # (`ConsolidationRules.taker_hedge`; 1.25 in the GPU scenarios, 1: off)
    taker_hedge: float = 1.0
    # the ceiling of prediction: FlexFloor's policy (elastic mode) told every length exactly, the
    # plan's and the consolidation's (no hedges; `pace_margin` as set); the other modes unchanged
    oracle: bool = False
    # with the correction, where no prompt has history: gather the requests their finished
    # siblings say are long onto the replicas that end later (`ConsolidationRules.gather`)
    gather: bool = False
    # with the correction, once the length history proves wrong in a rollout
    # (`LengthHistory.unproven`), a leaving replica hands over only to ranks that step no
    # dearer than its fullest (`ConsolidationRules.no_denser`); on in the GPU scenarios
    no_denser: bool = False
    # after a rollout that proved the length history wrong, FlexFloor places the next as static
    # does (`Scheduler.distrust_wrong_history`, its default; plans by modelled seconds only);
    # False: it packs anyway
    distrust: bool = True
    # an analysis placement, not the policy (docs/simulator.md, "Two tiers"): the elastic
    # mode's requests longest first by the plan's estimates (each length exact with `oracle`),
    # the `lane_requests` longest round robin over the replicas past the first
    # `dense_replicas` (the lanes), the rest over those first ones; the plan's end to keep and
    # the consolidation as they are, no groups built ahead from the plan's predicted ends
    # (those of its own placement). None: the policy's own placement
    dense_replicas: Optional[int] = None
    lane_requests: int = 0
    # shrinking inside a replica (a floor below its size) on an accelerator: the pace rule
    # refuses a shrink whose survivors, hosting more experts, would end their replica later,
    # unless they still end within the end to keep and the shrink saves occupied seconds
    # (`release.slows_replica`); False: every shrink the floor allows is made
    shrink_pace: bool = True
    training_ep: Optional[int] = None  # None: gcd(ranks of a replica, experts)
    seed: int = 0
    # figures to reach, checked and printed: {"baseline": mode, metric thresholds}
    targets: dict = field(default_factory=dict)

    def with_overrides(self, **kw) -> "Scenario":
        unknown = sorted(set(kw) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"scenario has no field {unknown}")
        return dataclasses.replace(self, **kw)


# the paper's figures, against its baseline (one world-wide EP group held to the end)
PAPER_TARGETS = {"baseline": Mode.SINGLE_GROUP.value, "tokens_per_occupied_worker_second": 1.65,
                 "rollout_wall_seconds_max": 1.0, "elastic_over_ideal_min": 0.85,
                 "static_tail_fraction_about": 1 / 3}

# the policies a GPU deployment runs: placement for memory-bound lockstep decoding (see Scenario),
# tail consolidation across replicas with the online correction, and a floor of one node: a replica of one node is released
# whole (a shrink inside it would stall it for a new communicator and buys nothing there)
ON_GPUS = dict(max_share=1.0, load_cap=0.7, min_active_ranks=8, consolidate=True, correct=True,
               taker_hedge=1.25, no_denser=True)

SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    Scenario(
        "tiny-cpu", "The CPU benchmark's setting (tools/bench_rollout.py defaults): tiny MoE, 4 "
        "ranks, lognormal lengths, every step costs 1. Its steps equal the real engine's.",
        kv_block_tokens=16, kv_exact_blocks=True),
    Scenario(
        "paper-like",
        "Qwen3-30B-A3B-shaped model on 64 H800 (8 nodes) as 8 replicas x EP8, 512 prompts x 8 "
        "samples per rollout, long-tailed responses up to 16k tokens (static tail fraction about "
        "1/3, as the paper saw)",
        model="qwen3-30b-a3b", accelerator="H800", gpus=64, replicas=8, num_prompts=512,
        samples_per_prompt=8,
        epochs=3, length_params={"median": 3000.0, "sigma": 0.6}, max_len=16384,
        prompt_len=(100, 600), max_batch_size=256, targets=PAPER_TARGETS, **ON_GPUS),
    Scenario(
        "mixtral-h100", "Mixtral-8x7B on 32 H100: few, large experts (8 experts: at most 8 ranks "
        "serve experts, the rest hold replicas)",
        model="mixtral-8x7b", accelerator="H100", gpus=32, num_prompts=256, samples_per_prompt=8,
        epochs=3, length_params={"median": 1500.0, "sigma": 0.8}, max_len=8192,
        prompt_len=(100, 400), max_batch_size=256, **ON_GPUS),
    Scenario(
        "dsv2-lite-a100", "DeepSeek-V2-Lite on 16 A100, 4k responses",
        model="deepseek-v2-lite", accelerator="A100", gpus=16, num_prompts=256,
        samples_per_prompt=8, epochs=3, length_params={"median": 800.0, "sigma": 0.8},
        max_len=4096, prompt_len=(100, 400), max_batch_size=256, **ON_GPUS),
    Scenario(
        "deepseek-v3-h200", "A DeepSeek-V3-sized model on 256 H200 (32 nodes), 32k responses",
        model="deepseek-v3", accelerator="H200", gpus=256, num_prompts=1024,
        samples_per_prompt=8, epochs=3, length_params={"median": 6000.0, "sigma": 0.7},
        max_len=32768, prompt_len=(200, 1000), max_batch_size=128, **ON_GPUS),
]}


@dataclass
class _Topology:
    """EP groups (sorted rank tuples), with the memory limits and starting state of each."""

    groups: list[tuple[int, ...]]
    memory: MemoryModel
    limits: RankLimits
    states: dict  # ranks -> (placement, holding)


# the fields' least values (None, where a field may be None, passes), and those whose values
# lie in [0, 1]: a value out of range fails early, naming the field, not deep in a rollout
_AT_LEAST = {"gpus": 1, "num_prompts": 1, "samples_per_prompt": 1, "epochs": 1, "max_len": 1,
             "max_batch_size": 1, "kv_budget_tokens": 1, "kv_block_tokens": 1,
             "dataset_prompts": 1, "min_active_ranks": 1, "migrate_max_requests": 0, "seed": 0,
             "taker_hedge": 1.0, "dense_replicas": 1, "lane_requests": 0}
_POSITIVE = ("max_share", "load_cap", "pace_margin")
_FRACTIONS = ("history_correlation", "cap_fraction")


def replicas_together(sc: Scenario) -> bool:
    """Whether the elastic mode simulates `sc`'s replicas together, their tails consolidated
    (`tail_consolidation`): on an accelerator, R > 1, with `consolidate`. Only then do the
    running requests carry the estimates the pace rule reads."""
    return sc.consolidate and sc.accelerator is not None and sc.replicas > 1


def paced(sc: Scenario, floor: int, size: int) -> bool:
    """Whether a replica of `size` ranks with `floor` shrinks under the pace rule: asked for
    (`shrink_pace`), on an accelerator, and below the replica's size."""
    return sc.shrink_pace and sc.accelerator is not None and floor < size


def _floor_and_size(sc: Scenario) -> tuple[int, int]:
    """A replica's floor (at most its size) and its size, in ranks."""
    size = sc.gpus // max(1, sc.replicas)
    return min(sc.min_active_ranks, size), size


def pace_rule_ignored(sc: Scenario) -> bool:
    """Whether `sc` asks for the pace rule on a shrink inside a replica where it cannot act
    (`paced` but not `replicas_together`): there every shrink the floor allows is made."""
    return paced(sc, *_floor_and_size(sc)) and not replicas_together(sc)


def pace_rule_moot(sc: Scenario) -> bool:
    """Whether `sc` asks for the pace rule on a shrink inside a replica under UnitCost (no
    accelerator): there every step costs 1 whatever a rank hosts, so no shrink slows a replica
    and the rule never refuses one."""
    floor, size = _floor_and_size(sc)
    return sc.shrink_pace and sc.accelerator is None and floor < size


def check_scenario(sc: Scenario) -> None:
    """ValueError naming the field where `sc` cannot run (`run` checks it too)."""
    for name, least in _AT_LEAST.items():
        value = getattr(sc, name)
        if value is not None and not (math.isfinite(value) and value >= least):
            raise ValueError(f"{name}={value}: must be at least {least}")
    for name in _POSITIVE:
        value = getattr(sc, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name}={value}: must be a positive number")
    for name in _FRACTIONS:
        value = getattr(sc, name)
        if not 0 <= value <= 1:
            raise ValueError(f"{name}={value}: must be in [0, 1]")
    models = sorted([*MODEL_PRESETS, "deepseek-v3"])
    if sc.model not in models:
        raise ValueError(f"model={sc.model!r}: unknown; choose one of {models}")
    if sc.accelerator is None and sc.model not in MODEL_PRESETS:
        raise ValueError(f"model={sc.model!r}: UnitCost (no accelerator) runs a model preset; "
                         f"choose one of {sorted(MODEL_PRESETS)}, or an accelerator (--accelerator)")
    if sc.accelerator is not None and sc.accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator={sc.accelerator!r}: unknown; choose one of "
                         f"{sorted(ACCELERATORS)}")
    if sc.prompt_len[0] < 1 or sc.prompt_len[1] < sc.prompt_len[0]:
        raise ValueError(f"prompt_len={sc.prompt_len}: must be (least, most) with 1 <= least "
                         "<= most")
    if sc.dataset_prompts is not None and sc.dataset_prompts < sc.num_prompts:
        raise ValueError(f"dataset_prompts={sc.dataset_prompts}: must be at least num_prompts "
                         f"({sc.num_prompts}), the prompts each step draws")
    if sc.replicas < 1 or sc.gpus % sc.replicas:
        raise ValueError(f"replicas={sc.replicas} must divide gpus={sc.gpus} (EP size per "
                         "replica = gpus / replicas)")
    if sc.dense_replicas is not None and sc.dense_replicas > sc.replicas:
        raise ValueError(f"dense_replicas={sc.dense_replicas}: must be at most replicas "
                         f"({sc.replicas})")
    if sc.lane_requests and (sc.dense_replicas or sc.replicas) >= sc.replicas:
        raise ValueError(f"lane_requests={sc.lane_requests}: the lanes are the replicas past "
                         f"the first dense_replicas; set dense_replicas below replicas "
                         f"({sc.replicas})")
    requests = sc.num_prompts * sc.samples_per_prompt
    if sc.lane_requests >= requests:
        raise ValueError(f"lane_requests={sc.lane_requests}: must be fewer than a step's "
                         f"requests (num_prompts x samples_per_prompt = {requests}), so that the "
                         "dense replicas hold the rest")


def prepare(sc: Scenario, *, params: CostParams = CostParams()) -> types.SimpleNamespace:
    """What `run` needs before its first step: the model, the lengths (an exact length file's
    read, and refused above `max_len`, not clipped), the cost model and the topologies. Every
    error of `sc`'s inputs is raised here (ValueError naming the field, flag or file and the
    fix), so a tool can check them all before it prints or writes anything."""
    check_scenario(sc)
    shape = ModelShape.from_preset(sc.model)
    dataset = sc.dataset_prompts or sc.num_prompts
    lengths = make_lengths(sc.length_dist, num_prompts=dataset,
                           samples_per_prompt=sc.samples_per_prompt, epochs=sc.epochs,
                           seed=sc.seed, max_len=sc.max_len,
                           **sc.length_params, **_mix_params(sc))
    batches = dataset_batches(dataset, sc.num_prompts, sc.epochs, sc.seed)
    vocab = MODEL_PRESETS[sc.model]["vocab_size"] if sc.model in MODEL_PRESETS else 129280
    prompt_lens = [len(p) for p in make_prompts(dataset, sc.prompt_len, vocab, sc.seed)]
    max_batch = sc.max_batch_size or sc.num_prompts * sc.samples_per_prompt
    max_seq_len = sc.prompt_len[1] + sc.max_len
    size = sc.gpus // sc.replicas
    replicated = [tuple(range(i * size, (i + 1) * size)) for i in range(sc.replicas)]
    if sc.accelerator is None:
        # the engine's own numbers: an fp32 model of the preset on CPU (the benchmark's)
        model_cfg = types.SimpleNamespace(**MODEL_PRESETS[sc.model])
        cost = UnitCost()
        max_seq_len = max(model_cfg.max_seq_len, max_seq_len)

        def memory_of(groups):
            # the benchmark's: the budget in whole blocks of the engine's pool
            bt = sc.kv_block_tokens or 1
            m = MemoryModel.from_model_config(model_cfg)
            budget = (None if sc.kv_budget_tokens is None else
                      sc.kv_budget_tokens // bt * bt * m.kv_bytes_per_token)
            return dataclasses.replace(m, kv_budget_bytes=budget, block_tokens=bt)
    else:
        accel = ACCELERATORS[sc.accelerator]
        cost = RooflineCost(accel, shape, params)

        def memory_of(groups):
            most = -(-shape.num_experts // len(groups[0]))
            budget = (sc.kv_budget_tokens * shape.kv_bytes_per_token if sc.kv_budget_tokens
                      else kv_budget_bytes(accel, shape, most, params))
            return MemoryModel(kv_bytes_per_token=shape.kv_bytes_per_token,
                               expert_bytes=shape.expert_bytes, kv_budget_bytes=budget)

    def topology(groups) -> _Topology:
        memory = memory_of(groups)
        limits = RankLimits(kv_bytes_per_token=memory.kv_bytes_per_token, max_seq_len=max_seq_len,
                            max_batch_size=max_batch, kv_budget_bytes=memory.kv_budget_bytes,
                            expert_nbytes=memory.expert_bytes)
        longest = sc.prompt_len[1] + int(lengths.max())
        if memory.kv_budget_bytes is not None and longest * memory.kv_bytes_per_token > memory.kv_budget_bytes:
            held, bt = memory.kv_budget_bytes // memory.kv_bytes_per_token, memory.block_tokens
            request = (f"the longest request ({longest} tokens: a prompt of up to "
                       f"{sc.prompt_len[1]} and a response of {int(lengths.max())})")
            least = -(-longest // bt) * bt  # whole blocks, as the pool holds them
            if sc.kv_budget_tokens is None:  # the accelerator's memory, less the weights
                raise ValueError(f"kv budget of {held} tokens per rank cannot hold {request}; "
                                 f"give kv_budget_tokens (--kv-budget-tokens) of at least "
                                 f"{least}, or shorten the responses")
            kept = (f", {held} in whole {bt}-token blocks," if held != sc.kv_budget_tokens
                    else "")
            raise ValueError(f"kv_budget_tokens={sc.kv_budget_tokens}: {sc.kv_budget_tokens} "
                             f"tokens per rank{kept} cannot hold {request}; give at least "
                             f"{least}, or shorten the responses")
        states = {g: replica_state(shape.num_experts, g, sc.training_ep) for g in groups}
        return _Topology(groups, memory, limits, states)

    topo = {Mode.SINGLE_GROUP: topology([tuple(range(sc.gpus))])}
    topo_r = topology(replicated) if sc.replicas > 1 else topo[Mode.SINGLE_GROUP]
    for mode in Mode:
        topo.setdefault(mode, topo_r)
    return types.SimpleNamespace(shape=shape, dataset=dataset, lengths=lengths, batches=batches,
                                 prompt_lens=prompt_lens, max_batch=max_batch,
                                 replicated=replicated, cost=cost, topo=topo, topo_r=topo_r)


def run(sc: Scenario, *, params: CostParams = CostParams(),
        progress: Optional[Callable[[dict], None]] = None,
        prepared: Optional[types.SimpleNamespace] = None) -> dict:
    """Simulate every step of `sc` in every mode; the report `tools/simulate.py` writes.
    `progress`, if given, is handed each step's entry of `per_epoch` as soon as it is done;
    `prepared`, `prepare(sc, params=params)` if already made (else made here)."""
    p = prepared if prepared is not None else prepare(sc, params=params)
    shape, dataset, lengths, batches = p.shape, p.dataset, p.lengths, p.batches
    prompt_lens, max_batch, replicated, cost = p.prompt_lens, p.max_batch, p.replicated, p.cost
    topo, topo_r = p.topo, p.topo_r
    chunks = Scheduler(PlacementPolicy.BASELINE, memory=topo_r.memory, max_batch_size=max_batch)
    flexfloor = Scheduler(PlacementPolicy.FLEXFLOOR, LengthHistory(), memory=topo_r.memory,
                          max_batch_size=max_batch, max_share=sc.max_share, load_cap=sc.load_cap,
                          pace_margin=sc.pace_margin, distrust_wrong_history=sc.distrust)
    per_epoch, kept = [], []
    kept_groups: dict = {}  # the elastic mode's survivor groups, kept across rollouts
    for epoch in range(1, sc.epochs + 1):
        groups = [PromptGroup(int(uid), tuple(
            Request(prompt_uid=int(uid), sample_index=s, prompt_ids=(1,) * prompt_lens[uid],
                    max_new_tokens=sc.max_len, target_len=int(lengths[epoch - 1, uid, s]))
            for s in range(sc.samples_per_prompt))) for uid in batches[epoch - 1]]
        # across replicas on accelerators: placement by modelled seconds; one group, or UnitCost
        # (which must match the engine): over the ranks by predicted steps
        step_cost = (None if sc.accelerator is None or sc.replicas == 1 else
                     rank_step_cost(cost, topo_r.states[replicated[0]][0], replicated[0], max_batch))
        if sc.oracle:
            plan = oracle_plan(flexfloor, groups, range(sc.gpus), replicas=replicated,
                               step_cost=step_cost)
        else:
            plan = flexfloor.plan(groups, range(sc.gpus), replicas=replicated,
                                  step_cost=step_cost)
        two_tier = sc.dense_replicas is not None
        if two_tier:
            estimate = ((lambda q: q.target_len) if sc.oracle else
                        (lambda q, est=plan.per_request: est.get(q.request_id, 0.0)))
            plan = dataclasses.replace(plan, assignment=two_tiers(
                groups, replicated, sc.dense_replicas, sc.lane_requests, estimate))
        routed = route_least_outstanding(groups, replicated)
        assignments = {Mode.STATIC: routed, Mode.REPLICA_RELEASE: routed,
                       Mode.STATIC_CHUNKS: chunks.plan(groups, range(sc.gpus)).assignment,
                       Mode.SINGLE_GROUP: chunks.plan(groups, range(sc.gpus)).assignment,
                       Mode.ELASTIC: plan.assignment}
        entry, outs = {"epoch": epoch, "prediction_sources": dict(plan.sources)}, {}
        if step_cost is not None:  # the plan's predicted seconds, to set against what happened
            entry["plan"] = {"finish_bound_s": plan.finish_bound, "distrusted": plan.distrusted}
            if two_tier:  # the plan's predicted ends are its own placement's, not the one run
                entry["plan"]["placement"] = "two_tiers"
            else:
                entry["plan"].update(replica_end_s=[max(plan.expected_finish[r] for r in g)
                                                    for g in replicated],
                                     leaving_order=plan.leaving_order(replicated))
        tails = None
        if replicas_together(sc):
            tails = tail_consolidation(sc, cost, params, topo_r, step_cost, plan,
                                       flexfloor.predictor)
        for mode in Mode:
            out = simulate_mode(mode, assignments[mode], topo[mode], cost, sc,
                                tails if mode == Mode.ELASTIC else None,
                                expected_finish=None if two_tier else plan.expected_finish,
                                kept_groups=kept_groups if mode == Mode.ELASTIC else None)
            m = mode_metrics(out, sc, lengths_sha256(out.lengths))
            m["timeline"] = out.timeline
            entry[mode.value], outs[mode.value] = m, out
        entry["ideal"] = ideal(outs["elastic"])
        entry["prediction_accuracy"] = evidence_accuracy(plan, outs["elastic"].lengths,
                                                         flexfloor.predictor)
        _add_ratios(entry)
        flexfloor.history.record_rollout(outs["elastic"].lengths)
        per_epoch.append(entry)
        if progress is not None:
            progress(entry)
        if epoch > 1 or sc.epochs == 1:
            kept.append(outs)
    memory = topo_r.memory
    report = {"scenario": dataclasses.asdict(sc), "unit": cost.unit, "modes": MODES,
              "summary_epochs": [e["epoch"] for e in per_epoch if e["epoch"] > 1 or sc.epochs == 1],
              "model": {"name": shape.name, "total_params": shape.total_params,
                        "expert_bytes": shape.expert_bytes, "dense_bytes": shape.dense_bytes,
                        "kv_bytes_per_token": memory.kv_bytes_per_token},
              "memory": {"kv_budget_bytes_per_rank": memory.kv_budget_bytes,
                         "kv_budget_tokens_per_rank": (memory.kv_budget_bytes // memory.kv_bytes_per_token
                                                       if memory.kv_budget_bytes else None),
                         "kv_block_tokens": sc.kv_block_tokens, "max_batch_size": max_batch},
              "workload": {**tail_stats(np.stack([lengths[e, batches[e]] for e in range(sc.epochs)])),
                           "dataset_prompts": dataset,
                           "prompts_with_history": [e["prediction_sources"]["history"]
                                                    for e in per_epoch]}}
    if sc.accelerator:
        report["accelerator"] = dataclasses.asdict(ACCELERATORS[sc.accelerator])
        report["cost_params"] = {k: getattr(v, "value", v)
                                 for k, v in dataclasses.asdict(params).items()}
    chosen = [e for e in per_epoch if e["epoch"] in report["summary_epochs"]]
    for mode in MODES:
        outs = [k[mode] for k in kept]
        m = mode_metrics(types.SimpleNamespace(
            records=summed_records([o.records for o in outs]),
            total_tokens=sum(o.total_tokens for o in outs),
            num_responses=sum(o.num_responses for o in outs),
            groups_created=sum(o.groups_created for o in outs)), sc,
            chained_sha256(e[mode]["responses_sha256"] for e in chosen))
        m.pop("released_ranks")
        for key in ("rollout_wall_seconds", "rollout_wall_steps"):
            m[key] = sum(e[mode][key] for e in chosen)
        if sc.accelerator:
            m["modelled_rollout_seconds"] = m["rollout_wall_seconds"]
        report[mode] = m
    tokens = report["elastic"]["total_response_tokens"]
    occupied = sum(e["ideal"]["occupied_worker_seconds"] for e in chosen)
    report["ideal"] = {"occupied_worker_seconds": occupied,
                       "tokens_per_occupied_worker_second": tokens / occupied if occupied else 0.0}
    _add_ratios(report)
    report["per_epoch"] = per_epoch
    if sc.targets:
        report["targets"] = check_targets(report, sc.targets)
    return report


def two_tiers(groups, replicas, dense: int, lanes: int, estimate) -> dict[int, list[Request]]:
    """The two-tier placement (`Scenario.dense_replicas`): the requests longest first by
    `estimate` (request -> length), the `lanes` longest round robin over `replicas[dense:]`, the
    rest over `replicas[:dense]`, each round robin over the replicas, then their ranks
    (`scheduler.round_robin`). A replica given nothing leaves at once. Returns rank -> requests,
    longest first."""
    reqs = sorted((q for g in groups for q in g.requests),
                  key=lambda q: (-estimate(q), q.prompt_uid, q.sample_index))
    return {**round_robin(reqs[lanes:], replicas[:dense]),
            **round_robin(reqs[:lanes], replicas[dense:])}


def oracle_plan(scheduler: Scheduler, groups, ranks, **kw):
    """`scheduler`'s plan as if it knew every length of this rollout (`Scenario.oracle`): a
    scheduler of the same settings whose history holds each prompt's lengths now, its samples
    ordered longest first (the plan gives a prompt's i-th sample its i-th longest past length);
    its other settings, `pace_margin` too, unchanged. The lengths are told as two alike epochs:
    no sample runs to the cap unforeseen (`LengthHistory.surprise_share` 0), so the plan hedges
    nothing, as the oracle's consolidation does not. `scheduler` itself learns nothing from
    it."""
    told = LengthHistory()
    ordered = []
    for g in groups:
        reqs = tuple(sorted(g.requests, key=lambda q: (-q.target_len, q.sample_index)))
        for _ in range(2):
            told.record(g.uid, [q.target_len for q in reqs])
        ordered.append(PromptGroup(g.uid, reqs))
    knows = dataclasses.replace(scheduler, history=told)
    return knows.plan(ordered, ranks, **kw)


def _mix_params(sc: Scenario) -> dict:
    """The RL mixes, passed only when set (an exact length file takes none)."""
    out = {}
    if sc.history_correlation != 1.0:
        out["history_correlation"] = sc.history_correlation
    if sc.cap_fraction:
        out["cap_fraction"] = sc.cap_fraction
    return out


def rank_step_cost(cost, placement, ranks: tuple[int, ...], max_batch: int):
    """The scheduler's `StepCost` from the cost model: a rank's step with every rank of its EP
    group (`ranks`, `placement`) loaded alike (`linear_step_cost`)."""
    from flexfloor.sim.cost import RankLoad, linear_step_cost

    hosted = {r: placement.owner.count(r) for r in ranks}

    def priced(n: int, ctx: float) -> float:
        return cost.step_seconds([RankLoad(r, n, int(ctx), hosted[r], ctx) for r in ranks],
                                 placement.owner)

    return GroupStepCost(linear_step_cost(priced, max_batch), _spread_step(cost, placement, ranks),
                         len(ranks), max_batch)


def reprefill_seconds_per_token(cost, placement) -> float:
    """A re-prefill's seconds per token on a group of `placement`: a 4096-token prompt step on
    each of its ranks, per token (what a moved request's recompute costs its taker)."""
    from flexfloor.sim.cost import RankLoad

    probe = 4096
    return cost.step_seconds([RankLoad(r, probe, probe, placement.owner.count(r),
                                       probe * (probe + 1) / 2) for r in placement.ranks],
                             placement.owner) / probe


def _spread_step(cost, placement, ranks: tuple[int, ...]):
    """total -> the group's step with `total` requests spread as evenly as its ranks allow
    (no context): what the step's expert reads cost for that many tokens."""
    from flexfloor.sim.cost import RankLoad

    hosted = {r: placement.owner.count(r) for r in ranks}

    def step(total: int) -> float:
        base, extra = divmod(total, len(ranks))
        loads = [base + (i < extra) for i in range(len(ranks))]
        return cost.step_seconds([RankLoad(r, n, 0, hosted[r], 0) for r, n in zip(ranks, loads)],
                                 placement.owner)

    return step


class GroupStepCost:
    """A `scheduler.StepCost` (a rank's step, every rank of its group loaded alike) that also
    prices the step's shared part: the experts a rank reads depend on the tokens of the whole
    group, so a rank of n requests beside lighter ranks steps faster than n everywhere (one
    request on one of 8 ranks: 8.5 ms against 9.4 ms with one on each, `paper-like`).
    `shared(n, total)`: what a rank of n requests gains (<= 0) in a step of `total` requests
    over the group; `replica_finish` adds it. Tabled once per total."""

    def __init__(self, per_rank, spread, ranks: int, max_batch: int):
        self.per_rank = per_rank
        self.ranks = ranks
        self.max_batch = max_batch
        self._table = np.array([spread(t) for t in range(ranks * max_batch + 1)])

    def __call__(self, n, ctx):
        return self.per_rank(n, ctx)

    def shared(self, n, total):
        top = self.ranks * self.max_batch
        n = np.minimum(np.asarray(n), self.max_batch)
        alike = self._table[n * self.ranks]
        return np.minimum(0.0, self._table[np.minimum(np.asarray(total), top)] - alike)


def tail_consolidation(sc: Scenario, cost, params: CostParams, topo: _Topology, step_cost,
                       plan, predictor) -> TailConsolidation:
    """The elastic mode's consolidation across replicas: the decision's rules, the cost model's
    step cost and move prices (KV over the network between nodes, or a re-prefill priced as a
    prompt step), and each running request's predicted remaining tokens: the plan's prediction,
    or for a prompt with no history the siblings already finished in this rollout
    (`Predictor.predict(uid, siblings)`), corrected once a request outlives it; and, with
    `Scenario.correct`, the end to keep (the correction's bound,
    `ConsolidationState.end_bound_s`): the plan's `finish_bound`."""
    # priced per rank, as the bounds are (`Scheduler._across_replicas`): with the group's shared
    # part the takers looked lighter, took more, and paper-like ended 3% after static
    step_cost = getattr(step_cost, "per_rank", step_cost)
    placement, _ = topo.states[topo.groups[0]]
    prices = MovePrices(kv_bytes_per_token=topo.memory.kv_bytes_per_token,
                        transfer_bytes_per_s=cost.accel.network_bytes_per_s * params.link_efficiency,
                        reprefill_s_per_token=reprefill_seconds_per_token(cost, placement))
    # the engine's rule (`tails.RunningEstimates`): the plan's history, the siblings finished so
    # far (here anywhere, the engine's on its rank) and the prior, the history distrusted once
    # it proves wrong in this rollout (with `Scenario.distrust`)
    from flexfloor.rollout.tails import RunningEstimates

    est = RunningEstimates.of_plan(plan, predictor, distrust=sc.distrust)
    predictor = est.predictor
    spread = predictor.history.sibling_spread() if sc.gather else 1.0  # read by gathering only

    def predicted(req: SimRequest, produced: int, finished: dict) -> float:
        if req.prompt_uid not in est.with_history and sc.gather:
            # no history: its siblings done (the shorter ones) and how far a prompt's samples
            # spread, else the prior beyond what it produced (`Predictor.running`)
            return predictor.running(req.prompt_uid, finished.get(req.prompt_uid, ()),
                                     produced, spread)
        return est.length(req.prompt_uid, req.request_id, finished)

    def remaining(req: SimRequest, produced: int, finished: dict) -> float:
        if sc.oracle:
            return float(max(1, req.length - produced))
        return remaining_estimate(predicted(req, produced, finished), produced, sc.max_len)

    def worst(req: SimRequest, produced: int, finished: dict) -> Optional[float]:
        """Outlived its prediction (known wrong): up to the cap."""
        return (float(sc.max_len - produced) if produced >= predicted(req, produced, finished)
                else None)

    if not sc.correct:
        return TailConsolidation(ConsolidationRules(min_replicas=1), step_cost, prices,
                                 remaining, sc.kv_block_tokens or 1)
    # the end to keep: the plan's bound (static's predicted end times `pace_margin`); a
    # leaving replica's requests counted half as long again on their takers
    rules = ConsolidationRules(min_replicas=1, evacuation_hedge=1.5, taker_hedge=sc.taker_hedge)
    if sc.oracle:  # every estimate exact: nothing to hedge
        rules = dataclasses.replace(rules, evacuation_hedge=1.0, correction_hedge=1.0,
                                    taker_hedge=1.0)
        return TailConsolidation(rules, step_cost, prices, remaining, sc.kv_block_tokens or 1,
                                 end_bound_s=plan.finish_bound)
    # none where no prompt has history: the plan's ends then come from the prior (or the
    # default) alone, a guess (paper-like --dataset-prompts 16384: 155 s against the 207 s the
    # replicas take, which would hold every replica late and refuse every hand-over)
    bound = plan.finish_bound if plan.sources.get("history") else None
    every = None
    if bound is None and sc.gather:  # no end to keep: gather what the siblings say is long
        rules = dataclasses.replace(rules, gather=True)
        every = plan.finish_bound / 50 if plan.finish_bound else None
    # the guard: where the history proves wrong in this rollout (its finished samples outside
    # their prompts' past ranges), a leaving replica hands over only to ranks no denser than
    # its fullest; where no prompt has history there is nothing to prove wrong
    history = predictor.history
    unproven = (history.unproven if sc.no_denser and bound is not None else None)
    return TailConsolidation(rules, step_cost, prices, remaining, sc.kv_block_tokens or 1,
                             end_bound_s=bound, worst=worst, gather_every_s=every,
                             unproven=unproven)


def engine_tails(sc: Scenario, replicas: int) -> TailConsolidation:
    """The engine's default consolidation on unit cost (`elastic.consolidate`, inside each
    replica only: flexfloor/rollout/tails.py): a request's remaining tokens up to its cap, each
    rank a giver or taker of its own; never across replicas (`min_replicas`: all stay)."""
    from flexfloor.rollout.tails import TailRules

    cfg = ElasticConfig()
    within = TailRules(max_requests=cfg.consolidate_max_requests,
                       reserve_blocks=cfg.consolidate_reserve_blocks,
                       floor=min(sc.min_active_ranks, sc.gpus // max(1, replicas)))
    return TailConsolidation(ConsolidationRules(min_replicas=replicas), None, None,
                             lambda req, produced, finished: float(max(1, sc.max_len - produced)),
                             sc.kv_block_tokens or 16, within=within)


def shrink_pace(cost, max_batch: int, kept: Optional[dict] = None):
    """The pace rule of a shrink inside a replica on the cost model: the engine's step cost of
    a group (`elastic.pace_of`), a shrink's stall as this simulator prices it. With the job's
    groups (`kept`: {"prebuilt": set, "late": set}, `GroupSource.PLANNED`) the survivors' group
    is priced as the shrink will be carried out, as the engine's rule prices it: a switch where
    a group built ahead or made earlier takes them, else a new group
    (`survivors.creates_group`); None: as `CostParams.group_source` says."""
    from flexfloor.rollout.elastic import pace_of
    from flexfloor.rollout.release import Pace

    def stall(placement, new_placement, transfers) -> float:
        built = None if kept is None else not creates_group(
            placement.ranks, new_placement.ranks, kept["prebuilt"], kept["late"])
        return cost.shrink_seconds(transfers, placement.owner, prebuilt=built)
    return Pace(pace_of(cost, max_batch).group_cost, stall)


def simulate_mode(mode: Mode, assignment: dict, topo: _Topology, cost, sc: Scenario,
                  tails: Optional[TailConsolidation] = None,
                  expected_finish: Optional[dict] = None, kept_groups: Optional[dict] = None):
    """One rollout of `mode`: each EP group on its own (or, with `tails`, together: their tails
    consolidated), then the hold rule. A held rank stays to the end of the slowest group, its
    steps counted as that group's. `kept_groups`: the job's survivor groups so far, per EP
    group's ranks ({"prebuilt": set, "late": set}, updated here), as the engine's layout keeps
    them across rollouts (`GroupSource.PLANNED`); None: this rollout's plan's alone."""
    records, timeline, lengths = [], [], {}
    total = responses = created = 0
    runs = []
    for i, ranks in enumerate(topo.groups):
        placement, holding = topo.states[ranks]
        sub = {r: [SimRequest(q.request_id, q.prompt_uid, len(q.prompt_ids), q.target_len)
                   for q in assignment.get(r, [])] for r in ranks}
        runs.append({"assignment": sub, "rules": None, "placement": placement})
        if mode != Mode.ELASTIC:
            continue
        floor = min(sc.min_active_ranks, len(ranks))
        params, kept = getattr(cost, "params", None), None
        if (expected_finish is not None and params is not None
                and params.group_source == GroupSource.PLANNED):  # the engine's groups ahead
            kept = ({} if kept_groups is None else kept_groups).setdefault(
                tuple(ranks), {"prebuilt": set(), "late": set()})
            kept["prebuilt"].update(planned_survivor_sets(
                {r: expected_finish[r] for r in ranks}, floor=floor))
            runs[-1]["prebuilt"], runs[-1]["late"] = kept["prebuilt"], kept["late"]
        runs[-1]["rules"] = ReleaseRules(
            min_active_ranks=floor, holding=holding, migrate_max_requests=sc.migrate_max_requests,
            pace=(shrink_pace(cost, topo.limits.max_batch_size, kept)
                  if paced(sc, floor, len(ranks)) else None))
    if (tails is None and mode == Mode.ELASTIC and sc.accelerator is None
            and not sc.migrate_max_requests and ElasticConfig().consolidate):  # as the engine
        tails = engine_tails(sc, len(topo.groups))
    if tails is not None:
        outs = simulate_replicas(runs, cost, limits=topo.limits,
                                 kv_block_tokens=sc.kv_block_tokens, consolidation=tails,
                                 exact_blocks=sc.kv_exact_blocks)
    else:
        outs = [simulate_rollout(g["assignment"], g["rules"], cost, limits=topo.limits,
                                 placement=g["placement"], kv_block_tokens=sc.kv_block_tokens,
                                 exact_blocks=sc.kv_exact_blocks, prebuilt_sets=g.get("prebuilt"),
                                 late_sets=g.get("late"))
                for g in runs]
    for i, out in enumerate(outs):
        records += out.records
        timeline += [{**t, "replica": i} for t in out.timeline] if len(topo.groups) > 1 else out.timeline
        for uid, ls in out.lengths.items():
            lengths.setdefault(uid, []).extend(ls)
        total, responses = total + out.total_tokens, responses + out.num_responses
        created += out.groups_created
    if mode in HELD:
        end = max(r["release_s"] for r in records)
        steps = max(r["steps"] for r in records)
        for r in records:
            r.update(release_s=end, steps=steps, release_step=steps)
    records.sort(key=lambda r: r["rank"])
    return types.SimpleNamespace(records=records, total_tokens=total, num_responses=responses,
                                 lengths=lengths, timeline=timeline, groups_created=created)


def mode_metrics(out, sc: Scenario, digest: str) -> dict:
    """The benchmark's figures of one mode, with the bench's modelled names
    (the simulator's seconds are modelled; None on UnitCost, whose seconds are steps);
    `digest`: its `responses_sha256`."""
    m = metrics_from_counts(out.records, total_tokens=out.total_tokens,
                            num_responses=out.num_responses, digest=digest)
    m["groups_created_during_rollout"] = out.groups_created
    m.update(dict.fromkeys(MODELLED_FIGURES) if sc.accelerator is None else modelled_figures(
        m["occupied_worker_seconds"], m["rollout_wall_seconds"], out.total_tokens))
    return m


def ideal(out) -> dict:
    """Every rank occupied exactly until its own last response ends."""
    occupied = sum(r["local_finish_s"] for r in out.records)
    return {"occupied_worker_seconds": occupied,
            "tokens_per_occupied_worker_second": out.total_tokens / occupied if occupied else 0.0}


def _add_ratios(rep: dict) -> None:
    """`ratios` (FlexFloor / static, and against ideal), `ratios_vs` (FlexFloor / each baseline)
    and `vs_static` (each mode / static) into a report or a per-step entry."""
    elastic, best = rep["elastic"], rep["ideal"]["tokens_per_occupied_worker_second"]
    rep["ratios"] = ratios(elastic, rep["static"])
    rep["ratios"]["elastic_over_ideal"] = (elastic["tokens_per_occupied_worker_second"] / best
                                           if best else float("nan"))
    rep["ratios"]["static_over_ideal"] = (rep["static"]["tokens_per_occupied_worker_second"] / best
                                          if best else float("nan"))
    rep["ratios_vs"] = {b: ratios(elastic, rep[b]) for b in BASELINES}
    rep["vs_static"] = {m: ratios(rep[m], rep["static"]) for m in MODES}


def check_targets(report: dict, targets: dict) -> dict:
    base = targets["baseline"]
    r = report["ratios_vs"][base]
    out = {
        f"tokens_per_occupied_worker_second vs {base}": {
            "target": f">= {targets['tokens_per_occupied_worker_second']}",
            "value": r["tokens_per_occupied_worker_second"],
            "met": r["tokens_per_occupied_worker_second"] >= targets["tokens_per_occupied_worker_second"]},
        f"rollout_wall_seconds vs {base}": {
            "target": f"<= {targets['rollout_wall_seconds_max']}",
            "value": r["rollout_wall_seconds"],
            "met": r["rollout_wall_seconds"] <= targets["rollout_wall_seconds_max"]},
        "elastic_over_ideal": {
            "target": f">= {targets['elastic_over_ideal_min']}",
            "value": report["ratios"]["elastic_over_ideal"],
            "met": report["ratios"]["elastic_over_ideal"] >= targets["elastic_over_ideal_min"]},
        f"{base} tail_fraction": {
            "target": f"about {targets['static_tail_fraction_about']:.2f}",
            "value": report[base]["tail_fraction"],
            "met": abs(report[base]["tail_fraction"] - targets["static_tail_fraction_about"]) <= 0.05},
    }
    return out


def sweep(sc: Scenario, gpus: list[int], sigmas: list[float], *,
          params: CostParams = CostParams()) -> list[dict]:
    """The scenario over cluster sizes (prompts scaled with the GPUs: the same responses per GPU)
    and tail heaviness (the lognormal sigma): `sweep_scenarios`, each run."""
    rows = []
    for s in sweep_scenarios(sc, gpus, sigmas):
        n, sigma = s.gpus, s.length_params["sigma"]
        rep = run(s, params=params)
        per = "GPU-second" if s.accelerator else "worker-step (UnitCost)"
        print(f"  {n} gpus, sigma {sigma}: x{rep['ratios']['tokens_per_occupied_worker_second']:.3f}"
              f" tokens per occupied {per}, wall x{rep['ratios']['rollout_wall_seconds']:.3f}",
              flush=True)
        rows.append({"gpus": n, "sigma": sigma, "num_prompts": s.num_prompts,
                     "p99_over_p50": rep["workload"]["p99_over_p50"],
                     "static_tail_fraction": rep["static"]["tail_fraction"],
                     **{k: rep["ratios"][k] for k in (
                         "tokens_per_occupied_worker_second", "rollout_wall_seconds",
                         "elastic_over_ideal")}})
    return rows


def sweep_scenarios(sc: Scenario, gpus: list[int], sigmas: list[float]) -> list[Scenario]:
    """`sc` at each GPU count (its prompts scaled with the GPUs) and lognormal sigma."""
    per_gpu = sc.num_prompts / sc.gpus
    return [sc.with_overrides(gpus=n, num_prompts=max(1, math.ceil(per_gpu * n)),
                              length_params={**sc.length_params, "sigma": sigma}, targets={})
            for n in gpus for sigma in sigmas]
