"""Content hashes of full KV blocks, chained so that a hash names a whole prefix."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import NamedTuple


class BlockHash(NamedTuple):
    """Key of a full block in the prefix cache.

    `digest` is sha256(parent digest || token ids), so equal digests mean equal prefixes
    (sha256 rather than Python's hash(): a crafted collision of a weak hash would let one
    request read another's KV). `token_ids` are kept in the key as well, so a dict lookup
    also compares the block's own tokens: a digest collision alone can never produce a hit.
    """

    digest: bytes
    token_ids: tuple[int, ...]


# Parent digest of a sequence's first block (bytes are immutable: not module state).
ROOT_DIGEST = bytes(32)


def root_digest(lora_int_id: int = 0) -> bytes:
    """The parent digest of block 0 for requests of LoRA adapter `lora_int_id` (0: the base
    model): the adapter changes every layer's K and V, so the chains of different adapters
    never meet, and equal tokens under two adapters are two different prefixes."""
    if not lora_int_id:
        return ROOT_DIGEST
    return hashlib.sha256(b"lora" + lora_int_id.to_bytes(8, "little")).digest()


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], root: bytes = ROOT_DIGEST
) -> BlockHash:
    """Hash one full block given the hash of the block before it (None for block 0, which
    chains from `root`: `root_digest` of the request's adapter)."""
    hasher = hashlib.sha256(root if parent is None else parent.digest)
    # Fixed-width int64 encoding: unambiguous, and far cheaper than pickle or repr.
    hasher.update(array("q", token_ids).tobytes())
    return BlockHash(hasher.digest(), tuple(token_ids))


def external_hash(block_hash: BlockHash) -> int:
    """The block's hash as KV events and GET /v1/kv give it (what a router outside keys its index
    on): the first 8 bytes of the digest, big-endian, an unsigned 64-bit int. Every KV-cache
    group's block of one prefix has the same one (`group_index` tells them apart)."""
    return int.from_bytes(block_hash.digest[:8], "big")


def group_hash(block_hash: BlockHash, group: int) -> BlockHash:
    """The prefix-cache key of KV-cache group `group`'s block of a prefix: the groups' blocks
    hold different layers' KV of the same tokens, so each gets a key of its own (group 0 the
    plain hash)."""
    if group == 0:
        return block_hash
    return BlockHash(block_hash.digest + group.to_bytes(2, "little"), block_hash.token_ids)


def group_index(block_hash: BlockHash) -> int:
    """The KV-cache group a prefix-cache key belongs to: group g > 0 appends g (2 bytes,
    little-endian) to the group-0 digest (`group_hash`)."""
    return int.from_bytes(block_hash.digest[32:], "little")
