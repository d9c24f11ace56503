"""The paged KV cache: block allocation (allocator.py, pure Python), the cache tensors
(paged_cache.py) and their sizing (sizing.py)."""
