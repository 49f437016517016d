"""Tail consolidation on 4 gloo workers, one launch: the same requests under the static policy
and under the elastic policy with consolidation on, at R = 1 (moves inside the world-wide group,
one of them chained: a request moved twice) and R = 2 (moves inside a replica and across
replicas through the job's store), greedy and sampled; then R = 2 with the simulator's hedge
and correction, once where nothing is late and twice where a late replica corrects (on the
step clock, and on a modelled clock); then R = 2 on a modelled clock under a real cost model;
then R = 2 with every request predicted from its prompt's history (the plan's estimates); last,
R = 2 with a request arriving from the other replica on one rank of a replica at the very
boundary where another of its ranks could give its requests away inside the replica.

Usage: torchrun --nproc-per-node 4 tests/workers/tails.py OUT_DIR
"""

import dataclasses
import os
import pickle
import signal
import threading
import time

import torch
from _harness import gather, rollout_outcome as rollout, run

from flexfloor.config import ElasticConfig, ModelConfig, ReleasePolicy, RolloutConfig
from flexfloor.model import build_model
from flexfloor.parallel import Parallel
from flexfloor.rollout.scheduler import LengthHistory, Predictor, RolloutPlan
from flexfloor.rollout.stack import RolloutStack
from flexfloor.rollout.tails import RunningEstimates, may_give_within
from flexfloor.rollout.types import Request, SamplingParams

SAMPLING = {"greedy": SamplingParams(greedy=True),
            "sampled": SamplingParams(temperature=1.0, top_p=0.95)}
# response lengths per rank, one prompt per request (no siblings: the engine predicts from the
# produced tokens alone, as the simulator's replay does).
# R = 1: rank 3's one request goes to rank 0 at the first boundary with running requests; rank
# 0 is down to two requests (its own long one and rank 3's) while ranks 1 and 2 still run
# three, so it hands both on: rank 3's request moves twice.
WORLD = {0: [26, 4, 4], 1: [30, 24, 18], 2: [28, 22, 16], 3: [20]}
# R = 2, replicas (0, 1) and (2, 3): replica 0 runs six long requests; ranks 2 and 3 run one
# prompt of three samples each (a list: one prompt's samples): two end after 2 tokens, so the
# third is predicted short from its siblings and replica 1 hands the two over. The replicas run
# on their own clocks (on a loaded machine one pair of processes can be tens of steps ahead of
# the other), so the hand-over must save steps wherever it lands: replica 1's tail (60 steps)
# is long, so it saves its ranks' steps even when replica 0 posts its first state tens of steps
# late; replica 0's work (90 steps) is longer still, so the moved requests (under 60 tokens
# left) end inside it even when replica 0 is tens of steps ahead (worked out in
# tests/test_tails.py, test_a_replica_hands_its_requests_to_the_other_and_leaves)
REPLICAS = {0: [90, 88, 86], 1: [89, 87, 85], 2: [[2, 2, 60]], 3: [[2, 2, 58]]}
CONSOLIDATE = {1: ElasticConfig(consolidate=True, consolidate_max_requests=2),
               # two ranks per replica stay: replica 1 can only give to replica 0, whenever its
               # leader sees replica 0's state (the replicas run on their own clocks)
               2: ElasticConfig(consolidate=True, consolidate_max_requests=2, min_active_ranks=2,
                                consolidate_across=True)}
MAX_NEW = {1: 48, 2: 96}  # the requests' cap at R = 1 and R = 2
# R = 2 again (sampled), with the simulator's hedge and correction (flexfloor/rollout/tails.py)
# and an end to keep that no replica passes (each checks its end from half that on: the
# correction's protocol runs, nothing is late). Replica 0's own requests have no finished
# sibling: their estimate is their cap, a bound, so the hedge adds nothing and replica 1 gives
HEDGED = dataclasses.replace(CONSOLIDATE[2], consolidate_correct=True,
                             consolidate_taker_hedge=1.25)
END_BOUND = 120.0  # engine steps: checked from step 60 on, every 1.2 steps; no replica is late
# R = 2 once more (sampled, HEDGED's rules), the correction made (`tails.Across.CORRECT`): with
# no sibling a request's estimate is its cap, so replica 0 is predicted to end at step 96 (rank
# 0's request), past LATE_BOUND, and at 88 without it (rank 1's). On the step clock the taker's
# end counts the moved request twice over (the correction's hedge), so replica 1 (four requests
# capped at 30) takes it at replica 0's step c0 only from its own step c1 <= 2 c0 - 102: a
# replica well behind. The replicas run on their own clocks, and how far apart they are is the
# machine's (one can run twenty steps while the other runs one), so the worker sets it, with the
# processes' own stop and continue signals (`Conductor`): replica 1 starts once replica 0
# posted step LAG, replica 0 waits until replica 1 posted a state without a queue, replica 1
# then waits until replica 0's leader wrote to its inbox: replica 0 decides on those states
CORRECTED = {0: [96], 1: [88], 2: [28, 26], 3: [28, 24]}
CORRECTED_CAP = {0: 96, 1: 88, 2: 30, 3: 30}
LATE_BOUND = 90.0  # engine steps: checked from step 45 on, every step
LAG = 62
# the same correction with the replicas on a modelled clock (`tails.ModelledClock`, a plan by
# seconds' clock) under the unit cost model (every step 1 s): the same decisions as on the step
# clock, where each step is priced from the step report's traced loads, once
MODELLED = dataclasses.replace(HEDGED, pace_model="unit")
# R = 2 on a modelled clock under a real cost model (H800, the run's own model shape), the
# requests of REPLICAS: every step of a replica priced from the traced loads its step report
# carries, which the test checks against `price_trace` of the replica's ranks' own traces
PRICED = dataclasses.replace(HEDGED, pace_model="H800")
# R = 2 with the rollout's plan predicting every request from its history
# (`tails.RunningEstimates`, as the trainer and the benchmark pass it with
# elastic.plan_estimates): one sample per prompt, so no sibling ever finishes. Replica 1's two
# requests are predicted 60 and 58 long, which fits inside replica 0's (predicted 120): its
# leader hands them over as soon as it sees replica 0's state, unless replica 0 runs 60 steps
# ahead. Without the plan each estimate is the cap
# (128), which fits only where replica 0 is at least 8 steps behind replica 1
HISTORY = {0: [120, 118, 116], 1: [119, 117, 115], 2: [60], 3: [58]}
HISTORY_CAP = 128
# R = 2, a request from another replica arriving on one rank of a replica at the boundary where
# another of its ranks could give inside the replica (`Gate`): every rank of the replica must
# then take the same decision (`MailboxBoundary.arrived`, the group's), else the one that
# adopted skips the consolidation inside while the other plans a move to it and waits for it.
# Replica 0: rank 0 runs one request (100 tokens), rank 1 two (100 and 8), with a batch of two,
# so rank 0 has no room on rank 1 to give to until rank 1's short request ends at its step
# ARRIVAL_AT; then either rank could give its one request to the other. Replica 1's one request
# (30 tokens; predicted from its history, as replica 0's) fits on rank 0's free slot: replica 1
# starts once replica 0 posted the step before ARRIVAL_AT, hands it over and leaves, and replica
# 0's leader reads its inbox at ARRIVAL_AT only once the request is there
ARRIVAL = {0: [100], 1: [100, 8], 2: [30], 3: []}
ARRIVAL_AT = 8
ARRIVING = ElasticConfig(consolidate=True, consolidate_max_requests=1, min_active_ranks=1,
                         consolidate_across=True)


class Conductor:
    """Sets how far apart the two replicas' clocks are for the correction's case (above), from
    what the mailbox posts on the job's store; each watcher thread reads it through a client of
    its own. `pids`: every rank's process id."""

    def __init__(self, pids):
        self.pids = pids

    @staticmethod
    def _until(what: str, ready) -> None:
        deadline = time.monotonic() + 300
        while not ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} within 300 s")
            time.sleep(0.005)

    def _signal(self, sig, ranks) -> None:
        for r in ranks:
            os.kill(self.pids[r], sig)

    def _stopped(self, r: int) -> bool:
        with open(f"/proc/{self.pids[r]}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"

    def hold(self, run) -> None:
        """Before decoding. Replica 0 waits after its step LAG until it is stopped; replica 1
        waits for replica 0's step LAG, then its leader stops replica 0 and watches replica 1's
        own posts; replica 0's leader watches its inbox."""
        me, box = int(os.environ["RANK"]), run.membership.mailbox
        stopped_at_lag = box.key("test-stopped-at-lag", 0)
        if me in (0, 1):  # replica 0 waits after posting step LAG until rank 2 has stopped it:
            boundary = box.boundary  # it is stopped there however late rank 2 looks

            def held(engine, report, rules):
                got = boundary(engine, report, rules)
                if engine.record.steps == LAG:
                    self._until("rank 2 did not stop replica 0",
                                lambda: box.store.check([stopped_at_lag]))
                return got

            box.boundary = held
        if me in (2, 3):
            self._until(f"replica 0 posted no step {LAG}",
                        lambda: (posted(box.store, box, 0) or (-1,))[0] >= LAG)
        if me == 2:
            self._signal(signal.SIGSTOP, (0, 1))
            box.store.set(stopped_at_lag, "1")
            threading.Thread(target=self._then_replica_0, args=(box,), daemon=True).start()
        elif me == 0:
            threading.Thread(target=self._then_replica_1, args=(box,), daemon=True).start()

    def _then_replica_0(self, box) -> None:
        """Replica 1's leader: once replica 1 posted a state with nothing queued, it stops and
        replica 0 goes on."""
        store = box.store.clone()

        def decoding():
            clock, states = posted(store, box, 1) or (0, [])
            return clock >= 1 and not any(s.queued for s in states)

        self._until("replica 1 posted no state without a queue", decoding)
        self._signal(signal.SIGSTOP, (3,))
        self._signal(signal.SIGCONT, (0, 1))
        self._signal(signal.SIGSTOP, (2,))

    def _then_replica_1(self, box) -> None:
        """Replica 0's leader: once it wrote to replica 1's inbox, or replica 0 is done without,
        replica 1 (stopped by then) goes on."""
        store, count = box.store.clone(), box.key("count", 1)

        def decided():
            if store.check([count]) and int(store.add(count, 0)) >= 1:
                return True
            _, states = posted(store, box, 0) or (0, [None])
            return all(s is not None and not s.running and not s.queued for s in states)

        self._until("replica 0 neither wrote to replica 1's inbox nor ended", decided)
        self._until("replica 1 did not stop", lambda: self._stopped(2) and self._stopped(3))
        self._signal(signal.SIGCONT, (2, 3))


class Gate:
    """Times the arrival's case (above) from the mailbox's own keys: replica 1 starts once
    replica 0 posted step ARRIVAL_AT - 1; replica 0's leader enters its boundary at step
    ARRIVAL_AT once replica 1's message to it is committed. Records what every rank of replica
    0 saw at each boundary: (step, arrived, its own arrivals, each rank's running requests,
    whether a rank could give inside the replica)."""

    def __init__(self):
        self.seen = []

    def hold(self, run) -> None:
        me, box = int(os.environ["RANK"]), run.membership.mailbox
        if me in (2, 3):
            Conductor._until(f"replica 0 posted no step {ARRIVAL_AT - 1}",
                             lambda: (posted(box.store, box, 0) or (-1,))[0] >= ARRIVAL_AT - 1)
            return
        boundary = box.boundary

        def timed(engine, report, rules):
            if me == 0 and engine.record.steps == ARRIVAL_AT:
                count = box.key("count", 0)
                Conductor._until("replica 1 sent replica 0 nothing", lambda: (
                    box.store.check([count]) and int(box.store.add(count, 0)) >= 1))
            got = boundary(engine, report, rules)
            self.seen.append((engine.record.steps, got.arrived, len(got.arrivals),
                              list(got.report.running), may_give_within(got.report, rules)))
            return got

        box.boundary = timed


def posted(store, box, replica: int):
    """Replica `replica`'s last post on the mailbox, (its step, its ranks' states), or None."""
    key = box.key("state", replica)
    return pickle.loads(store.get(key)) if store.check([key]) else None


def requests(lengths, rank, sampling, step, max_new):
    g = torch.Generator().manual_seed(100 * step + rank)
    out = []
    for i, n in enumerate(lengths[rank]):
        prompt = tuple(torch.randint(1, 128, (3 + i,), generator=g).tolist())
        out += [Request(prompt_uid=rank * 10 + i, sample_index=s, seed=3, step=step,
                        prompt_ids=prompt, max_new_tokens=max_new, target_len=m,
                        sampling=sampling)
                for s, m in enumerate(n if isinstance(n, list) else [n])]
    return out


def history_estimates(lengths) -> RunningEstimates:
    """The estimates of a plan whose every prompt (`requests`' uids) was seen one rollout
    before at the lengths it now runs to."""
    history = LengthHistory()
    predicted = {}
    for rank, ns in lengths.items():
        for i, n in enumerate(ns):
            history.record(rank * 10 + i, [n])
            predicted[rank * 10 + i] = float(n)
    plan = RolloutPlan(assignment={}, predicted=predicted,
                       sources={"history": len(predicted)}, expected_finish={})
    return RunningEstimates.of_plan(plan, Predictor(history))


def main(out):
    rank = int(os.environ["RANK"])
    par = Parallel.build(expert_parallel_size=4, timeout_s=60)
    model = build_model(dataclasses.replace(ModelConfig(), num_experts=8), par)
    stacks = {r: RolloutStack.build(par, model, elastic=CONSOLIDATE[r], rollout=RolloutConfig(
        replicas=r, max_batch_size=8, progress=False)) for r in (1, 2)}
    results = {"world": WORLD, "replicas": REPLICAS, "max_new_tokens": MAX_NEW[1]}
    for kind, sampling in SAMPLING.items():
        for r, lengths in ((1, WORLD), (2, REPLICAS)):
            reqs = requests(lengths, rank, sampling, step=r, max_new=MAX_NEW[r])
            runs = {"static": rollout(stacks[r], ReleasePolicy.STATIC, reqs),
                    "elastic": rollout(stacks[r], ReleasePolicy.ELASTIC, reqs)}
            if r == 2 and kind == "sampled":  # the same stack (layout, engine), other rules
                runs["hedged"] = rollout(dataclasses.replace(stacks[r], elastic=HEDGED),
                                         ReleasePolicy.ELASTIC, reqs, end_bound=END_BOUND)
            results[f"r{r}_{kind}"] = gather(runs)
    reqs = requests(CORRECTED, rank, SAMPLING["sampled"], step=3, max_new=CORRECTED_CAP[rank])
    conductor = Conductor(gather(os.getpid()))
    runs = {"static": rollout(stacks[2], ReleasePolicy.STATIC, reqs),
            "corrected": rollout(dataclasses.replace(stacks[2], elastic=HEDGED),
                                 ReleasePolicy.ELASTIC, reqs, hold=conductor.hold,
                                 end_bound=LATE_BOUND)}
    results["corrected"] = gather(runs)
    results["corrected_lengths"] = CORRECTED
    started = []
    conductor = Conductor(gather(os.getpid()))
    runs = {"static": rollout(stacks[2], ReleasePolicy.STATIC, reqs),
            "corrected": rollout(dataclasses.replace(stacks[2], elastic=MODELLED),
                                 ReleasePolicy.ELASTIC, reqs, end_bound=LATE_BOUND,
                                 modelled_clock=True,
                                 hold=lambda run: (started.append(run), conductor.hold(run)))}
    clock = started[0].membership.mailbox.clock
    runs["clock"] = {"seconds": clock.seconds, "priced": clock.priced}
    results["corrected_modelled"] = gather(runs)
    reqs = requests(REPLICAS, rank, SAMPLING["sampled"], step=4, max_new=MAX_NEW[2])
    started = []
    runs = {"static": rollout(stacks[2], ReleasePolicy.STATIC, reqs),
            "priced": rollout(dataclasses.replace(stacks[2], elastic=PRICED),
                              ReleasePolicy.ELASTIC, reqs, modelled_clock=True,
                              hold=started.append)}
    clock = started[0].membership.mailbox.clock
    runs["clock"] = {"seconds": clock.seconds, "priced": clock.priced}
    runs["model_shape"] = stacks[2].layout.model_shape
    results["priced"] = gather(runs)
    reqs = requests(HISTORY, rank, SAMPLING["sampled"], step=5, max_new=HISTORY_CAP)
    runs = {"static": rollout(stacks[2], ReleasePolicy.STATIC, reqs),
            "history": rollout(stacks[2], ReleasePolicy.ELASTIC, reqs,
                               estimates=history_estimates(HISTORY))}
    results["history"] = gather(runs)
    results["history_lengths"] = HISTORY
    stacks["arrival"] = RolloutStack.build(par, model, elastic=ARRIVING, rollout=RolloutConfig(
        replicas=2, max_batch_size=2, progress=False))
    reqs = requests(ARRIVAL, rank, SAMPLING["sampled"], step=6, max_new=HISTORY_CAP)
    gate = Gate()
    runs = {"static": rollout(stacks["arrival"], ReleasePolicy.STATIC, reqs),
            "arrival": rollout(stacks["arrival"], ReleasePolicy.ELASTIC, reqs, hold=gate.hold,
                               estimates=history_estimates(ARRIVAL)),
            "seen": gate.seen}
    results["arrival"] = gather(runs)
    results["arrival_lengths"] = ARRIVAL
    for stack in stacks.values():
        stack.close()
    return results


if __name__ == "__main__":
    run(main)
