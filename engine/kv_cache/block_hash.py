"""Content hashes of full KV blocks, for prefix caching. Pure Python.

Block i of a request is identified by the hash of (hash of block i-1, its page_size
token ids): two requests share block i only if their first (i+1) * page_size tokens are
identical, so equal hashes mean equal K/V. blake2b keeps collisions out of reach even
for adversarial prompts.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Sequence


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent or b"root")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], page_size: int) -> None:
    """Append the hashes of every full block of `token_ids` not yet in `hashes`."""
    for index in range(len(hashes), len(token_ids) // page_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[index * page_size:(index + 1) * page_size]))
