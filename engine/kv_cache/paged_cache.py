"""PagedKVCache: the K and V tensors of every layer, split into blocks of pages.

    key_caches[layer]   : [num_blocks, page_size, num_kv_heads, head_dim]
    value_caches[layer] : same

Block b of every layer together is "block b": the allocator hands out block ids, and a
request's token at position p lives at page offset p % page_size of block
block_ids[p // page_size] in every layer. Tensors are zero-filled (never read as
garbage through a padding slot; on CPU, untouched zero pages cost no RAM).
"""

from __future__ import annotations

import torch


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device,
                 pin_memory: bool = False) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        shape = (num_blocks, page_size, num_kv_heads, head_dim)
        def make() -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)

        self.key_caches = [make() for _ in range(num_layers)]
        self.value_caches = [make() for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * element_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block(
            self.num_layers, self.page_size, self.num_kv_heads, self.head_dim, self.dtype)

    def release(self) -> None:
        """Drop the tensors (the manager's destroy)."""
        self.key_caches = []
        self.value_caches = []


def copy_blocks(source: PagedKVCache, target: PagedKVCache,
                pairs: list[tuple[list[int], list[int]]]) -> None:
    """Copy blocks source[a] -> target[b] in every layer, for each (a_ids, b_ids) pair."""
    if not pairs:
        return
    source_ids = torch.tensor([i for a, _ in pairs for i in a], device=source.device)
    target_ids = torch.tensor([i for _, b in pairs for i in b], device=target.device)
    for caches in ((source.key_caches, target.key_caches),
                   (source.value_caches, target.value_caches)):
        for source_layer, target_layer in zip(*caches):
            blocks = source_layer.index_select(0, source_ids).to(target.device, non_blocking=True)
            target_layer.index_copy_(0, target_ids, blocks)
