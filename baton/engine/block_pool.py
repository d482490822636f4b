"""Paged KV cache bookkeeping: a pool of fixed-size blocks with ref counts and a prefix cache.

A sequence owns a block table (a list of block ids). A full block can be marked as holding a hash
that chains over all tokens before it, so a later sequence with the same prefix reuses it. Blocks
whose ref count drops to 0 wait in a free queue (least recently freed at the head); a cached block
keeps its hash there until it is handed out again, which evicts it.

Two optional hooks let a prefix-cache index outside the engine follow the pool: ``on_cache(hash)``
when a block starts holding a hash or a cached block is reused (its last access), ``on_evict(hash)``
when a block loses its hash. They run on the caller's thread and must be cheap.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence

from baton.api.prefix import BlockHash


class BlockPoolError(RuntimeError):
    """The block pool was misused (double free, unknown block id, caching a free block, ...)."""


class BlockPool:
    """Fixed number of KV blocks: allocation, ref counts, LRU free queue and a hash -> block index."""

    def __init__(
        self, num_blocks: int, block_size: int, on_evict: Callable[[BlockHash], None] | None = None,
        on_cache: Callable[[BlockHash], None] | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.on_evict = on_evict
        self.on_cache = on_cache
        self._refs = [0] * num_blocks
        self._hashes: list[BlockHash | None] = [None] * num_blocks
        self._index: dict[BlockHash, int] = {}
        # Ordered set of blocks with ref 0: O(1) push tail, pop head and remove from the middle.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._index)

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash the pool holds now (what an index of this pool should list)."""
        return list(self._index)

    def usage(self) -> float:
        return (self.num_blocks - len(self._free)) / self.num_blocks

    def allocate(self, n: int) -> list[int] | None:
        """`n` blocks with ref 1 from the head of the free queue (evicting their hashes), or None if short."""
        if n < 0:
            raise BlockPoolError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            return None
        ids = [self._free.popitem(last=False)[0] for _ in range(n)]
        evicted = [h for h in map(self._drop_hash, ids) if h is not None]
        for b in ids:
            self._refs[b] = 1
        if self.on_evict is not None:
            for h in evicted:
                self.on_evict(h)
        return ids

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one ref per id; blocks reaching 0 join the queue tail in reverse order, keeping their hash."""
        for b, count in Counter(block_ids).items():
            if self._check_id(b) < count:
                raise BlockPoolError(f"block {b} freed {count} time(s) but its ref count is {self._refs[b]}")
        for b in reversed(block_ids):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free[b] = None

    def cache_block(self, block_id: int, block_hash: BlockHash) -> None:
        """Mark an in-use full block as holding `block_hash`; no-op if another block already holds it."""
        if not isinstance(block_hash, bytes):
            raise BlockPoolError(f"block hash must be bytes from hash_block, not {type(block_hash).__name__}")
        if self._check_id(block_id) == 0:
            raise BlockPoolError(f"block {block_id} is free; only a block in use can be cached")
        own = self._hashes[block_id]
        if own is not None and own != block_hash:
            raise BlockPoolError(f"block {block_id} already holds hash {own.hex()}, not {block_hash.hex()}")
        if own is None and block_hash not in self._index:
            self._hashes[block_id] = block_hash
            self._index[block_hash] = block_id
            if self.on_cache is not None:
                self.on_cache(block_hash)

    def match_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Ids of the cached blocks for the longest cached prefix of `hashes`; takes no refs."""
        ids: list[int] = []
        for h in hashes:
            b = self._index.get(h)
            if b is None:
                break
            ids.append(b)
        return ids

    def take(self, block_ids: Sequence[int]) -> None:
        """Add one ref to each cached block (a free one leaves the free queue without being evicted)."""
        for b in block_ids:
            self._check_id(b)
            if self._hashes[b] is None:
                raise BlockPoolError(f"block {b} holds no hash; only cached blocks can be taken")
        for b in block_ids:
            if self._refs[b] == 0:
                del self._free[b]
            self._refs[b] += 1
            if self.on_cache is not None:
                self.on_cache(self._hashes[b])

    def ref_count(self, block_id: int) -> int:
        return self._check_id(block_id)

    def block_hash(self, block_id: int) -> BlockHash | None:
        self._check_id(block_id)
        return self._hashes[block_id]

    def reset_cache(self) -> int:
        """Evict the hashes of all free blocks; returns how many were evicted."""
        evicted = [h for h in map(self._drop_hash, list(self._free)) if h is not None]
        if self.on_evict is not None:
            for h in evicted:
                self.on_evict(h)
        return len(evicted)

    def check_integrity(self) -> None:
        """Raise BlockPoolError if ref counts, the free queue and the hash index disagree."""
        ids = range(self.num_blocks)
        bad = [f"block {b} has ref count {r}" for b, r in enumerate(self._refs) if r < 0]
        bad += [f"free queue holds unknown id {b!r}" for b in self._free if b not in ids]
        bad += [f"index holds unknown id {b!r}" for b in self._index.values() if b not in ids]
        if not bad:  # the OrderedDict cannot hold an id twice; ref > 0 in the queue would show below
            bad += [f"free block {b} has ref count {self._refs[b]}" for b in self._free if self._refs[b]]
            in_use = sum(r > 0 for r in self._refs)
            if len(self._free) + in_use != self.num_blocks:
                bad.append(f"{len(self._free)} free + {in_use} in use != {self.num_blocks} blocks")
            bad += [f"index: {h.hex()} -> block {b}" for h, b in self._index.items() if self._hashes[b] != h]
            held = sum(h is not None for h in self._hashes)
            if held != len(self._index):
                bad.append(f"{held} blocks hold a hash but the index has {len(self._index)} entries")
        if bad:
            raise BlockPoolError("block pool is inconsistent: " + "; ".join(bad))

    def _check_id(self, block_id: int) -> int:
        """Ref count of `block_id`, or BlockPoolError if it is not a block of this pool."""
        if not isinstance(block_id, int) or isinstance(block_id, bool) or not 0 <= block_id < self.num_blocks:
            raise BlockPoolError(f"unknown block id {block_id!r}; this pool has ids 0..{self.num_blocks - 1}")
        return self._refs[block_id]

    def _drop_hash(self, block_id: int) -> BlockHash | None:
        h = self._hashes[block_id]
        if h is not None:
            self._hashes[block_id] = None
            del self._index[h]
        return h
