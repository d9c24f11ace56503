"""PagedKVCache: the K and V tensors of every layer, split into blocks of pages.

    key_caches[layer]   : [num_blocks, page_size, num_kv_heads, head_dim]
    value_caches[layer] : same

Block b of every layer together is "block b": the allocator hands out block ids, and a
request's token at position p lives at page offset p % page_size of block
block_ids[p // page_size] in every layer.

On a CPU host the tensors are left uninitialised (pages never touched cost no RAM):
every slot is written before the torch backend reads it, and its padded decode
contexts repeat the request's own last slot, so no garbage (or NaN) reaches attention.
On accelerators they start zeroed: flash attention's tiles may load slots past a
request's length or outside its window, which it masks, and a masked NaN would still
poison the output (0 * NaN).
"""

from __future__ import annotations

import torch


def kv_cache_dtype(device: torch.device, model_dtype: torch.dtype,
                   preferred: torch.dtype | None = None) -> torch.dtype:
    """The model's `kv_cache_dtype` when it names one (load_model's option; dtype
    bf16-weights asks for bf16: half the bytes for decode attention to stream), else
    fp32 on CPU (decode stays exact) and the model's dtype on accelerators."""
    if preferred is not None:
        return preferred
    return torch.float32 if device.type == "cpu" else model_dtype


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device,
                 pin_memory: bool = False, layer_num_blocks: list[int] | None = None) -> None:
        """`layer_num_blocks` gives layers of a separate pool (sliding-window layers of
        hybrid models) their own block count; by default every layer has num_blocks."""
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        counts = layer_num_blocks or [num_blocks] * num_layers

        allocate = torch.empty if torch.device(device).type == "cpu" else torch.zeros

        def make(count: int) -> torch.Tensor:
            return allocate((count, page_size, num_kv_heads, head_dim), dtype=dtype,
                            device=device, pin_memory=pin_memory)

        self.key_caches = [make(count) for count in counts]
        self.value_caches = [make(count) for count in counts]

    @staticmethod
    def bytes_per_block(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * element_size

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
            # non-blocking only towards an accelerator: the copy is queued before the
            # index_copy_ on the same stream. Towards the host, index_copy_ would read
            # the pinned buffer before the copy landed.
            blocks = source_layer.index_select(0, source_ids).to(
                target.device, non_blocking=target.device.type != "cpu")
            target_layer.index_copy_(0, target_ids, blocks)


def copy_slots(cache: PagedKVCache, copies: list[tuple[int, int, int]]) -> None:
    """For each (source block, target block, count), copy the first `count` slots of
    the source block to the same slots of the target block, in every layer (the
    partial-page prefixes of partial_prefix.py). Source and target slots never overlap:
    a target is a block its request was just given."""
    page_size = cache.page_size
    source_slots = [source * page_size + i for source, _, count in copies for i in range(count)]
    target_slots = [target * page_size + i for _, target, count in copies for i in range(count)]
    source_ids = torch.tensor(source_slots, device=cache.device)
    target_ids = torch.tensor(target_slots, device=cache.device)
    for layer in cache.key_caches + cache.value_caches:
        slots = layer.view(-1, *layer.shape[2:])        # [num_blocks * page_size, heads, dim]
        slots.index_copy_(0, target_ids, slots.index_select(0, source_ids))
