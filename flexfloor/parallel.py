"""The process-group value: world, EP group, expert-TP and data-parallel groups.

`Parallel.build()` initialises torch.distributed (gloo on CPU, NCCL on GPU), asks Megatron-Core
to create its groups once, and keeps them in one value. Megatron-Core modules receive the groups
as a `ProcessGroupCollection` (`pg_collection=`), never through its module globals: elastic EP
then means "build a new collection for the survivors and re-bind", not "reset globals".

This module is the only place that reads `megatron.core.parallel_state`, and only to build the
value. (Megatron's DDP and dist-checkpointing still read those globals internally; they hold the
training layout, which is exactly what they need.)
"""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from megatron_ext import cpu_compat


class LaunchSetupError(RuntimeError):
    """The process was started in a way the run cannot use (no launcher environment, a
    backend this machine lacks): its message says the fix, so no traceback goes with it."""


@dataclass
class Parallel:
    """Who this worker is and the process groups it talks over.

    Training layout: TP = PP = CP = 1; every rank is a data-parallel rank for attention and dense
    weights (data-parallel attention), experts are sharded over EP groups of `ep_size` ranks.
    """

    rank: int
    world_size: int
    ep_size: int
    backend: str
    device: torch.device
    timeout: datetime.timedelta
    pg_collection: object  # megatron.core.process_groups_config.ProcessGroupCollection
    world_group: Optional[dist.ProcessGroup] = None
    _owns_world: bool = field(default=False, repr=False)

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self.pg_collection.ep

    @property
    def ep_rank(self) -> int:
        return dist.get_rank(self.ep_group)

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.pg_collection.dp

    @property
    def expt_dp_group(self) -> dist.ProcessGroup:
        return self.pg_collection.expt_dp

    @property
    def ep_ranks(self) -> list[int]:
        """Global ranks of this rank's EP group, in EP-rank order."""
        return dist.get_process_group_ranks(self.ep_group)

    @classmethod
    def build(
        cls,
        *,
        expert_parallel_size: Optional[int] = None,
        backend: str = "auto",
        timeout_s: float = 300.0,
    ) -> "Parallel":
        """Initialise torch.distributed from the torchrun environment (or reuse it) and the groups.

        `expert_parallel_size=None` puts every rank in one EP group. The sizes are checked here
        with messages that name the config field, because Megatron-Core's own asserts do not.
        """
        from megatron.core import parallel_state
        from megatron.core.process_groups_config import ProcessGroupCollection

        cpu_compat.apply()
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl" and not torch.cuda.is_available():
            raise LaunchSetupError(
                "parallel.backend=nccl needs CUDA, and none is available; "
                "set parallel.backend=gloo (or auto)"
            )
        timeout = datetime.timedelta(seconds=timeout_s)
        owns_world = False
        if not dist.is_initialized():
            _require_launcher_env()
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group(backend=backend, timeout=timeout, **_attempt_store(timeout))
            owns_world = True
        world_size = dist.get_world_size()
        rank = dist.get_rank()
        ep_size = world_size if expert_parallel_size is None else expert_parallel_size
        if ep_size < 1 or ep_size > world_size or world_size % ep_size != 0:
            raise ValueError(
                f"parallel.expert_parallel_size={ep_size} does not fit world size {world_size}: "
                f"it must divide the number of workers; set it to one of "
                f"{[d for d in range(1, world_size + 1) if world_size % d == 0]}"
            )
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            expert_model_parallel_size=ep_size,
            expert_tensor_parallel_size=1,
            distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)),
            create_gloo_process_groups=(backend != "gloo"),
        )
        pgs = ProcessGroupCollection.use_mpu_process_groups()
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )
        return cls(
            rank=rank,
            world_size=world_size,
            ep_size=ep_size,
            backend=backend,
            device=device,
            timeout=timeout,
            pg_collection=pgs,
            world_group=dist.group.WORLD,
            _owns_world=owns_world,
        )

    def barrier(self) -> None:
        dist.barrier(group=self.world_group)

    def destroy(self) -> None:
        """Tear down Megatron's groups and, if this value started it, torch.distributed."""
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if self._owns_world and dist.is_initialized():
            dist.destroy_process_group()


def _attempt_store(timeout: datetime.timedelta) -> dict:
    """init_process_group arguments that give this launch attempt, and each build of a world in
    it, its own keys in torchrun's agent store.

    torchrun's agent store (`--standalone` or the static `--master-addr/--master-port`) serves
    the whole job, and process groups name their keys by a counter that starts again in every
    attempt: after a restart (`--max-restarts`) the new workers would read the dead ones'
    addresses and fail to connect (or wait out the timeout). A prefix with
    TORCHELASTIC_RESTART_COUNT separates them. The same holds inside one attempt when a process
    builds again after `Parallel.destroy()` (convert or evaluate two models in one script):
    gloo's connectFullMesh would dial the first world's closed sockets. So the prefix also holds
    the build's number, which every rank reads from the store (the k-th build of each rank is
    the k-th world: a build needs every rank).
    Outside torchrun's agent store: {} (torch's own env:// rendezvous).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    world_size = int(os.environ["WORLD_SIZE"])
    build = (store.add(f"flexfloor/attempt_{attempt}/builds", 1) - 1) // world_size
    prefix = f"flexfloor/attempt_{attempt}" + (f"/build_{build}" if build else "")
    return {"store": dist.PrefixStore(prefix, store),
            "rank": int(os.environ["RANK"]), "world_size": world_size}


def _require_launcher_env() -> None:
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise LaunchSetupError(
            f"torch.distributed is not initialised and {', '.join(missing)} are not set: start "
            "FlexFloor with torchrun (torchrun --nproc-per-node N -m flexfloor.train ...) or the "
            "Ray launcher"
        )
