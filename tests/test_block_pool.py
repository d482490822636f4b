"""Paged-KV block pool: exact ids, ref counts, LRU order, prefix hashes, misuse, and a model-based check."""

from __future__ import annotations

import hashlib
import os
import random
import struct
import subprocess
import sys
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from baton.api.prefix import BlockHash, hash_block, hash_full_blocks
from baton.engine.block_pool import BlockPool, BlockPoolError


def h(i: int) -> BlockHash:
    """A distinct 16-byte hash for tests that do not care about token content."""
    return hash_block(None, [i])


class Evictions(list):
    def __call__(self, block_hash: BlockHash) -> None:
        self.append(block_hash)


# ---------------------------------------------------------------- hashing


def test_hash_block_matches_independent_blake2b_encoding() -> None:
    # Documented encoding: tag 0 for no parent, or tag 1 + parent length (uint32 LE) + parent,
    # followed by the token ids as little-endian int64; blake2b with a 16-byte digest.
    root = hashlib.blake2b(b"\x00" + struct.pack("<4q", 1, 2, 3, 4), digest_size=16).digest()
    child_payload = b"\x01" + (16).to_bytes(4, "little") + root + struct.pack("<4q", 5, 6, 7, 8)
    child = hashlib.blake2b(child_payload, digest_size=16).digest()
    assert hash_block(None, [1, 2, 3, 4]) == root
    assert hash_block(root, (5, 6, 7, 8)) == child
    assert hash_full_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == [root, child]
    assert len(root) == 16


def test_hash_is_stable_across_processes_with_different_hash_seeds() -> None:
    code = "from baton.api.prefix import hash_full_blocks as f; print(f(range(40), 16)[1].hex())"
    outs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        run = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        outs.add(run.stdout.strip())
    assert outs == {hash_full_blocks(list(range(40)), 16)[1].hex()}


def test_hash_depends_on_parent_tokens_and_order() -> None:
    tokens = [10, 20, 30, 40]
    root = hash_block(None, tokens)
    assert hash_block(h(1), tokens) != root
    assert hash_block(h(1), tokens) != hash_block(h(2), tokens)
    assert hash_block(None, [20, 10, 30, 40]) != root
    assert hash_block(None, [10, 20, 30]) != root
    # Big vocabularies and ids past 2**32 encode without collisions.
    assert hash_block(None, [2**32 + 1]) != hash_block(None, [1])


def test_hash_full_blocks_skips_partial_block_and_chains() -> None:
    assert hash_full_blocks([1, 2, 3], 4) == []
    assert hash_full_blocks([], 4) == []
    a, b = hash_full_blocks(list(range(8)), 4)
    assert a == hash_block(None, [0, 1, 2, 3])
    assert b == hash_block(a, [4, 5, 6, 7])
    # Same second-block tokens behind a different first block: different hash.
    assert hash_full_blocks([9, 9, 9, 9, 4, 5, 6, 7], 4)[1] != b
    with pytest.raises(ValueError, match="block_size"):
        hash_full_blocks([1, 2], 0)


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**31), max_size=40), block_size=st.integers(1, 6), split=st.integers(0, 8)
)
def test_hash_full_blocks_split_with_parent_equals_whole(
    tokens: list[int], block_size: int, split: int
) -> None:
    whole = hash_full_blocks(tokens, block_size)
    assert len(whole) == len(tokens) // block_size
    cut = min(split, len(whole)) * block_size
    head = hash_full_blocks(tokens[:cut], block_size)
    tail = hash_full_blocks(tokens[cut:], block_size, parent=head[-1] if head else None)
    assert head + tail == whole


# ---------------------------------------------------------------- allocation and free order


def test_allocate_fresh_pool_in_id_order_and_none_when_short() -> None:
    pool = BlockPool(num_blocks=6, block_size=4)
    assert (pool.num_blocks, pool.block_size, pool.num_free_blocks, pool.usage()) == (6, 4, 6, 0.0)
    assert pool.allocate(0) == []
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.num_free_blocks == 1
    assert pool.usage() == pytest.approx(5 / 6)
    assert pool.allocate(2) is None  # only one left: nothing taken
    assert pool.num_free_blocks == 1
    assert [pool.ref_count(b) for b in range(6)] == [1, 1, 1, 1, 1, 0]
    assert pool.allocate(1) == [5]
    assert pool.allocate(1) is None
    assert pool.usage() == 1.0
    pool.check_integrity()


def test_free_order_drives_next_allocation_order() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    a = pool.allocate(3)  # [0, 1, 2]
    b = pool.allocate(3)  # [3, 4, 5]
    assert (a, b) == ([0, 1, 2], [3, 4, 5])
    pool.free(b)  # queue: 6, 7, 5, 4, 3
    pool.free(a)  # queue: 6, 7, 5, 4, 3, 2, 1, 0
    assert pool.num_free_blocks == 8
    assert pool.allocate(8) == [6, 7, 5, 4, 3, 2, 1, 0]
    pool.check_integrity()


def test_free_only_queues_blocks_whose_ref_reaches_zero() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    ids = pool.allocate(4)
    assert ids == [0, 1, 2, 3]
    for b in ids:
        pool.cache_block(b, h(b))
    pool.take([1, 2])  # refs: 1, 2, 2, 1
    pool.free(ids)  # 3 and 0 reach 0 (in that order); 1 and 2 stay in use
    assert [pool.ref_count(b) for b in ids] == [0, 1, 1, 0]
    assert pool.num_free_blocks == 2
    pool.free([1, 2])  # 2 then 1
    assert pool.allocate(4) == [3, 0, 2, 1]


# ---------------------------------------------------------------- prefix sharing and eviction


def test_shared_prefix_refs_and_free_of_one_sequence() -> None:
    pool = BlockPool(num_blocks=10, block_size=4)
    prompt = list(range(100, 112))  # 3 full blocks
    hashes = hash_full_blocks(prompt, 4)
    seq_a = pool.allocate(4)  # 3 full prompt blocks + 1 for decode
    assert seq_a == [0, 1, 2, 3]
    for block_id, block_hash in zip(seq_a[:3], hashes, strict=True):
        pool.cache_block(block_id, block_hash)
    assert pool.num_cached_blocks == 3
    assert [pool.block_hash(b) for b in seq_a] == [*hashes, None]

    # Second sequence shares the first two blocks, then diverges.
    other = hash_full_blocks(prompt[:8] + [7, 7, 7, 7], 4)
    assert other[:2] == hashes[:2] and other[2] != hashes[2]
    hit = pool.match_prefix(other)
    assert hit == [0, 1]
    assert [pool.ref_count(b) for b in hit] == [1, 1]  # match_prefix takes no refs
    pool.take(hit)
    seq_b = hit + pool.allocate(1)
    assert seq_b == [0, 1, 4]
    pool.cache_block(4, other[2])
    assert [pool.ref_count(b) for b in range(5)] == [2, 2, 1, 1, 1]
    assert pool.usage() == pytest.approx(0.5)

    pool.free(seq_a)  # the shared blocks stay in use by seq_b
    assert [pool.ref_count(b) for b in range(5)] == [1, 1, 0, 0, 1]
    assert pool.num_free_blocks == 7
    assert pool.match_prefix(hashes) == [0, 1, 2]  # block 2 is free but still cached
    pool.check_integrity()

    # A third sequence revives free cached block 2 without evicting it.
    pool.take([0, 1, 2])
    assert [pool.ref_count(b) for b in range(3)] == [2, 2, 1]
    assert pool.block_hash(2) == hashes[2]
    assert pool.num_free_blocks == 6
    # Block 2 left the middle of the queue: fresh blocks first, then 3 (freed by seq_a).
    assert pool.allocate(6) == [5, 6, 7, 8, 9, 3]
    pool.check_integrity()


def test_eviction_order_and_on_evict_hashes() -> None:
    evicted = Evictions()
    pool = BlockPool(num_blocks=4, block_size=2, on_evict=evicted)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    hashes = hash_full_blocks(tokens, 2)
    seq = pool.allocate(4)
    for block_id, block_hash in zip(seq, hashes, strict=True):
        pool.cache_block(block_id, block_hash)
    pool.free(seq)  # queue: 3, 2, 1, 0 (tail of the prompt goes first)
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 4
    assert evicted == []

    assert pool.allocate(1) == [3]
    assert evicted == [hashes[3]]
    assert pool.block_hash(3) is None
    assert pool.match_prefix(hashes) == [0, 1, 2]

    assert pool.allocate(2) == [2, 1]
    assert evicted == [hashes[3], hashes[2], hashes[1]]
    assert pool.match_prefix(hashes) == [0]
    assert pool.num_cached_blocks == 1
    pool.check_integrity()


def test_match_prefix_stops_at_first_miss_after_middle_eviction() -> None:
    evicted = Evictions()
    pool = BlockPool(num_blocks=4, block_size=2, on_evict=evicted)
    hashes = hash_full_blocks(list(range(6)), 2)
    seq = pool.allocate(3)
    for block_id, block_hash in zip(seq, hashes, strict=True):
        pool.cache_block(block_id, block_hash)
    pool.free([seq[1]])  # only the middle block becomes free
    assert pool.allocate(2) == [3, 1]  # fresh block 3 first, then middle block 1 is evicted
    assert evicted == [hashes[1]]
    assert pool.match_prefix(hashes) == [0]  # block 2 is still cached but unreachable past the miss
    assert pool.match_prefix(hashes[2:]) == [2]
    assert pool.match_prefix([]) == []
    assert pool.match_prefix([h(999)] + hashes) == []


def test_cache_block_first_holder_wins_and_same_hash_is_idempotent() -> None:
    pool = BlockPool(num_blocks=3, block_size=2)
    a, b = pool.allocate(2)
    pool.cache_block(a, h(1))
    pool.cache_block(a, h(1))  # same hash again: no-op
    pool.cache_block(b, h(1))  # duplicate content in another block: first one wins
    assert pool.block_hash(b) is None
    assert pool.match_prefix([h(1)]) == [a]
    assert pool.num_cached_blocks == 1
    pool.check_integrity()


def test_reset_cache_drops_only_free_hashes() -> None:
    evicted = Evictions()
    pool = BlockPool(num_blocks=4, block_size=2, on_evict=evicted)
    ids = pool.allocate(3)
    for b in ids:
        pool.cache_block(b, h(b))
    pool.free([ids[0], ids[2]])  # queue: 3, 2, 0
    assert pool.reset_cache() == 2
    assert evicted == [h(2), h(0)]  # queue order
    assert [pool.block_hash(b) for b in range(4)] == [None, h(1), None, None]
    assert pool.num_cached_blocks == 1
    assert pool.reset_cache() == 0
    assert pool.allocate(3) == [3, 2, 0]  # reset keeps the queue order
    assert evicted == [h(2), h(0)]  # nothing left to evict on reuse
    pool.check_integrity()


def test_on_evict_runs_after_pool_state_is_consistent() -> None:
    pool: BlockPool

    def on_evict(block_hash: BlockHash) -> None:
        pool.check_integrity()
        assert pool.match_prefix([block_hash]) == []

    pool = BlockPool(num_blocks=2, block_size=2, on_evict=on_evict)
    ids = pool.allocate(2)
    pool.cache_block(ids[0], h(0))
    pool.free(ids)
    assert pool.allocate(2) == [1, 0]


# ---------------------------------------------------------------- misuse


def test_misuse_raises_and_leaves_pool_unchanged() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    ids = pool.allocate(2)
    pool.cache_block(ids[0], h(0))
    pool.free([ids[1]])

    with pytest.raises(BlockPoolError, match="ref count is 0"):
        pool.free([ids[1]])  # double free
    with pytest.raises(BlockPoolError, match="ref count is 1"):
        pool.free([ids[0], ids[0]])  # more frees than refs within one call
    with pytest.raises(BlockPoolError, match="unknown block id"):
        pool.free([ids[0], 4])  # valid id first: must not be half-applied
    with pytest.raises(BlockPoolError, match="unknown block id"):
        pool.free([-1])
    with pytest.raises(BlockPoolError, match="unknown block id"):
        pool.ref_count(True)  # type: ignore[arg-type]
    with pytest.raises(BlockPoolError, match="is free"):
        pool.cache_block(ids[1], h(1))
    with pytest.raises(BlockPoolError, match="already holds"):
        pool.cache_block(ids[0], h(5))
    with pytest.raises(BlockPoolError, match="must be bytes"):
        pool.cache_block(ids[0], "abc")  # type: ignore[arg-type]
    with pytest.raises(BlockPoolError, match="holds no hash"):
        pool.take([ids[0], ids[1]])  # second is not cached: first must not be taken either
    with pytest.raises(BlockPoolError, match="unknown block id"):
        pool.block_hash(99)
    with pytest.raises(BlockPoolError, match="cannot allocate"):
        pool.allocate(-1)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks=0, block_size=16)

    assert [pool.ref_count(b) for b in range(4)] == [1, 0, 0, 0]
    assert [pool.block_hash(b) for b in range(4)] == [h(0), None, None, None]
    assert pool.num_free_blocks == 3
    assert pool.allocate(3) == [2, 3, 1]
    pool.check_integrity()


# ---------------------------------------------------------------- model-based random operations


class Model:
    """The expected pool state, kept in the plainest possible form (O(n) lists are fine here)."""

    def __init__(self, num_blocks: int) -> None:
        self.refs = [0] * num_blocks
        self.hashes: list[BlockHash | None] = [None] * num_blocks
        self.free = list(range(num_blocks))
        self.evicted: list[BlockHash] = []

    def holder(self, block_hash: BlockHash) -> int | None:
        return next((b for b, x in enumerate(self.hashes) if x == block_hash), None)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        ids, self.free = self.free[:n], self.free[n:]
        for b in ids:
            if self.hashes[b] is not None:
                self.evicted.append(self.hashes[b])
                self.hashes[b] = None
            self.refs[b] = 1
        return ids

    def release(self, ids: list[int]) -> None:
        for b in reversed(ids):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)

    def cache(self, b: int, block_hash: BlockHash) -> None:
        if self.hashes[b] is None and self.holder(block_hash) is None:
            self.hashes[b] = block_hash

    def match(self, hashes: list[BlockHash]) -> list[int]:
        out = []
        for x in hashes:
            b = self.holder(x)
            if b is None:
                break
            out.append(b)
        return out

    def take(self, ids: list[int]) -> None:
        for b in ids:
            if self.refs[b] == 0:
                self.free.remove(b)
            self.refs[b] += 1

    def reset(self) -> int:
        dropped = [b for b in self.free if self.hashes[b] is not None]
        for b in dropped:
            self.evicted.append(self.hashes[b])
            self.hashes[b] = None
        return len(dropped)


def run_random_ops(num_blocks: int, steps: int, draw: Callable[[int, int], int]) -> None:
    """Apply `steps` random operations to a pool and a Model; compare every observable after each."""
    pool_evicted = Evictions()
    pool = BlockPool(num_blocks, block_size=2, on_evict=pool_evicted)
    model = Model(num_blocks)
    universe = [h(i) for i in range(num_blocks + 3)]  # few hashes: frequent hits and duplicates
    held: list[list[int]] = []  # each list holds one ref on each of its blocks

    for _ in range(steps):
        op = draw(0, 7)
        if op == 0:  # allocate
            n = draw(0, 4)
            got = pool.allocate(n)
            assert got == model.allocate(n)
            if got:
                held.append(got)
        elif op == 1 and held:  # free a slice of one holder's blocks
            ids = held.pop(draw(0, len(held) - 1))
            i = draw(0, len(ids))
            j = draw(i, len(ids))
            pool.free(ids[i:j])
            model.release(ids[i:j])
            rest = ids[:i] + ids[j:]
            if rest:
                held.append(rest)
        elif op == 2 and held:  # cache a block in use, possibly conflicting
            ids = held[draw(0, len(held) - 1)]
            b, x = ids[draw(0, len(ids) - 1)], universe[draw(0, len(universe) - 1)]
            if model.hashes[b] not in (None, x):
                with pytest.raises(BlockPoolError):
                    pool.cache_block(b, x)
            else:
                pool.cache_block(b, x)
                model.cache(b, x)
        elif op in (3, 4):  # prefix lookup, then take the hit
            query = [universe[draw(0, len(universe) - 1)] for _ in range(draw(0, 4))]
            hit = pool.match_prefix(query)
            assert hit == model.match(query)
            if op == 4 and hit:
                pool.take(hit)
                model.take(hit)
                held.append(hit)
        elif op == 5:  # misuse: free a block with ref 0, or take an uncached one
            b = draw(0, num_blocks - 1)
            if model.refs[b] == 0:
                with pytest.raises(BlockPoolError):
                    pool.free([b])
            if model.hashes[b] is None:
                with pytest.raises(BlockPoolError):
                    pool.take([b])
        elif op == 6 and draw(0, 5) == 0:  # rare: drop the whole free cache
            assert pool.reset_cache() == model.reset()

        pool.check_integrity()
        assert pool.num_free_blocks == len(model.free)
        assert pool.num_free_blocks + sum(r > 0 for r in model.refs) == num_blocks
        assert pool.num_cached_blocks == sum(x is not None for x in model.hashes)
        assert pool.usage() == pytest.approx(1 - len(model.free) / num_blocks)
        assert [pool.ref_count(b) for b in range(num_blocks)] == model.refs
        assert [pool.block_hash(b) for b in range(num_blocks)] == model.hashes
        assert pool_evicted == model.evicted

    # Draining: free everything still held, then the whole pool must come back in the model's order.
    for ids in held:
        pool.free(ids)
        model.release(ids)
    assert pool.num_free_blocks == num_blocks
    assert pool.allocate(num_blocks) == model.allocate(num_blocks)
    assert pool_evicted == model.evicted
    pool.check_integrity()


@pytest.mark.parametrize("seed", range(6))
def test_random_ops_match_model(seed: int) -> None:
    rng = random.Random(seed)
    run_random_ops(num_blocks=[1, 3, 5, 8, 12, 16][seed], steps=1500, draw=rng.randint)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), num_blocks=st.integers(1, 8))
def test_random_ops_match_model_hypothesis(data: st.DataObject, num_blocks: int) -> None:
    run_random_ops(num_blocks, steps=40, draw=lambda lo, hi: data.draw(st.integers(lo, hi)))


def test_check_integrity_detects_corruption() -> None:
    pool = BlockPool(num_blocks=3, block_size=2)
    ids = pool.allocate(2)
    pool.cache_block(ids[0], h(0))
    pool.check_integrity()
    # Reach inside on purpose to prove the check can fail; no public API can produce these states.
    pool._refs[2] = 1  # in use but still in the free queue
    with pytest.raises(BlockPoolError, match="free block 2 has ref count 1"):
        pool.check_integrity()
    pool._refs[2] = 0
    pool._hashes[ids[0]] = h(9)  # block and index disagree
    with pytest.raises(BlockPoolError, match="index"):
        pool.check_integrity()
    pool._hashes[ids[0]] = h(0)
    pool._refs[ids[1]] = -1
    with pytest.raises(BlockPoolError, match="ref count -1"):
        pool.check_integrity()


def test_on_cache_reports_new_hashes_and_reuse() -> None:
    cached: list[bytes] = []
    pool = BlockPool(num_blocks=4, block_size=2, on_cache=cached.append)
    hashes = hash_full_blocks([1, 2, 3, 4], 2)
    seq = pool.allocate(2)
    for block_id, block_hash in zip(seq, hashes, strict=True):
        pool.cache_block(block_id, block_hash)
    assert cached == hashes
    pool.cache_block(seq[0], hashes[0])  # already held: not reported again
    assert cached == hashes
    assert sorted(pool.cached_hashes()) == sorted(hashes)
    pool.free(seq)
    pool.take(pool.match_prefix(hashes))  # reuse refreshes the last access of both blocks
    assert cached == hashes + hashes
