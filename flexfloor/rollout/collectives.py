"""Every collective of the rollout path, in one place: the device rule and the error rule.

A tensor handed to a collective lives on the group's device: CPU for gloo, the current CUDA
device for NCCL. The step-state share, the MoE layer's split sizes and token exchange, the
migration payloads and the K/V they carry, the expert transfers of a shrink and the layout's all-gather go through the
functions below, which allocate their buffers there; a failed
or timed-out collective becomes a `CollectiveError` naming the rank, the phase and the engine step
(`collective_phase`). Nothing here imports Megatron or the engine: the MoE layers
(`megatron_ext.elastic_moe`) call it too.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist

from flexfloor.rollout.types import RolloutError


class CollectiveError(RolloutError):
    """A collective of the rollout failed or timed out (a peer died or hangs)."""


@contextlib.contextmanager
def collective_phase(rank: int, phase: str, step: int | None = None):
    """Turn a failed or timed-out collective into an error naming the rank, phase and step.

    Every group is created with a timeout (parallel.timeout_s), so a hang ends as an error here
    instead of waiting forever; the launcher then sees the process exit non-zero.
    """
    try:
        yield
    except RolloutError:
        raise
    except (RuntimeError, dist.DistError) as e:
        where = f"rank {rank}, phase '{phase}'" + (f", engine step {step}" if step is not None else "")
        raise CollectiveError(f"{where}: collective failed ({type(e).__name__}: {e})") from e


def group_device(group) -> torch.device:
    """Where a collective's tensors must live for `group`: CPU for gloo, the CUDA device for NCCL."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def share_rows(group, row: list[int]) -> list[list[int]]:
    """All-gather one int64 row per rank of `group` (the step state): [ranks][fields] on the host.
    A group of one rank has nothing to gather."""
    if dist.get_world_size(group) == 1:
        return [[int(v) for v in row]]
    device = group_device(group)
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return torch.stack(parts).tolist()


def gather_objects(group, obj) -> list:
    """All-gather one picklable value per rank (request checks, migration payloads)."""
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, obj, group=group)
    return everyone


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """The MoE split sizes: counts [destination, expert] sent -> [source, expert] received."""
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts.contiguous(), group=group)
    return recv


def _all_to_all(x: torch.Tensor, recv_splits: Optional[list[int]],
                send_splits: Optional[list[int]], group) -> torch.Tensor:
    """Rows of x to the ranks of `group`, send_splits[i] to the i-th; recv_splits[i] from it.
    Splits None: equal slabs (x's rows split evenly, as many received): no sizes read on the
    host, the shapes fixed by x's."""
    if recv_splits is None:
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out
    out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


def exchange_rows(x: torch.Tensor, p: torch.Tensor, recv_splits: Optional[list[int]],
                  send_splits: Optional[list[int]], group) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows x [N, H] and their routing probabilities p [N] in one all-to-all: each row's
    bytes with its probability's bytes appended (exact whatever the two dtypes). Splits None:
    equal slabs (the MoE layer's fixed-capacity dispatch)."""
    n = x.shape[0]
    w = x.shape[1:].numel() * x.element_size()
    xb = x.contiguous().view(torch.uint8).reshape(n, w)
    pb = p.contiguous().view(torch.uint8).reshape(n, p.element_size())
    both = _all_to_all(torch.cat([xb, pb], dim=1), recv_splits, send_splits, group)
    rx = both[:, :w].contiguous().view(x.dtype).reshape(-1, *x.shape[1:])
    rp = both[:, w:].contiguous().view(p.dtype).reshape(-1)
    return rx, rp


def exchange_rows_back(rows: torch.Tensor, send_splits: Optional[list[int]],
                       recv_splits: Optional[list[int]], group) -> torch.Tensor:
    """Expert outputs back to the ranks the rows came from (the reverse of `exchange_rows`;
    splits None: equal slabs)."""
    return _all_to_all(rows, send_splits, recv_splits, group)


def exchange_bytes(parts: list[torch.Tensor], recv_sizes: list[int], group) -> list[torch.Tensor]:
    """One all-to-all of raw bytes over `group`: parts[i] (1-D uint8, possibly empty) goes to
    the i-th rank of the group; returns what each rank sent this one, recv_sizes[i] bytes from
    the i-th (the moved requests' K/V at a step boundary). The parts must already live on
    `group_device(group)`."""
    out = _all_to_all(torch.cat(parts), recv_sizes, [p.numel() for p in parts], group)
    return list(out.split(recv_sizes))


def exchange_point_to_point(sends: list[tuple[torch.Tensor, int]],
                            recvs: list[tuple[torch.Tensor, int]], group) -> None:
    """Post every send (tensor, destination) and receive (buffer, source) at once, in this
    order, and wait for all (the expert transfers of a shrink); peers are global ranks. The
    tensors must already live on `group_device(group)`."""
    ops = [dist.P2POp(dist.isend, t, peer, group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group) for t, peer in recvs]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
