"""The prefix-cache key: a chain of block hashes over a prompt's token ids. The router computes it to
ask the index who holds a prompt's blocks; the workers' block pools compute the same hashes for the
blocks they cache. Stable across processes and machines."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes

_ROOT = b"\x00"  # tag for a block with no parent; a parent is tagged b"\x01" + its length + its bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """16-byte blake2b over the parent hash and the token ids as little-endian int64 (stable everywhere)."""
    head = _ROOT if parent is None else b"\x01" + struct.pack("<I", len(parent)) + parent
    return hashlib.blake2b(head + struct.pack(f"<{len(token_ids)}q", *token_ids), digest_size=16).digest()


def adapter_root(content_id: str | None) -> BlockHash | None:
    """The parent of a prompt's first block under a LoRA adapter (None for the base model): KV computed under
    one adapter's weights never matches a prompt under another adapter or the base model."""
    if not content_id:
        return None
    return hashlib.blake2b(b"\x02lora" + content_id.encode(), digest_size=16).digest()


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, parent: BlockHash | None = None
) -> list[BlockHash]:
    """One chained hash per full block of `token_ids`; a trailing partial block gets none."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
