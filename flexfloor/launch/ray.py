"""Ray launcher: workers as Ray actors in a placement group, this process drives the step loop.

    python -m flexfloor.launch.ray --config FILE --num-workers N [--address HOST:PORT]
        [--cpus-per-worker C] [--gpus-per-worker G] [--max-restarts N] [section.field=value ...]

One bundle per worker ({"CPU": C} or {"CPU": C, "GPU": G}), PACK strategy, so workers fill a node
before the next. Ranks follow the nodes (a node's workers hold consecutive ranks); rank 0 serves
the job's TCP store on a port the OS picks (as torchrun's agent does: no port is picked first and
bound later, when another process may hold it) and reports its node's IP and that port; every
worker sets the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), initialises torch.distributed on that store and builds a `Job`. The driver calls
each phase on every worker (warm start, step, close) and reads rank 0's metrics; a worker that
dies or fails ends the run with an error naming its rank (with `--max-restarts N`, every worker
is started again and resumes from `checkpoint.dir`, up to N times), and every wait has a timeout.
Released workers are reported to the resource pool (`flexfloor.launch.pool`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

from flexfloor import faults
from flexfloor.launch.local import PREEMPTED as PREEMPTED_EXIT_CODE
from flexfloor.launch.local import Saved, stopped_when, to_go_on
from flexfloor.launch.pool import NAMESPACE, POOL_NAME, ResourcePool
from flexfloor.launch.reaper import start_reaper

PREDECESSOR_ENV = "FLEXFLOOR_LOCK_PREDECESSOR"  # flexfloor.checkpoint's (not imported: torch)
HEAD_RESOURCE = "node:__internal_head__"  # the resource only Ray's head node has
# after a worker's call fails, how long its peers' calls may take to fail too, so that a worker
# that died is named, not a peer that failed for it: a crashed node's workers are reported
# dead once Ray's health checks find the node dead (about 15 s by default)
DEATH_GRACE_S = 30.0


class StopEvent(threading.Event):
    """The driver's stop signal: an Event that remembers when it was first set
    (`time.monotonic()`), where the grace for the save (`checkpoint.preempt_grace_s`) starts."""

    at: float | None = None
    name: str | None = None  # the signal's, e.g. "SIGTERM"

    def set(self) -> None:
        if self.at is None:
            self.at = time.monotonic()
        super().set()


class StopWhileWaiting(Exception):
    """A stop signal came while the launcher waited for the workers' placement or start-up,
    with no step running: nothing to save."""


class LaunchError(RuntimeError):
    """The run cannot go on. `worker_lost`: a worker died or raised (a restart may resume the
    run), not a placement or a timeout; `worker_died`: one died (its process or node is gone)."""

    def __init__(self, message: str, worker_lost: bool = False, worker_died: bool = False,
                 grace_expired: bool = False):
        super().__init__(message)
        self.worker_lost = worker_lost
        self.worker_died = worker_died
        self.grace_expired = grace_expired  # a stop's step and save outlasted its grace


@dataclass(frozen=True)
class _Grace:
    """After a stop signal (`stop` set), the step in progress and its save must end within
    `grace_s` of the signal (checkpoint.preempt_grace_s, as each worker under torchrun keeps
    it): past that the run ends unsaved rather than be killed mid-save by whoever signalled."""

    stop: StopEvent | None
    grace_s: float

    def due(self) -> float | None:
        """The deadline (time.monotonic()) once a stop came, else None."""
        if self.stop is None or not self.stop.is_set():
            return None
        return self.stop.at + self.grace_s


class Worker:
    """One FlexFloor worker (one rank) as a Ray actor."""

    def __init__(self, pool_name: str):
        import ray

        self.pool = ray.get_actor(pool_name, namespace=NAMESPACE)
        ctx = ray.get_runtime_context()
        self.where = {
            "node_id": ctx.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cpus": ctx.get_assigned_resources().get("CPU", 0.0),
        }
        self.job = None
        self._store = None  # rank 0's: the job's TCP store (`host_store`)
        self._released = False
        self._reports = []  # pool updates in flight

    def locate(self) -> dict:
        return self.where

    def host_store(self, timeout_s: float) -> int:
        """Serve the job's TCP store from this actor (rank 0's) on a port the OS picks; returns
        the port."""
        import datetime

        import torch.distributed as dist

        self._store = dist.TCPStore(self.where["node_ip"], 0, is_master=True,
                                    wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        return self._store.port

    def start(self, cfg, *, env: dict, cwd: str) -> dict:
        """torch.distributed among the workers, then the Job. Returns where the Job stands: its
        step index (a resumed run starts past 0), whether it needs the warm start, whether it
        is done."""
        import datetime
        import warnings

        warnings.filterwarnings("ignore", module="megatron")
        os.environ.update(env)
        start_reaper()  # Ray ends this actor, not the helpers it starts (a checkpoint writer)
        if os.path.isdir(cwd):  # relative paths in the config mean what they mean to the driver
            os.chdir(cwd)
        import torch
        import torch.distributed as dist

        from flexfloor.coordinator import Job

        backend = cfg.parallel.backend.value
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            # Ray makes only this worker's accelerator visible, so it is device 0 whatever
            # LOCAL_RANK says; the launcher opens the world group so Job reuses it as is.
            torch.cuda.set_device(0)
        timeout = datetime.timedelta(seconds=cfg.parallel.timeout_s)
        store = self._store or dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]),
                                             is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=int(env["RANK"]),
                                world_size=int(env["WORLD_SIZE"]), timeout=timeout)
        self.job = Job(cfg)
        self.job.on_release_event = self._report
        # a restart's rank 0: the metrics.jsonl lines the resumed run keeps (steps done)
        restarted = env.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
        logged = self.job.log.kept if restarted and self.job.rank == 0 else None
        return {"step": self.job.step_index, "warm_start": self.job.needs_warm_start(),
                "done": self.job.done(), "logged": logged}

    def warm_start(self) -> bool:
        """The supervised warm start. It ends early (False), nothing cached, once the driver
        took a stop signal (`ResourcePool.stopping`, asked after each supervised step, every
        rank agreeing as under torchrun: `preemption.any_rank`)."""
        import ray

        from flexfloor.preemption import any_rank

        return self.job.warm_start(
            lambda: any_rank(ray.get(self.pool.stopping.remote()), self.job.parallel))

    def step(self):
        """One training step; rank 0 returns its metrics and whether the job is done. The pool
        is up to date on return."""
        import ray

        metrics = self.job.step()
        ray.get(self._reports)
        self._reports = []
        return (metrics, self.job.done()) if self.job.rank == 0 else None

    def save_last_step(self) -> Saved | None:
        """After a stop signal at the driver: save the last finished step (every worker: the
        save is collective); rank 0 returns what was saved (`preemption.save_last_step`)."""
        from flexfloor.preemption import save_last_step

        saved = save_last_step(self.job)
        return saved if self.job.rank == 0 else None

    def finish(self) -> None:
        import torch.distributed as dist

        self.job.log.close()
        self.job.close()
        dist.destroy_process_group()

    def _report(self, event: str, rank: int, time_s: float, engine_step: int) -> None:
        """Release listener: "released" lends this worker's devices, "rejoined" takes them back.
        Both happen inside Job.step, before it counts the step: the step is step_index + 1."""
        step = self.job.step_index + 1
        if event == "released":
            self._released = True
            entry = dict(self.where, rank=rank, step=step, engine_step=engine_step,
                         release_s=time_s)
            self._reports.append(self.pool.released.remote(entry))
        elif event == "rejoined" and self._released:
            # an async actor may run calls out of order: let the release land first (the rank
            # was idle at resync until now, so the round trip costs the job nothing)
            import ray

            ray.get(self._reports)
            self._released = False
            self._reports = [self.pool.rejoined.remote(rank, step)]


@dataclass
class RunResult:
    metrics: list[dict]                  # rank 0's metrics, one dict per step
    workers: list[dict]                  # by rank: node_id, node_ip, pid, gpu_ids, cpus, local_rank
    pool_events: list[dict] = field(default_factory=list)  # the pool's record (pool.events())
    restarts: int = 0                    # attempts after the first (`max_restarts`)
    # set when `stop` ended the run early: when ("after step 3") and what was saved (`Saved`)
    stopped: dict | None = None


def launch(cfg, *, num_workers: int, cpus_per_worker: float = 1.0,
           gpus_per_worker: float | None = None, timeout_s: float = 1800.0,
           pool_name: str = POOL_NAME, max_restarts: int = 0, say=print,
           stop: StopEvent | None = None) -> RunResult:
    """Run the job on `num_workers` Ray actors of the cluster `ray.init` connected to.

    `cfg` is resolved for `num_workers` (`Config.resolve_world`). `gpus_per_worker=None`: one GPU
    each when the cluster has GPUs, none otherwise. Every wait is bounded by `timeout_s`.
    `max_restarts`: when a worker dies or raises, every worker of the attempt is ended and a new
    set started, up to this many times (as `torchrun --max-restarts`); each new Job resumes from
    the newest complete checkpoint in `checkpoint.dir` (`checkpoint.resume=auto`), else starts
    again at step 0. The metrics of steps the resumed run does again are replaced.
    `stop` (set by the driver's SIGTERM/SIGINT): the step in progress runs to its end, every
    worker saves it (`preemption.save_last_step`) and closes, and the result's `stopped` says
    so; no restart follows a stop. The step and the save must end within
    `checkpoint.preempt_grace_s` of the signal, else a LaunchError (`grace_expired`) ends the
    run unsaved.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if max_restarts < 0:
        raise ValueError(f"max_restarts={max_restarts}: must be >= 0 (0: a lost worker ends "
                         "the run)")
    if gpus_per_worker is None:
        gpus_per_worker = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    bundle = {"CPU": cpus_per_worker, **({"GPU": gpus_per_worker} if gpus_per_worker else {})}
    # the pool lives on the head node: the cluster ends with that node anyway, and a worker
    # node lost with the pool on it would end the run that `max_restarts` could have saved
    head = [n["NodeID"] for n in ray.nodes()
            if n["Alive"] and HEAD_RESOURCE in n.get("Resources", {})]
    pool = ray.remote(num_cpus=0)(ResourcePool).options(
        name=pool_name, namespace=NAMESPACE,
        scheduling_strategy=NodeAffinitySchedulingStrategy(head[0], soft=False) if head
        else "DEFAULT").remote()
    pg = placement_group([bundle] * num_workers, strategy="PACK")
    history: list[dict] = []
    # filled in by `_attempt`: the attempt's rank 0 (host, pid), the step the first one
    # started from
    state: dict = {}
    attempt = 0
    try:
        _wait_placed(pg, bundle, time.monotonic() + timeout_s, timeout_s, say, "placement",
                     quiet_s=10, stop=stop)
        for attempt in range(max_restarts + 1):
            try:
                workers = _attempt(cfg, pg, pool, pool_name, num_workers, cpus_per_worker,
                                   gpus_per_worker, timeout_s, attempt, history, say, state,
                                   stop)
                return RunResult(metrics=history, workers=workers, restarts=attempt,
                                 pool_events=ray.get(pool.events.remote(), timeout=timeout_s),
                                 stopped=state.get("stopped"))
            except LaunchError as e:
                unplaced = _unplaced(pg)
                if unplaced and not e.worker_lost:  # a wait that ended on a lost node's bundles
                    raise LaunchError(f"{e} (the placement group has no node for the bundles "
                                      f"of workers {unplaced}: their node was lost)") from e
                if not e.worker_lost or attempt == max_restarts or (stop and stop.is_set()):
                    raise
                # the lost attempt's releases end: their workers are gone, and the new ones
                # take the same devices
                ray.get(pool.withdraw.remote(f"restart {attempt + 1}"), timeout=timeout_s)
                say(f"{e}; restart {attempt + 1} of {max_restarts}: every worker is started "
                    f"again and {_resumes(cfg)}")
                # a node that crashed keeps its bundles until Ray finds it dead; then they wait
                # for Ray to place them on another node (one --timeout-s for both)
                deadline, what = time.monotonic() + timeout_s, f"restart {attempt + 1}"
                _settle(pg, deadline, say, what, stop=stop)
                _wait_placed(pg, bundle, deadline, timeout_s, say, what,
                             ranks=state.get("rank_of_bundle", {}), stop=stop)
        raise AssertionError("unreachable")  # the last attempt returned or raised
    except StopWhileWaiting as e:  # no step was running: the newest complete checkpoint stands
        return RunResult(metrics=history, workers=[], restarts=attempt, stopped={
            "when": f"during the {e} wait", "saved": Saved.standing(
                "nothing saved (no step was running; the newest complete checkpoint stands)",
                cfg.checkpoint, here=False)})
    finally:
        ray.kill(pool)
        remove_placement_group(pg)


def _placement(pg) -> tuple[str, dict]:
    """`pg`'s state (PENDING, PREPARED, CREATED, RESCHEDULING, REMOVED) and each bundle's node
    id, by bundle index ('' for a bundle without a node)."""
    from ray.util.placement_group import placement_group_table

    table = placement_group_table(pg)
    return table["state"], dict(table["bundles_to_node_id"])


def _unplaced(pg) -> list[int]:
    """The bundles of `pg` (one per worker, by index) that have no node now: none once it is
    created; all while it waits for its first placement; those of a lost node while Ray
    places them again (state RESCHEDULING)."""
    state, nodes = _placement(pg)
    if state == "CREATED":
        return []
    return sorted(i for i, node in nodes.items() if not node)


def _answer() -> bool:
    return True


def _settle(pg, deadline: float, say, what: str, quiet_s: float = 10.0,
            stop: threading.Event | None = None) -> None:
    """Wait, up to `deadline` (time.monotonic), until each node that holds a bundle of `pg`
    answers a task or is found dead. A node that crashed holds its bundles until Ray's health
    checks find it dead (seconds); a new worker placed there before would die with it at
    start-up. Says what it waits for past `quiet_s` seconds. `stop` set: raises
    StopWhileWaiting within a second."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    held = sorted({n for n in _placement(pg)[1].values() if n} & alive)
    probe = ray.remote(num_cpus=0, max_retries=0)(_answer)
    refs = {probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False))
            .remote(): n for n in held}
    pending, start, said = list(refs), time.monotonic(), False
    try:
        while pending and time.monotonic() < deadline:  # an answer, or an error: settled
            if stop is not None and stop.is_set():
                raise StopWhileWaiting(what)
            if not said and time.monotonic() - start >= quiet_s:
                say(f"{what}: waiting up to {deadline - time.monotonic():.0f} s more for "
                    f"{len(pending)} node(s) to answer or be found dead by Ray: "
                    + ", ".join(refs[r][:8] for r in pending))
                said = True
            pending = ray.wait(pending, num_returns=len(pending),
                               timeout=max(0.0, min(1.0, deadline - time.monotonic())))[1]
    finally:
        for ref in pending:  # past the deadline: the placement's wait says the rest
            ray.cancel(ref)


def _free_resources() -> str:
    """The alive nodes and the CPUs and GPUs they have free, e.g. `2 nodes, 1 CPU, 0 GPU
    free` (placement-group shares left out: they are taken)."""
    import ray

    free = ray.available_resources()
    alive = sum(n["Alive"] for n in ray.nodes())
    return (f"{alive} node{'s' * (alive != 1)} alive, {free.get('CPU', 0):g} CPU, "
            f"{free.get('GPU', 0):g} GPU free")


def _wait_placed(pg, bundle: dict, deadline: float, timeout_s: float, say, what: str,
                 quiet_s: float = 0.0, every_s: float = 60.0, ranks: dict | None = None,
                 stop: threading.Event | None = None) -> None:
    """Wait until `pg` is created, every bundle on a node: its first placement, or Ray placing
    a lost node's bundles again (`ranks`: the rank each bundle held, named in the lines). Past
    `quiet_s` seconds it says what it waits for, and again every `every_s` seconds; at
    `deadline` (time.monotonic; `timeout_s`, the wait it ends, is named) it raises a
    LaunchError naming the bundles and the free resources, as it does for a removed group.
    `stop` set: raises StopWhileWaiting within a second."""
    start, n = time.monotonic(), len(pg.bundle_specs)

    def created(wait_s: float) -> bool:
        state = _placement(pg)[0]
        if state == "REMOVED":
            raise LaunchError(f"{what}: the placement group of the {n} workers was removed "
                              "(by another driver or `ray` command?); run again")
        if state == "CREATED" or wait_s <= 0:
            return state == "CREATED"
        try:
            return pg.wait(max(1, math.ceil(wait_s)))  # whole seconds
        except Exception as e:  # Ray raises a bare Exception for a group removed meanwhile
            if _placement(pg)[0] == "REMOVED":
                raise LaunchError(f"{what}: the placement group of the {n} workers was removed "
                                  f"while it waited ({e}); run again") from e
            raise

    if created(0):
        return
    said = None  # when it last said that it waits
    while True:
        if stop is not None and stop.is_set():
            raise StopWhileWaiting(what)
        now = time.monotonic()
        if now >= deadline:
            if created(0):
                return
            unplaced = _unplaced(pg) or list(range(n))
            raise LaunchError(
                f"{what}: Ray could not place {len(unplaced)} of {n} workers ({bundle} each, "
                f"bundles {unplaced}) within {timeout_s:g} s; the cluster has "
                f"{_free_resources()}: add a node (or let the autoscaler add one), or run again "
                "with fewer --num-workers / --cpus-per-worker / --gpus-per-worker")
        if said is None and now - start >= quiet_s:
            unplaced = _unplaced(pg) or list(range(n))
            lost = (f"; bundles {unplaced}, ranks {sorted(ranks[i] for i in unplaced)} before: "
                    "their node is gone" if ranks else "")
            say(f"{what}: waiting up to {deadline - now:.0f} s for Ray to place "
                f"{len(unplaced)} of {n} workers ({bundle} each{lost}); the cluster has "
                f"{_free_resources()}")
            said = now
        elif said is not None and now - said >= every_s:
            say(f"{what}: still waiting for {len(_unplaced(pg)) or n} bundles "
                f"({now - start:.0f} s); the cluster has {_free_resources()}")
            said = now
        chunk = min(start + quiet_s if said is None else said + every_s, deadline) - now
        if created(min(chunk, 1.0) if stop is not None else chunk):
            if said is not None and what != "placement":
                say(f"{what}: every worker's bundle is placed again after "
                    f"{time.monotonic() - start:.0f} s")
            return


def _resumes(cfg) -> str:
    """Where a restarted Job starts, as its config says (`Job` decides; this only words it)."""
    if not cfg.checkpoint.dir:
        return "starts at step 0 (no checkpoint.dir to resume from)"
    if cfg.checkpoint.resume.value == "auto":
        return f"resumes from the newest checkpoint in checkpoint.dir ({cfg.checkpoint.dir})"
    return ("starts as checkpoint.resume=off says (checkpoint.load, checkpoint.init_from, or "
            "step 0)")


def _attempt(cfg, pg, pool, pool_name: str, num_workers: int, cpus_per_worker: float,
             gpus_per_worker: float, timeout_s: float, attempt: int, history: list,
             say, state: dict, stop: StopEvent | None = None) -> list[dict]:
    """One launch attempt: `num_workers` actors in `pg`'s bundles run the job to its end.
    `history` (rank 0's metrics so far) is extended, a resumed step replacing what an earlier
    attempt logged for it; `state["rank0"]` is set to this attempt's rank 0 (host, pid) and
    `state["first_step"]` to the step the first attempt started from and
    `state["rank_of_bundle"]` to each bundle's rank; once `stop` is set, after the step in
    progress, every worker saves it and `state["stopped"]` says what (every call but the close
    within `checkpoint.preempt_grace_s` of the signal). Returns the workers by rank; the
    actors are ended in every case."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    # the lock of checkpoint.dir names the last attempt's rank 0, which this launcher ended:
    # the new rank 0 takes it over, on whichever host it runs (none on the first attempt)
    predecessor = dict(state.get("rank0", {}))
    grace = _Grace(stop, cfg.checkpoint.preempt_grace_s)
    if stop is not None and stop.is_set():  # before any worker of this attempt started
        raise StopWhileWaiting(f"restart {attempt}" if attempt else "start-up")
    actors = []
    try:
        actor_cls = ray.remote(Worker)
        actors = [actor_cls.options(
            num_cpus=cpus_per_worker, num_gpus=gpus_per_worker,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
        ).remote(pool_name) for i in range(num_workers)]
        labels = {i: f"worker {i}" for i in range(num_workers)}
        located = _gather({i: a.locate.remote() for i, a in enumerate(actors)}, labels,
                          "start-up", timeout_s, grace)
        # ranks follow the nodes: a node's workers hold consecutive ranks, as under torchrun
        nodes = list(dict.fromkeys(located[i]["node_id"] for i in range(num_workers)))
        order = sorted(range(num_workers), key=lambda i: (nodes.index(located[i]["node_id"]), i))
        actors = [actors[i] for i in order]
        workers = [dict(located[i]) for i in order]
        for rank, w in enumerate(workers):
            on_node = [r for r, o in enumerate(workers) if o["node_id"] == w["node_id"]]
            w.update(rank=rank, local_rank=on_node.index(rank), local_world_size=len(on_node))
        labels = {r: f"rank {r} (node {w['node_ip']}, pid {w['pid']})" for r, w in enumerate(workers)}
        state["rank0"] = {"host": workers[0]["host"], "pid": workers[0]["pid"]}
        state["rank_of_bundle"] = {i: rank for rank, i in enumerate(order)}
        events_before = len(ray.get(pool.events.remote(), timeout=timeout_s))
        port = _gather({0: actors[0].host_store.remote(cfg.parallel.timeout_s)}, labels,
                       "start-up", timeout_s, grace)[0]
        for w in workers:
            say(f"rank {w['rank']}: node {w['node_ip']} ({w['node_id'][:8]}) pid {w['pid']} "
                f"local rank {w['local_rank']} gpus {w['gpu_ids'] or '-'} cpus {w['cpus']:g}")
        def env(w):  # what torchrun would set for this worker (the attempt too)
            return {"RANK": str(w["rank"]), "WORLD_SIZE": str(num_workers),
                    "LOCAL_RANK": str(w["local_rank"]), "LOCAL_WORLD_SIZE": str(w["local_world_size"]),
                    "MASTER_ADDR": workers[0]["node_ip"], "MASTER_PORT": str(port),
                    "TORCHELASTIC_RESTART_COUNT": str(attempt),
                    # the reliability tests' fault plan (flexfloor.faults), as torchrun passes it
                    **({faults.ENV: os.environ[faults.ENV]} if os.environ.get(faults.ENV)
                       else {}),
                    **({PREDECESSOR_ENV: json.dumps(predecessor)} if predecessor else {})}

        job = _gather({r: a.start.remote(cfg, env=env(workers[r]), cwd=os.getcwd())
                       for r, a in enumerate(actors)}, labels, "start-up", timeout_s, grace)[0]

        def every(method: str, phase: str, *args, bounded: _Grace | None = grace, on_stop=None):
            return _gather({r: getattr(a, method).remote(*args) for r, a in enumerate(actors)},
                           labels, phase, timeout_s, bounded, on_stop)

        # Job.run's loop, each phase called on every worker; a stop during the warm start
        # (minutes in the main job) ends it after the supervised step in progress
        if job["warm_start"] and not (stop is not None and stop.is_set()):
            every("warm_start", "warm start", on_stop=lambda: pool.stop.remote())
        step, done = job["step"], job["done"]
        first = state.setdefault("first_step", step)
        if attempt:  # this launch's steps the resumed run keeps, as metrics.jsonl has them: also
            # a step whose checkpoint was complete when a worker died, before it returned
            history[:] = [m for m in job["logged"] or [] if first < m["step"] <= step]
        while not done:
            if stop is not None and stop.is_set():  # a stop signal: save this step, then close
                saved = every("save_last_step", "the stop's save")[0]
                state["stopped"] = {"when": stopped_when(step), "saved": saved}
                break
            t0 = time.perf_counter()
            m, done = every("step", f"step {step + 1}")[0]
            step = m["step"]
            history.append(m)
            # a step with validation has two rollouts, and a rank may be lent in each: name it once
            # (this attempt's: a step done again after a restart was lent anew)
            events = ray.get(pool.events.remote(), timeout=timeout_s)[events_before:]
            lent = sorted({e["rank"] for e in events
                           if e["event"] == "released" and e["step"] == step})
            say(f"step {step}/{cfg.trainer.steps} | reward {m['reward/mean']:.3f} | "
                f"released ranks {lent or '-'} (lent to the pool until resync) | "
                f"{time.perf_counter() - t0:.1f}s")
        every("finish", "close", bounded=None)  # saved already: the close has --timeout-s
        return workers
    finally:
        for a in actors:
            ray.kill(a)
        _wait_ended(actors, timeout_s)


def _wait_ended(actors: list, timeout_s: float) -> None:
    """Wait until Ray reports each of `actors` (killed) dead, up to `timeout_s` in all. (Its
    process may still be exiting then; Ray frees the actor's bundle once it has, and a new
    actor placed in that bundle starts after.)"""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    deadline = time.monotonic() + timeout_s
    for a in actors:
        while time.monotonic() < deadline:
            try:  # a killed actor may still answer a call or two before Ray reports it dead
                ray.get(a.locate.remote(), timeout=max(0.1, deadline - time.monotonic()))
            except RayActorError:
                break
            except GetTimeoutError:
                return
            time.sleep(0.05)


def _gather(calls: dict, labels: dict, phase: str, timeout_s: float,
            grace: _Grace | None = None, on_stop=None) -> dict:
    """Results of one call per worker, by key. The first failure ends the wait with an error
    naming the worker; a dead worker is named before the peers that failed because of it.
    `grace`: once its stop comes, the wait ends at its deadline too (`grace_expired`), and
    `on_stop()` is called once (e.g. to tell the workers)."""
    import ray
    from ray.exceptions import RayActorError

    pending = {ref: key for key, ref in calls.items()}
    results, failures = {}, {}
    deadline = time.monotonic() + timeout_s
    while pending and not failures:
        due = grace.due() if grace is not None else None
        if due is not None and on_stop is not None:
            on_stop()
            on_stop = None
        until = deadline if due is None else min(deadline, due)
        if grace is not None and grace.stop is not None and due is None:
            until = min(until, time.monotonic() + 1.0)  # a stop may come: look each second
        ready, _ = ray.wait(list(pending), num_returns=1,
                            timeout=max(0.0, until - time.monotonic()))
        if not ready:
            running = ", ".join(labels[k] for k in sorted(pending.values()))
            if due is not None and time.monotonic() >= due:
                raise LaunchError(
                    f"{grace.stop.name or 'the stop signal'}: no checkpoint within "
                    f"checkpoint.preempt_grace_s={grace.grace_s:g} s ({phase} still running on "
                    f"{running}); the run resumes from its newest complete checkpoint; raise "
                    "checkpoint.preempt_grace_s (and the time the scheduler gives after its "
                    "signal, e.g. sbatch --signal=B:TERM@SECONDS) to save instead",
                    grace_expired=True)
            if time.monotonic() < deadline:
                continue
            raise LaunchError(f"{phase}: no answer within {timeout_s:.0f} s from {running}")
        for ref in ready:
            key = pending.pop(ref)
            try:
                results[key] = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - reported below with the worker's name
                failures[key] = e
    if failures:
        # peers of a dead worker may fail in their collectives first: wait (up to
        # DEATH_GRACE_S) until Ray reports a death, so the message names the cause, not a
        # symptom; then a second for the calls that fail with it
        grace = time.monotonic() + DEATH_GRACE_S
        while pending:
            died = any(isinstance(e, RayActorError) for e in failures.values())
            left = min(grace, time.monotonic() + 1.0) if died else grace
            ready, _ = ray.wait(list(pending), num_returns=1,
                                timeout=max(0.0, left - time.monotonic()))
            if not ready:
                if died or time.monotonic() >= grace:
                    break
                continue
            for ref in ready:
                key = pending.pop(ref)
                try:
                    ray.get(ref)
                except Exception as e:  # noqa: BLE001
                    failures[key] = e
        dead = [k for k, e in failures.items() if isinstance(e, RayActorError)]
        first = min(dead) if dead else min(failures)
        what = "died" if dead else "failed"
        others = sorted(k for k in failures if k != first)
        raise LaunchError(
            f"{labels[first]} {what} during {phase}: {_reason(failures[first])}"
            + (f" (then also: {', '.join(labels[k] for k in others)})" if others else ""),
            worker_lost=True, worker_died=bool(dead))
    return results


def _reason(e: Exception) -> str:
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    lines = [x for x in str(e).strip().splitlines() if x.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:600]


def describe_ray_auth(env=None) -> str:
    """Which Ray authentication (Ray >= 2.52) a process with this environment uses, for the log:
    the mode and where the token comes from, never the token."""
    env = os.environ if env is None else env
    mode = env.get("RAY_AUTH_MODE", "")
    if not mode:
        return "RAY_AUTH_MODE unset (Ray's default)"
    if mode.lower() != "token":
        return f"RAY_AUTH_MODE={mode}"
    source = ("RAY_AUTH_TOKEN" if env.get("RAY_AUTH_TOKEN") else
              f"RAY_AUTH_TOKEN_PATH={env['RAY_AUTH_TOKEN_PATH']}" if env.get("RAY_AUTH_TOKEN_PATH")
              else "~/.ray/auth_token")
    return f"RAY_AUTH_MODE=token, token from {source}"


class DriverStop:
    """SIGTERM (Slurm's, Kubernetes') or SIGINT (Ctrl-C) to the driver: the step in progress
    runs to its end on every worker, they save it and close, and the driver exits
    PREEMPTED_EXIT_CODE, as a torchrun job does (flexfloor.preemption); if that takes longer
    than checkpoint.preempt_grace_s, the workers are ended unsaved and the driver exits 128 +
    the signal, as the local launcher does. A second SIGINT stops at once (KeyboardInterrupt).
    `event` is what `launch` reads; `name` and `at` say which signal came, and when."""

    def __init__(self):
        self.event = StopEvent()
        self.grace_s: float | None = None  # checkpoint.preempt_grace_s, once the config is read

    @property
    def name(self) -> str | None:
        return self.event.name

    @property
    def at(self) -> float | None:
        return self.event.at

    def install(self) -> "DriverStop":
        """The handlers (again after ray.init, which sets its own for SIGTERM)."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        return self

    def ignore(self) -> None:
        """No more signals: the driver is closing down."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    def _on_signal(self, signum, frame):
        if self.event.is_set():
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.event.name = signal.Signals(signum).name
        self.event.set()
        try:  # one unbuffered write: the main thread may be inside sys.stdout's own write
            grace = ("" if self.grace_s is None else
                     f"checkpoint.preempt_grace_s={self.grace_s:g}; ")
            os.write(sys.stdout.fileno(), f"[flexfloor.launch.ray] {self.name}: finishing the "
                     "step in progress on every worker, then saving a checkpoint "
                     f"({grace}a second Ctrl-C stops at once)\n".encode())
        except (OSError, ValueError):
            pass

    def line(self, when: str, saved: Saved) -> str:
        """The driver's last line: `when` (e.g. "after step 3") and what was `saved`."""
        return (f"preempted by {self.name} {when}: {saved.words}, "
                f"{time.monotonic() - self.at:.1f} s "
                f"after the signal; {to_go_on(saved)} (exit code {PREEMPTED_EXIT_CODE})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flexfloor.launch.ray",
        description="Run a FlexFloor job on Ray: workers as actors in a placement group, this "
        "process drives the steps; released workers are lent to a named resource pool.")
    parser.add_argument("--config", help="YAML config (see examples/configs/)")
    parser.add_argument("--num-workers", type=int, required=True, help="workers (ranks)")
    parser.add_argument("--address", default=None,
                        help="a running cluster (HOST:PORT or 'auto'); default: RAY_ADDRESS if "
                        "set (as `ray job submit` sets it), else start one here")
    parser.add_argument("--cpus-per-worker", type=float, default=1.0)
    parser.add_argument("--gpus-per-worker", type=float, default=None,
                        help="default: 1 when the cluster has GPUs, else 0")
    parser.add_argument("--timeout-s", type=float, default=1800.0,
                        help="longest wait for placement, start-up or one step")
    parser.add_argument("--pool-name", default=POOL_NAME,
                        help=f"name of the resource pool actor (namespace '{NAMESPACE}')")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="when a worker dies or fails, start every worker again up to N "
                        "times, resuming from checkpoint.dir (default 0: the run ends)")
    parser.add_argument("--check-config", action="store_true",
                        help="check the flags, the config for --num-workers workers and the "
                        "files it names (as this machine sees them), then exit 0 or 2; starts "
                        "nothing (the Slurm ray stage runs it before srun)")
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides")
    args = parser.parse_args(argv)
    # bad numbers end here, before Ray starts (Ray would raise, or wait for what never comes)
    def refuse(flag: str, value: float, rule: str, means: str):
        rule = rule if math.isfinite(value) else f"a finite number, {rule}"
        parser.error(f"{flag} {value:g}: must be {rule} ({means})")

    share = 0.0001  # Ray's smallest share of a resource
    if args.num_workers < 1:
        refuse("--num-workers", args.num_workers, "1 or more", "the workers, one rank each")
    if not share <= args.cpus_per_worker < math.inf:
        refuse("--cpus-per-worker", args.cpus_per_worker, f"{share:g} or more",
               f"the CPUs each worker reserves, e.g. 1 or 0.5; {share:g} is Ray's smallest share")
    gpus = args.gpus_per_worker
    if gpus is not None and not (gpus == 0 or share <= gpus < math.inf):
        refuse("--gpus-per-worker", gpus, f"0 or at least {share:g}", "the GPUs each worker "
               "reserves; 0: CPU workers; left out: 1 where the cluster has GPUs, else 0")
    if not 0 < args.timeout_s < math.inf:
        refuse("--timeout-s", args.timeout_s, "more than 0", "seconds, the longest wait for "
               "placement, start-up or one step; default 1800")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts {args.max_restarts}: must be 0 or more (0: a lost worker "
                     "ends the run)")
    if args.check_config:
        from flexfloor.config import ConfigError
        from flexfloor.train import checked_config

        try:
            checked_config(args.config, args.overrides, args.num_workers)
        except (ConfigError, ValueError) as e:
            print(f"config error: {e}", file=sys.stderr, flush=True)
            return 2
        return 0
    signals = DriverStop().install()  # at once: a signal while the driver starts stops it too
    try:
        return _drive(args, signals)
    except KeyboardInterrupt:  # the second Ctrl-C: the workers are ended where they are
        print("[flexfloor.launch.ray] stopped at once (a second Ctrl-C); run the same command "
              "again to resume from the newest complete checkpoint", file=sys.stderr, flush=True)
        return 130


def _beyond_local_cluster(args) -> str | None:
    """What the workers' bundles ask for in all beyond what the local cluster this driver
    started has (no autoscaler, no other node can join: the placement would wait for nothing),
    in words with the fix; None when it fits."""
    import ray

    have = ray.cluster_resources()
    gpus = args.gpus_per_worker
    if gpus is None:  # as `launch` resolves it
        gpus = 1.0 if have.get("GPU", 0) > 0 else 0.0
    per = {"CPU": ("--cpus-per-worker", args.cpus_per_worker), "GPU": ("--gpus-per-worker", gpus)}
    short = [(k, flag, each) for k, (flag, each) in per.items()
             if args.num_workers * each > have.get(k, 0) + 1e-9]
    if not short:
        return None
    asked = " and ".join(f"{args.num_workers * each:g} {k} (--num-workers {args.num_workers} x "
                         f"{flag} {each:g})" for k, flag, each in short)
    fix = ("--gpus-per-worker 0 (CPU workers), " if any(k == "GPU" for k, *_ in short)
           else "a smaller --cpus-per-worker, ")
    return (f"the workers ask for {asked}, but the local Ray cluster started here has "
            f"{have.get('CPU', 0):g} CPU and {have.get('GPU', 0):g} GPU, and no other node can "
            f"join it: run with fewer --num-workers, {fix}or --address of a cluster that has "
            "them")


def _drive(args, signals: DriverStop) -> int:
    from flexfloor.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides).resolve_world(args.num_workers)
    except (ConfigError, FileNotFoundError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    signals.grace_s = cfg.checkpoint.preempt_grace_s
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # offline clusters: no usage report
    import ray

    def say(text: str) -> None:
        # one write, line and newline together: Ray's log thread prints to the same stream
        sys.stdout.write(f"[flexfloor.launch.ray] {text}\n")
        sys.stdout.flush()

    say(f"Ray auth: {describe_ray_auth()}")

    # --address, else RAY_ADDRESS (`ray job submit` sets it for its entrypoint), else a new
    # cluster here ("local"): Ray's default would join a cluster that `ray start` left on this
    # machine, and refuse the CPU count given for a new one
    env_address = os.environ.get("RAY_ADDRESS", "")
    if env_address.startswith(("http://", "https://")):  # the dashboard's, for `ray job`
        env_address = ""
    address = args.address or env_address or "local"
    local = {} if address != "local" else {
        "num_cpus": max(os.cpu_count() or 1, math.ceil(args.num_workers * args.cpus_per_worker))}
    nothing = Saved.standing("nothing saved (no worker had started)", cfg.checkpoint, here=False)
    if signals.event.is_set():  # it came while the driver started
        say(signals.line("before a step ran", nothing))
        return PREEMPTED_EXIT_CODE
    hostport = re.fullmatch(r"\[?([^\]/]+?)\]?:(\d+)", address)
    if hostport:  # Ray would retry a silent address for minutes
        try:
            socket.create_connection((hostport[1], int(hostport[2])), timeout=10).close()
        except OSError as e:
            print(f"[flexfloor.launch.ray] error: nothing answers at {address} ({e}): start the "
                  "cluster there first (`ray start --head --port PORT`), or check --address / "
                  "RAY_ADDRESS", file=sys.stderr, flush=True)
            return 1
    try:
        ray.init(address=address, namespace=NAMESPACE, include_dashboard=False, **local)
        signals.install()  # again: ray.init set its own SIGTERM handler
    except SystemExit:  # Ray's own SIGTERM handler, while it started: nothing ran
        ray.shutdown()
        say(f"SIGTERM while Ray started: {nothing.words}; {to_go_on(nothing)} "
            f"(exit code {PREEMPTED_EXIT_CODE})")
        return PREEMPTED_EXIT_CODE
    except ValueError as e:  # an address Ray cannot read
        print(f"[flexfloor.launch.ray] error: Ray cannot use the address {address!r}: {e} "
              "(give HOST:PORT of the cluster's head, or `auto`, in --address or RAY_ADDRESS)",
              file=sys.stderr, flush=True)
        return 1
    except (ConnectionError, RuntimeError) as e:  # e.g. no cluster there, or a token it wants
        ray.shutdown()
        first = next((x for x in str(e).splitlines() if x.strip()), type(e).__name__)
        print(f"[flexfloor.launch.ray] error: could not connect to the Ray cluster at "
              f"{address}: {first.strip()[:300]}. Check the address; a cluster that `ray start` started "
              "with token authentication (it turns it on where ~/.ray/auth_token exists) needs "
              "RAY_AUTH_MODE=token here too (docs/launch.md)", file=sys.stderr, flush=True)
        return 1

    try:
        if signals.event.is_set():  # it came while Ray started
            result = RunResult(metrics=[], workers=[], stopped={"when": "before a step ran",
                                                                "saved": nothing})
        elif local and (lacking := _beyond_local_cluster(args)):
            print(f"[flexfloor.launch.ray] error: {lacking}", file=sys.stderr, flush=True)
            return 1
        else:
            result = launch(cfg, num_workers=args.num_workers,
                            cpus_per_worker=args.cpus_per_worker,
                            gpus_per_worker=args.gpus_per_worker, timeout_s=args.timeout_s,
                            pool_name=args.pool_name, max_restarts=args.max_restarts, say=say,
                            stop=signals.event)
    except LaunchError as e:
        if e.grace_expired:  # as the local launcher, for workers stopped before they saved
            code = 128 + signal.Signals[signals.name].value
            print(f"[flexfloor.launch.ray] error: {e} (exit code {code})", file=sys.stderr,
                  flush=True)
            return code
        if signals.event.is_set() and e.worker_died:  # the preemption ended workers too
            say(signals.line("during a step", Saved.standing(
                f"workers lost before they saved ({e}); the newest complete checkpoint stands",
                cfg.checkpoint, here=False)))
            return PREEMPTED_EXIT_CODE
        print(f"[flexfloor.launch.ray] error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        signals.ignore()
        ray.shutdown()
    if result.stopped is not None:
        say(signals.line(result.stopped["when"], result.stopped["saved"]))
        return PREEMPTED_EXIT_CODE
    lent = sum(e["event"] == "released" for e in result.pool_events)
    say(f"done: {len(result.metrics)} steps, {lent} releases lent to the pool"
        + (f", {result.restarts} restart{'s' * (result.restarts > 1)}" if result.restarts else ""))
    return 0


if __name__ == "__main__":
    # run the importable module's main, so that actors pickle by module name, not by value
    from flexfloor.launch.ray import main as _main

    sys.exit(_main())
