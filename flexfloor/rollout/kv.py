"""The KV cache of one rank as a pool of fixed-size blocks, and the block accounting everyone uses.

A request holds a block table (the blocks its keys and values live in, in position order); blocks
are taken as its tokens are stored, never reserved for `max_new_tokens`, and given back when it
finishes, is preempted, migrates or its rank is released. A request that moves to another rank
of its EP group may take its K/V along (`BlockPool.export_kv` on the giver, `import_kv` on the
taker: exactly its stored tokens, in position order, as one tensor). `rollout.kv_budget_tokens` (tokens per
rank) stays the user-facing budget: the pool holds `kv_budget_tokens // kv_block_tokens` blocks.
Borrowed experts take their bytes from the same room (`withhold`). The storage may be laid out
in lanes (`BlockPool.lane_blocks`): a request's blocks then fill its lane in order, so attention
reads every lane-resident request's K/V as one view of the storage instead of a gathered copy. `blocks_for` is the one block
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
    storage grows on demand up to it.

    Lanes (`lane_blocks` W, optional): blocks i*W .. (i+1)*W - 1 form lane i. A request that
    opens a lane (`open_lane`: the lowest lane whose blocks are all free and inside the
    capacity) takes its blocks in order from the start of its lane (`allocate(n, lane=i,
    start=...)`), so the lane-resident requests' K/V are one strided view of the storage
    ([lanes, W * block_tokens, groups, head_dim]: `lane_view`) and attention reads them without
    a copy. The ledger still counts blocks in use only, and lane blocks not in use stay free
    for any request (taken last); storage then covers the lanes opened (or `reserve`d: the
    engine reserves the lanes its first admissions open), at most the capacity.
    A lane is open while its first block is in use.

    Scratch (`scratch`, for the engine's `static_decode`): one more block of storage after the
    stored blocks, at `scratch_slot`, that no request owns and the ledger counts nowhere (not in
    the capacity, used, free or peak: its bytes are one block over the budget, the price of a
    padded decode step): the padding rows of a step padded to a bucket write their K/V there.
    It stays the last block when the storage grows.

    Lifecycle: one pool per `generate()`; `open_lane`/`allocate`/`free` per request;
    `withhold` for bytes a borrowed expert takes from the KV room; everything is dropped with
    the pool."""

    GROW = 64  # blocks added at least when the storage grows

    def __init__(self, *, num_layers: int, groups: int, head_dim: int, dtype, device,
                 block_tokens: int, capacity: Optional[int], lane_blocks: Optional[int] = None,
                 scratch: bool = False):
        elem = torch.empty((), dtype=dtype).element_size()
        super().__init__(capacity=capacity,
                         block_bytes=2 * num_layers * groups * head_dim * block_tokens * elem)
        self.block_tokens = block_tokens
        self.lane_blocks = lane_blocks
        self._shape = (num_layers, 0, groups, head_dim)
        self._extra = int(scratch)  # blocks of storage after the stored ones (the scratch)
        self.k = torch.zeros((num_layers, self._extra * block_tokens, groups, head_dim),
                             dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        # free blocks: the set is the truth; the list is the LIFO order, with stale entries
        # (blocks since taken by a lane allocation) skipped when popped
        self._free: list[int] = []
        self._free_set: set[int] = set()

    @property
    def stored_blocks(self) -> int:
        """Blocks the storage holds now."""
        return self.k.shape[1] // self.block_tokens - self._extra

    @property
    def scratch_slot(self) -> int:
        """The scratch block's first slot (`scratch`); it moves when the storage grows."""
        if not self._extra:
            raise RolloutError("KV block pool built without a scratch block (scratch=False)")
        return self.stored_blocks * self.block_tokens

    def open_lane(self) -> Optional[int]:
        """The lowest lane whose blocks are all free and fit the capacity (storage grown to hold
        it), or None (no lanes, or none free)."""
        W = self.lane_blocks
        if W is None:
            return None
        lane = 0
        while self.capacity is None or (lane + 1) * W <= self.capacity:
            first, stop = lane * W, (lane + 1) * W
            have = self.stored_blocks
            if all(b in self._free_set for b in range(first, min(stop, have))):
                if stop > have:
                    self._grow(stop - have)
                return lane
            lane += 1
        return None

    def allocate(self, n: int, *, lane: Optional[int] = None, start: int = 0) -> list[int]:
        """n new blocks; the caller checked `can_allocate` (an error otherwise, nothing taken).
        With `lane`: blocks `start .. start + n - 1` of that lane when they are all free (a
        request's next blocks in its lane), else any free ones."""
        self.take(n)
        if lane is not None and start + n <= self.lane_blocks:
            first = lane * self.lane_blocks + start
            want = range(first, first + n)
            if first + n <= self.stored_blocks and all(b in self._free_set for b in want):
                self._free_set.difference_update(want)
                self._compact()
                return list(want)
        return self._pop(n)

    def _pop(self, n: int) -> list[int]:
        """n free blocks in LIFO order; blocks of open lanes only when nothing else is free and
        the storage cannot grow (their lane's request then leaves its lane)."""
        W = self.lane_blocks
        out, later = [], []
        while len(out) < n:
            if not self._free:
                if self.capacity is None or self.stored_blocks < self.capacity:
                    self._grow(n - len(out))
                    continue
                out.append(later.pop(0))  # only open lanes' blocks are left (take() counted)
                continue
            b = self._free.pop()
            if b not in self._free_set or b in out or b in later:
                continue  # stale entry
            if W is not None and b % W and (b - b % W) not in self._free_set:
                later.append(b)  # in an open lane (its first block is in use)
                continue
            out.append(b)
        self._free.extend(reversed(later))
        self._free_set.difference_update(out)
        return out

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
        self._free_set.update(blocks)
        self.give_back(len(blocks))

    def _compact(self) -> None:
        """Drop the free list's stale entries once they outnumber the free blocks."""
        if len(self._free) > 2 * len(self._free_set) + 64:
            seen: set[int] = set()
            keep = []
            for b in reversed(self._free):  # the most recent entry of each block wins
                if b in self._free_set and b not in seen:
                    seen.add(b)
                    keep.append(b)
            self._free = keep[::-1]

    def reserve(self, blocks: int) -> None:
        """Storage for `blocks` blocks (at most the capacity) in one allocation, ahead of the
        allocations that will need it: growing block by block doubles the storage, a copy of
        all of it each time. Nothing is taken: the ledger is unchanged."""
        if self.capacity is not None:
            blocks = min(blocks, self.capacity)
        if blocks > self.stored_blocks:
            self._grow(blocks - self.stored_blocks, exact=True)

    def _grow(self, at_least: int, *, exact: bool = False) -> None:
        have = self.stored_blocks
        add = at_least if exact else max(at_least, self.GROW, have)
        if self.capacity is not None:
            add = min(add, max(at_least, self.capacity - have))
        L, _, G, D = self._shape
        extra = add * self.block_tokens
        # zeros, not empty: attention reads masked slots too, and 0 * NaN would leak through
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros(L, old.shape[1] + extra, G, D)
            new[:, : have * self.block_tokens] = old[:, : have * self.block_tokens]
            setattr(self, name, new)  # the scratch block (if any) is zeros again, at the end
        self._free.extend(range(have + add - 1, have - 1, -1))
        self._free_set.update(range(have, have + add))

    def lane_view(self, layer: int, lanes: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer` for lanes 0 .. lanes-1, the first `width` blocks of each, as views
        [lanes, groups, width * block_tokens, head_dim] of the storage (no copy)."""
        W, bt = self.lane_blocks, self.block_tokens
        G, D = self._shape[2], self._shape[3]
        views = []
        for store in (self.k, self.v):
            s = store[layer, : lanes * W * bt].view(lanes, W * bt, G, D)
            views.append(s[:, : width * bt].transpose(1, 2))
        return views[0], views[1]

    def lane_views(self, lanes: int, width: int) -> tuple[tuple, tuple]:
        """`lane_view` of every layer at once (one step's views made together): K per layer,
        V per layer."""
        W, bt = self.lane_blocks, self.block_tokens
        L, _, G, D = self._shape
        return tuple(
            store[:, : lanes * W * bt].view(L, lanes, W * bt, G, D)[:, :, : width * bt]
            .transpose(2, 3).unbind(0) for store in (self.k, self.v))

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
