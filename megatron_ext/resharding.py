"""Move expert weights between ranks before an EP group shrinks, verified on arrival.

All layers of one expert travel as one flat buffer per transfer, posted together with its header
(element count and CRC32 of the bytes) in one batch of point-to-point operations over the current
EP group. The receiver checks the element count against the shapes it expects (the same
architecture) and the checksum against the bytes it got before it hosts the expert.

Device discipline: headers and buffers live on the group's device (the experts' device for NCCL,
CPU for gloo: `flexfloor.rollout.collectives.group_device`), and the sends and receives are
posted through that module; the checksum is taken on one host copy of each buffer, never on a
device tensor.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from flexfloor.rollout.collectives import exchange_point_to_point, group_device
from megatron_ext.elastic_moe import PlacedMoE
from megatron_ext.placement import Transfer


class TransferError(RuntimeError):
    pass


def _flatten(states: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for sd in states for t in sd.values()])


def _crc(buf: torch.Tensor) -> int:
    """CRC32 of a buffer's bytes, from one host copy (a CPU buffer is read in place)."""
    host = buf.detach().contiguous().cpu()
    return zlib.crc32(memoryview(host.view(torch.uint8).numpy()))


def transfer_experts(moe: PlacedMoE, transfers: list[Transfer], group: dist.ProcessGroup) -> dict:
    """Run `transfers` (every rank of `group` calls this with the same list). Returns stats."""
    rank = moe.rank
    template = [moe.expert_state(li, next(iter(h))) for li, h in enumerate(moe.hosted)]
    numel = sum(t.numel() for sd in template for t in sd.values())
    dtype = next(iter(template[0].values())).dtype
    device = group_device(group)
    sends, recvs, inbound, sent_bytes = [], [], [], 0
    for tr in transfers:
        if tr.src == rank:
            buf = _flatten([moe.expert_state(li, tr.expert) for li in range(len(moe.hosted))])
            buf = buf.to(device)
            header = torch.tensor([buf.numel(), _crc(buf)], dtype=torch.int64, device=device)
            sends += [(header, tr.dst), (buf, tr.dst)]
            sent_bytes += buf.nbytes
        elif tr.dst == rank:
            header = torch.empty(2, dtype=torch.int64, device=device)
            buf = torch.empty(numel, dtype=dtype, device=device)
            recvs += [(header, tr.src), (buf, tr.src)]
            inbound.append((tr, header, buf))
    exchange_point_to_point(sends, recvs, group)
    for tr, header, buf in inbound:
        n, crc = header.tolist()
        if n != numel:
            raise TransferError(
                f"expert {tr.expert} from rank {tr.src}: {n} elements sent, rank {rank} expects "
                f"{numel} for its architecture"
            )
        if _crc(buf) != crc:
            raise TransferError(f"expert {tr.expert} from rank {tr.src} to {rank}: checksum mismatch")
        offset = 0
        for li, sd in enumerate(template):
            state = {}
            for name, t in sd.items():
                state[name] = buf[offset : offset + t.numel()].view(t.shape).to(t.device, copy=True)
                offset += t.numel()
            moe.host(li, tr.expert, state)
    return {"sent_bytes": sent_bytes, "received": len(inbound)}
