"""The resource pool: which released workers' devices are free right now, for other Ray work.

During a rollout a released rank holds nothing the job still needs: its experts moved to the
survivors and it waits at resync. Its accelerator is free until then. Each worker reports
"released" and "rejoined" (its Job's `on_release_event`, see `flexfloor.rollout.elastic`) to one
named Ray actor holding this class; other Ray work finds it by name and borrows from it:

    pool = flexfloor.launch.pool.get_pool()              # from any driver on the cluster
    ray.get(pool.free.remote())                          # released workers now: node, devices
    lent = ray.get(pool.claim.remote("my-eval"))         # wait for one, mark it as mine
    ...                                                  # use lent["gpu_ids"] on lent["node_ip"]
    ray.get(pool.wait_rejoined.remote(lent["lease"]))    # returns when that rank is back

"Use until resync": a lease ends when its rank rejoins the job at resync (or when the launcher
restarts every worker after one was lost: `withdraw`), and the job never waits for borrowers; a
borrower runs short, preemptible work and stops when `wait_rejoined` returns.
The pool is an actor (not a file or a key in the GCS) so that borrowers can wait for a release or
a rejoin without polling, and every update comes in order through one mailbox.

A borrower driver connects like the job's driver: against a cluster with token authentication
(Ray >= 2.52; what examples/slurm/grpo_moe_ray.sbatch starts unless RAY_AUTH_MODE=disabled) it
needs RAY_AUTH_MODE=token and the cluster's token (RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH) in its
environment before `ray.init(address=...)`. The sbatch script makes a fresh token per job and
keeps it in the job's environment only, so to let borrowers outside the job in, export your own
RAY_AUTH_TOKEN before submitting. Tasks and actors started inside the cluster inherit it.
"""

from __future__ import annotations

import asyncio
import time

NAMESPACE = "flexfloor"
POOL_NAME = "flexfloor-pool"


class ResourcePool:
    """Free devices of released workers, keyed by lease (one lease per release).

    An entry: lease, rank, step (training step, as in metrics.jsonl), engine_step (the engine
    step the rank left at), release_s (seconds into the rollout), node_id, node_ip, gpu_ids,
    cpus, claimed_by (None until a borrower claims it).
    """

    def __init__(self):
        self._free: dict[int, dict] = {}  # lease -> entry
        self._events: list[dict] = []
        self._next_lease = 0
        self._changed = asyncio.Condition()
        self._stopping = False

    async def released(self, entry: dict) -> int:
        """A worker left the rollout: its devices are free until it rejoins. Returns the lease."""
        async with self._changed:
            lease = self._next_lease
            self._next_lease += 1
            self._free[lease] = dict(entry, lease=lease, claimed_by=None)
            self._events.append(self._event("released", self._free[lease]))
            self._changed.notify_all()
            return lease

    async def rejoined(self, rank: int, step: int) -> None:
        """The worker is back in the job (resync): its lease ends."""
        async with self._changed:
            for lease, entry in list(self._free.items()):
                if entry["rank"] == rank:
                    del self._free[lease]
                    self._events.append(self._event("rejoined", dict(entry, step=step)))
            self._changed.notify_all()

    async def withdraw(self, reason: str) -> int:
        """The job lost its workers (a restart of every worker): each open lease ends now, as a
        rejoin ends it, so no borrower keeps a device that the next attempt's worker takes.
        Returns how many ended."""
        async with self._changed:
            for _, entry in sorted(self._free.items()):
                self._events.append(dict(self._event("withdrawn", entry), reason=reason))
            n = len(self._free)
            self._free.clear()
            self._changed.notify_all()
            return n

    async def free(self) -> list[dict]:
        """The released workers now, claimed or not, by rank."""
        return sorted((dict(e) for e in self._free.values()), key=lambda e: e["rank"])

    async def claim(self, borrower: str, timeout_s: float | None = None) -> dict | None:
        """Wait for an unclaimed free worker and mark it as `borrower`'s; None after `timeout_s`."""
        def unclaimed():
            return next((e for _, e in sorted(self._free.items()) if e["claimed_by"] is None), None)

        async with self._changed:
            try:
                async with asyncio.timeout(timeout_s):
                    await self._changed.wait_for(lambda: unclaimed() is not None)
            except TimeoutError:
                return None
            entry = unclaimed()
            entry["claimed_by"] = borrower
            self._events.append(self._event("claimed", entry))
            return dict(entry)

    async def wait_rejoined(self, lease: int, timeout_s: float | None = None) -> bool:
        """Wait until the lease ends (its rank rejoined); False after `timeout_s`."""
        async with self._changed:
            try:
                async with asyncio.timeout(timeout_s):
                    await self._changed.wait_for(lambda: lease not in self._free)
            except TimeoutError:
                return False
            return True

    async def stop(self) -> None:
        """The job's driver took a stop signal: its workers end the warm start early (they ask
        `stopping` after each supervised step; a training step ends as the driver's loop
        says)."""
        self._stopping = True

    async def stopping(self) -> bool:
        return self._stopping

    async def events(self) -> list[dict]:
        """Every released / claimed / rejoined / withdrawn event so far, in order."""
        return list(self._events)

    @staticmethod
    def _event(kind: str, entry: dict) -> dict:
        return {"event": kind, "rank": entry["rank"], "step": entry["step"],
                "lease": entry["lease"], "claimed_by": entry["claimed_by"], "time": time.time()}


def get_pool(name: str = POOL_NAME):
    """The running job's pool actor (from any Ray driver or task connected to the cluster)."""
    import ray

    return ray.get_actor(name, namespace=NAMESPACE)
