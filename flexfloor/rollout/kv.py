"""The KV cache of one rank as a pool of fixed-size blocks, and the block accounting everyone uses.

A request holds a block table (the blocks its keys and values live in, in position order); blocks
are taken as its tokens are stored, never reserved for `max_new_tokens`, and given back when it
finishes, is preempted, migrates or its rank is released. A request that moves to another rank
of its EP group may take its K/V along (`BlockPool.export_kv` on the giver, `import_kv` on the
taker: exactly its stored tokens, in position order, as one tensor). `rollout.kv_budget_tokens` (tokens per
rank) stays the user-facing budget: the pool holds `kv_budget_tokens // kv_block_tokens` blocks.
Borrowed experts take their bytes from the same room (`withhold`). `blocks_for` is the one block
count and `BlockLedger` the one set of block counters (admission keeps `watermark_blocks` free):
the engine, the scheduler's memory model and the simulator use them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from flexfloor.rollout.types import RolloutError


def blocks_for(tokens: int, block_tokens: int) -> int:
    """Blocks that hold `tokens` tokens of KV (the last one partly filled)."""
    return -(-max(0, tokens) // block_tokens)


def watermark_blocks(capacity: Optional[int]) -> int:
    """Free blocks admission keeps for the running requests' next tokens (1% of the pool, at
    least one; none when unbounded)."""
    return 0 if capacity is None else max(1, capacity // 100)


@dataclass
class BlockLedger:
    """The block counts of one rank's pool, without storage: what the engine's pool and the
    simulator (flexfloor/sim/) both count. `capacity` None: unbounded."""

    capacity: Optional[int]
    block_bytes: int  # K and V of one block over all layers
    used: int = 0  # blocks in block tables
    withheld: int = 0  # blocks' worth of room borrowed experts took
    peak: int = 0  # most blocks in use (plus withheld) at once

    @property
    def free_blocks(self) -> Optional[int]:
        """Blocks that may still be taken; None when unbounded."""
        if self.capacity is None:
            return None
        return self.capacity - self.withheld - self.used

    def free_bytes(self, unbounded: int = 1 << 62) -> int:
        free = self.free_blocks
        return unbounded if free is None else free * self.block_bytes

    def can_allocate(self, n: int, *, keep: int = 0) -> bool:
        free = self.free_blocks
        return free is None or free - n >= keep

    def take(self, n: int) -> None:
        if not self.can_allocate(n):
            raise RolloutError(f"KV block pool: {n} blocks asked, {self.free_blocks} free")
        self.used += n
        self.peak = max(self.peak, self.used + self.withheld)

    def give_back(self, n: int) -> None:
        self.used -= n

    def withhold(self, nbytes: int) -> None:
        """Borrowed expert weights take `nbytes` from the KV room (rounded up to blocks)."""
        self.withheld += blocks_for(nbytes, self.block_bytes)
        self.peak = max(self.peak, self.used + self.withheld)


class BlockPool(BlockLedger):
    """K and V of every layer in blocks of `block_tokens` slots: storage [layers, slots, groups,
    head_dim], slot = block * block_tokens + offset. `capacity` blocks at most (None: unbounded);
    storage grows on demand up to it, so an unbounded or large budget costs only what is used.

    Lifecycle: one pool per `generate()`; `allocate`/`free` per request; `withhold` for bytes a
    borrowed expert takes from the KV room; everything is dropped with the pool."""

    GROW = 64  # blocks added at least when the storage grows

    def __init__(self, *, num_layers: int, groups: int, head_dim: int, dtype, device,
                 block_tokens: int, capacity: Optional[int]):
        elem = torch.empty((), dtype=dtype).element_size()
        super().__init__(capacity=capacity,
                         block_bytes=2 * num_layers * groups * head_dim * block_tokens * elem)
        self.block_tokens = block_tokens
        self._shape = (num_layers, 0, groups, head_dim)
        self.k = torch.empty(self._shape, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self._free: list[int] = []  # blocks of the storage not in use (LIFO)

    def allocate(self, n: int) -> list[int]:
        """n new blocks; the caller checked `can_allocate` (an error otherwise, nothing taken)."""
        self.take(n)
        while len(self._free) < n:
            self._grow(n - len(self._free))
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
        self.give_back(len(blocks))

    def _grow(self, at_least: int) -> None:
        have = self.k.shape[1] // self.block_tokens
        add = max(at_least, self.GROW, have)
        if self.capacity is not None:
            add = min(add, max(at_least, self.capacity - have))
        L, _, G, D = self._shape
        extra = add * self.block_tokens
        # zeros, not empty: attention reads masked slots too, and 0 * NaN would leak through
        self.k = torch.cat([self.k, self.k.new_zeros(L, extra, G, D)], dim=1)
        self.v = torch.cat([self.v, self.v.new_zeros(L, extra, G, D)], dim=1)
        self._free.extend(range(have + add - 1, have - 1, -1))

    def slots(self, table: list[int], start: int, stop: int) -> list[int]:
        """Slot of each position start..stop-1 of a request with block table `table`."""
        bt = self.block_tokens
        return [table[p // bt] * bt + p % bt for p in range(start, stop)]

    def kv_shape(self, tokens: int) -> tuple[int, ...]:
        """Shape of `tokens` tokens of K/V as `export_kv` gives them: [2 (K, V), layers, tokens,
        groups, head_dim]."""
        L, _, G, D = self._shape
        return (2, L, tokens, G, D)

    def export_kv(self, table: list[int], length: int) -> torch.Tensor:
        """The K/V of positions 0..length-1 of a request with block table `table`, every layer:
        one new tensor [2, layers, length, groups, head_dim] on the pool's device (the blocks may
        be freed and reused at once)."""
        if blocks_for(length, self.block_tokens) > len(table):
            raise RolloutError(f"KV export: {length} tokens asked of a block table of "
                               f"{len(table)} blocks of {self.block_tokens}")
        slots = torch.tensor(self.slots(table, 0, length), dtype=torch.long, device=self.k.device)
        return torch.stack([self.k.index_select(1, slots), self.v.index_select(1, slots)])

    def import_kv(self, kv: torch.Tensor, *, request_id: str) -> list[int]:
        """Store a moved request's K/V (`export_kv`'s tensor, from another rank's pool) in new
        blocks; returns its block table. Refused, with nothing taken, when the blocks do not
        fit (the move's decision checked the room: a refusal is a bug or a config the decision
        did not see) or the tensor is not of this pool's layout."""
        tokens = kv.shape[2] if kv.dim() == 5 else -1
        if tuple(kv.shape) != self.kv_shape(tokens) or kv.dtype != self.k.dtype:
            raise RolloutError(f"request {request_id}: moved K/V of shape {tuple(kv.shape)} "
                               f"{kv.dtype} does not fit this pool's {self.kv_shape(tokens)} "
                               f"{self.k.dtype} (giver and taker must run the same model)")
        need = blocks_for(tokens, self.block_tokens)
        if not self.can_allocate(need):
            raise RolloutError(
                f"request {request_id}: its {tokens} tokens of moved K/V need {need} KV blocks "
                f"and only {self.free_blocks} are free on the taker; raise "
                "rollout.kv_budget_tokens")
        table = self.allocate(need)
        slots = torch.tensor(self.slots(table, 0, tokens), dtype=torch.long, device=self.k.device)
        self.k.index_copy_(1, slots, kv[0].to(self.k.device))
        self.v.index_copy_(1, slots, kv[1].to(self.v.device))
        return table
