"""Scenarios: a cluster, a model, a length workload and the policies; `run()` simulates them.

Per epoch, the static baseline (`PlacementPolicy.BASELINE` + static EP) and FlexFloor
(`PlacementPolicy.FLEXFLOOR` + `ElasticMembership`) roll out the same requests. The scheduler
objects are the trainer's (`flexfloor.rollout.scheduler.Scheduler`): FlexFloor's learns the
lengths of each epoch and places the next from that history. Headline figures sum epochs 2..E (as
`tools/bench_rollout.py` does) under the same metric names, plus:
- `ideal`: FlexFloor's schedule with every rank released the moment its own last response ends
  (no idle-but-occupied time at all): the bound release can approach;
- `ratios`: FlexFloor / static (and FlexFloor / ideal).
"""

from __future__ import annotations

import dataclasses
import math
import types
from dataclasses import dataclass, field
from typing import Optional

from flexfloor.config import MODEL_PRESETS, PlacementPolicy
from flexfloor.rollout.elastic import ElasticMembership, RankLimits
from flexfloor.rollout.metrics import metrics_from_counts, ratios, summed_records
from flexfloor.rollout.scheduler import LengthHistory, MemoryModel, PromptGroup, Scheduler
from flexfloor.rollout.types import Request
from flexfloor.rollout.workload import epoch_order, make_lengths, make_prompts, tail_stats
from flexfloor.sim.cost import CostParams, RooflineCost, UnitCost, kv_budget_bytes
from flexfloor.sim.hardware import ACCELERATORS, ModelShape
from flexfloor.sim.rollout import SimRequest, initial_state, simulate_rollout


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    model: str = "tiny"  # a model preset (flexfloor.config.MODEL_PRESETS) or deepseek-v3
    accelerator: Optional[str] = None  # key of ACCELERATORS; None: every step costs 1 (UnitCost)
    gpus: int = 4
    num_prompts: int = 32
    samples_per_prompt: int = 8
    epochs: int = 4
    length_dist: str = "lognormal"
    length_params: dict = field(default_factory=dict)  # workload parameters (see workload.py)
    max_len: int = 200  # response cap, tokens
    prompt_len: tuple[int, int] = (4, 8)
    max_batch_size: Optional[int] = None  # per rank; None: every request of the rollout
    kv_budget_tokens: Optional[int] = None  # per rank; None: from HBM (or unbounded on UnitCost)
    min_active_ranks: int = 1
    migrate_max_requests: int = 0
    # FlexFloor placement (flexfloor.config.SchedulerConfig): the product defaults; on
    # accelerators, a rank takes no more than its fair share of groups and keeps its peak KV load
    # under 0.7 of the baseline's fullest rank, so lockstep steps stay as fast as the baseline's
    max_share: float = 2.0
    load_cap: Optional[float] = None
    training_ep: Optional[int] = None  # None: gcd(gpus, experts)
    seed: int = 0
    # the paper's figures, checked and printed for scenarios that reproduce its setting
    targets: dict = field(default_factory=dict)

    def with_overrides(self, **kw) -> "Scenario":
        unknown = sorted(set(kw) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"scenario has no field {unknown}")
        return dataclasses.replace(self, **kw)


PAPER_TARGETS = {"tokens_per_occupied_worker_second": 1.65, "rollout_wall_seconds_max": 1.0,
                 "elastic_over_ideal_min": 0.85, "static_tail_fraction_about": 1 / 3}

# the policies a GPU deployment runs: placement for memory-bound lockstep decoding (see Scenario),
# and a floor of one node: the last survivors exchange tokens over NVLink only
ON_GPUS = dict(max_share=1.0, load_cap=0.7, min_active_ranks=8)

SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    Scenario(
        "tiny-cpu", "The CPU benchmark's setting (tools/bench_rollout.py defaults): tiny MoE, 4 "
        "ranks, lognormal lengths, every step costs 1. Its steps equal the real engine's."),
    Scenario(
        "paper-like",
        "Qwen3-30B-A3B-shaped model on 64 H800 (8 nodes), 512 prompts x 8 samples per rollout, "
        "long-tailed responses up to 16k tokens (static tail fraction about 1/3, as the paper saw)",
        model="qwen3-30b-a3b", accelerator="H800", gpus=64, num_prompts=512, samples_per_prompt=8,
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


def run(sc: Scenario, *, params: CostParams = CostParams()) -> dict:
    """Simulate every epoch of `sc` in both modes; the report `tools/simulate.py` writes."""
    shape = ModelShape.from_preset(sc.model)
    lengths = make_lengths(sc.length_dist, num_prompts=sc.num_prompts,
                           samples_per_prompt=sc.samples_per_prompt, epochs=sc.epochs,
                           seed=sc.seed, max_len=sc.max_len, **sc.length_params)
    vocab = MODEL_PRESETS[sc.model]["vocab_size"] if sc.model in MODEL_PRESETS else 129280
    prompts = make_prompts(sc.num_prompts, sc.prompt_len, vocab, sc.seed)
    placement, holding = initial_state(shape.num_experts, sc.gpus, sc.training_ep)
    max_batch = sc.max_batch_size or sc.num_prompts * sc.samples_per_prompt
    max_seq_len = sc.prompt_len[1] + sc.max_len
    if sc.accelerator is None:
        # the engine's own numbers: an fp32 model of the preset on CPU (the benchmark's)
        if sc.model not in MODEL_PRESETS:
            raise ValueError(f"model {sc.model!r} on UnitCost: use a model preset")
        model_cfg = types.SimpleNamespace(**MODEL_PRESETS[sc.model])
        memory = MemoryModel.from_model_config(model_cfg, kv_budget_tokens=sc.kv_budget_tokens)
        cost = UnitCost()
        max_seq_len = max(model_cfg.max_seq_len, max_seq_len)
    else:
        if sc.accelerator not in ACCELERATORS:
            raise ValueError(f"unknown accelerator {sc.accelerator!r}; choose one of "
                             f"{sorted(ACCELERATORS)}")
        accel = ACCELERATORS[sc.accelerator]
        most = max(len(placement.experts_of(r)) for r in range(sc.gpus))
        budget = (sc.kv_budget_tokens * shape.kv_bytes_per_token if sc.kv_budget_tokens
                  else kv_budget_bytes(accel, shape, most, params))
        memory = MemoryModel(kv_bytes_per_token=shape.kv_bytes_per_token,
                             expert_bytes=shape.expert_bytes, kv_budget_bytes=budget)
        cost = RooflineCost(accel, shape, params)
    limits = RankLimits(kv_bytes_per_token=memory.kv_bytes_per_token, max_seq_len=max_seq_len,
                        max_batch_size=max_batch, kv_budget_bytes=memory.kv_budget_bytes,
                        expert_nbytes=memory.expert_bytes)
    longest = sc.prompt_len[1] + int(lengths.max())
    if memory.kv_budget_bytes is not None and longest * memory.kv_bytes_per_token > memory.kv_budget_bytes:
        raise ValueError(f"kv budget of {memory.kv_budget_bytes // memory.kv_bytes_per_token} "
                         f"tokens per rank cannot hold the longest request ({longest} tokens)")
    schedulers = {
        "static": Scheduler(PlacementPolicy.BASELINE, memory=memory, max_batch_size=max_batch),
        "elastic": Scheduler(PlacementPolicy.FLEXFLOOR, LengthHistory(), memory=memory,
                             max_batch_size=max_batch, max_share=sc.max_share,
                             load_cap=sc.load_cap),
    }
    per_epoch, kept = [], []
    for epoch in range(1, sc.epochs + 1):
        groups = [PromptGroup(uid, tuple(
            Request(prompt_uid=uid, sample_index=s, prompt_ids=prompts[uid],
                    max_new_tokens=sc.max_len, target_len=int(lengths[epoch - 1, uid, s]))
            for s in range(sc.samples_per_prompt))) for uid in epoch_order(sc.num_prompts, sc.seed, epoch)]
        entry, outs = {"epoch": epoch}, {}
        for mode, scheduler in schedulers.items():
            plan = scheduler.plan(groups, range(sc.gpus))
            assignment = {r: [SimRequest(q.request_id, q.prompt_uid, len(q.prompt_ids), q.target_len)
                              for q in reqs] for r, reqs in plan.assignment.items()}
            membership = None if mode == "static" else ElasticMembership(
                parallel=None, min_active_ranks=sc.min_active_ranks, holding=holding,
                migrate_max_requests=sc.migrate_max_requests)
            out = simulate_rollout(assignment, membership, cost, limits=limits,
                                   placement=placement)
            m = metrics_from_counts(out.records, total_tokens=out.total_tokens,
                                    num_responses=out.num_responses)
            m["timeline"] = out.timeline
            entry[mode], outs[mode] = m, out
        entry["ideal"] = ideal(outs["elastic"])
        entry["ratios"] = _ratios(entry["elastic"], entry["static"], entry["ideal"])
        for uid in sorted(outs["elastic"].lengths):
            schedulers["elastic"].history.record(uid, outs["elastic"].lengths[uid])
        per_epoch.append(entry)
        if epoch > 1 or sc.epochs == 1:
            kept.append(outs)
    report = {"scenario": dataclasses.asdict(sc), "unit": cost.unit,
              "summary_epochs": [e["epoch"] for e in per_epoch if e["epoch"] > 1 or sc.epochs == 1],
              "model": {"name": shape.name, "total_params": shape.total_params,
                        "expert_bytes": shape.expert_bytes, "dense_bytes": shape.dense_bytes,
                        "kv_bytes_per_token": memory.kv_bytes_per_token},
              "memory": {"kv_budget_bytes_per_rank": memory.kv_budget_bytes,
                         "kv_budget_tokens_per_rank": (memory.kv_budget_bytes // memory.kv_bytes_per_token
                                                       if memory.kv_budget_bytes else None),
                         "max_batch_size": max_batch},
              "workload": tail_stats(lengths)}
    if sc.accelerator:
        report["accelerator"] = dataclasses.asdict(ACCELERATORS[sc.accelerator])
        report["cost_params"] = dataclasses.asdict(params)
    for mode in ("static", "elastic"):
        outs = [k[mode] for k in kept]
        m = metrics_from_counts(summed_records([o.records for o in outs]),
                                total_tokens=sum(o.total_tokens for o in outs),
                                num_responses=sum(o.num_responses for o in outs))
        m.pop("released_ranks")
        m.pop("responses_sha256")
        chosen = [e for e in per_epoch if e["epoch"] in report["summary_epochs"]]
        m["rollout_wall_seconds"] = sum(e[mode]["rollout_wall_seconds"] for e in chosen)
        m["rollout_wall_steps"] = sum(e[mode]["rollout_wall_steps"] for e in chosen)
        report[mode] = m
    tokens = report["elastic"]["total_response_tokens"]
    occupied = sum(e["ideal"]["occupied_worker_seconds"] for e in per_epoch
                   if e["epoch"] in report["summary_epochs"])
    report["ideal"] = {"occupied_worker_seconds": occupied,
                       "tokens_per_occupied_worker_second": tokens / occupied if occupied else 0.0}
    report["ratios"] = _ratios(report["elastic"], report["static"], report["ideal"])
    report["per_epoch"] = per_epoch
    if sc.targets:
        report["targets"] = check_targets(report, sc.targets)
    return report


def ideal(out) -> dict:
    """Every rank occupied exactly until its own last response ends."""
    occupied = sum(r["local_finish_s"] for r in out.records)
    return {"occupied_worker_seconds": occupied,
            "tokens_per_occupied_worker_second": out.total_tokens / occupied if occupied else 0.0}


def _ratios(elastic: dict, static: dict, ideal_: dict) -> dict:
    r = ratios(elastic, static)
    best = ideal_["tokens_per_occupied_worker_second"]
    r["elastic_over_ideal"] = elastic["tokens_per_occupied_worker_second"] / best if best else float("nan")
    r["static_over_ideal"] = static["tokens_per_occupied_worker_second"] / best if best else float("nan")
    return r


def check_targets(report: dict, targets: dict) -> dict:
    r = report["ratios"]
    out = {
        "tokens_per_occupied_worker_second": {
            "target": f">= {targets['tokens_per_occupied_worker_second']}",
            "value": r["tokens_per_occupied_worker_second"],
            "met": r["tokens_per_occupied_worker_second"] >= targets["tokens_per_occupied_worker_second"]},
        "rollout_wall_seconds": {
            "target": f"<= {targets['rollout_wall_seconds_max']}",
            "value": r["rollout_wall_seconds"],
            "met": r["rollout_wall_seconds"] <= targets["rollout_wall_seconds_max"]},
        "elastic_over_ideal": {
            "target": f">= {targets['elastic_over_ideal_min']}", "value": r["elastic_over_ideal"],
            "met": r["elastic_over_ideal"] >= targets["elastic_over_ideal_min"]},
        "static_tail_fraction": {
            "target": f"about {targets['static_tail_fraction_about']:.2f}",
            "value": report["static"]["tail_fraction"],
            "met": abs(report["static"]["tail_fraction"] - targets["static_tail_fraction_about"]) <= 0.05},
    }
    return out


def sweep(sc: Scenario, gpus: list[int], sigmas: list[float], *,
          params: CostParams = CostParams()) -> list[dict]:
    """The scenario over cluster sizes (prompts scaled with the GPUs: the same responses per GPU)
    and tail heaviness (the lognormal sigma)."""
    rows = []
    per_gpu = sc.num_prompts / sc.gpus
    for n in gpus:
        for sigma in sigmas:
            s = sc.with_overrides(gpus=n, num_prompts=max(1, math.ceil(per_gpu * n)),
                                  length_params={**sc.length_params, "sigma": sigma}, targets={})
            rep = run(s, params=params)
            print(f"  {n} gpus, sigma {sigma}: x{rep['ratios']['tokens_per_occupied_worker_second']:.3f}"
                  f" tokens per occupied GPU-second, wall x{rep['ratios']['rollout_wall_seconds']:.3f}",
                  flush=True)
            rows.append({"gpus": n, "sigma": sigma, "num_prompts": s.num_prompts,
                         "p99_over_p50": rep["workload"]["p99_over_p50"],
                         "static_tail_fraction": rep["static"]["tail_fraction"],
                         **{k: rep["ratios"][k] for k in (
                             "tokens_per_occupied_worker_second", "rollout_wall_seconds",
                             "elastic_over_ideal")}})
    return rows
