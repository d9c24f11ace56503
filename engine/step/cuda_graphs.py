"""CUDA graphs of decode steps on the decode fast path.

A decode step of a small model is a few hundred short kernels; launching them one by
one from Python takes longer than running them. A CUDA graph records a step's kernels
once and replays them with one launch.

What makes a decode step replayable: on the decode fast path
(`AttentionMetadata.decode_fast_path`) every tensor the forward reads has a shape set
by the number of requests and the table width alone (input_ids, positions,
slot_mapping, seq_lens_k [B], block_table [B, width]; decode_tables.py chooses the
widths) and nothing in the forward reads a value back to the host. The graphs read
those tensors from static buffers sized for the largest batch and width; a step
copies its values in and replays the graph of its width and of the smallest batch
size ("bucket") that holds it:

    buckets (q_padding_interval_size 0: the preset): 1, 2, 4, 8, 16, 24, 32, ...
    a step of 11 requests replays bucket 16; its rows 11..15 are padding

Buckets stop at MAX_BUCKET requests; larger steps run eagerly. Padding rows must not
touch any request's pages: they feed token 0 at position 0, write their K/V into a
scratch page that no request ever holds (`scratch_block`, one block past the
allocator's) and read one key from it. Their outputs are dropped.

Graphs are recorded on the first step of each (bucket, width), or all at once by
`capture_all` (the manager's warmup), largest first, sharing one memory pool; only
pairs a step can reach (the torch backend's tables cap a step's keys, so wide tables
never meet large batches: decode_tables.py). A recording that runs out of memory
leaves that pair to eager steps; any other failure turns graphs off for good, with a
warning. Recording and replay run on the cache's device (not the thread's current
one). With `capture=False` the same padded steps run eagerly on
the static buffers: the CPU tests check the padding and bucket logic that way.
Called only from the engine thread.
"""

from __future__ import annotations

import contextlib
import itertools
import logging

import torch

from ..attention.metadata import AttentionMetadata, FixedTableMetadata
from .decode_tables import DecodeTables

logger = logging.getLogger(__name__)

MAX_BUCKET = 512
"""Largest batch a graph is recorded for (each bucket holds a graph per width)."""
PRESET_BUCKETS = (1, 2, 4, 8)
"""Below the preset interval, powers of two: small batches are the common case."""
PRESET_INTERVAL = 8


def graph_batch_sizes(max_requests: int, interval: int = 0) -> list[int]:
    """Bucket sizes up to the first one holding `max_requests`: multiples of
    `interval`, or with 0 the preset (1, 2, 4, 8, then every 8)."""
    if max_requests < 1:
        raise ValueError(f"max_requests must be >= 1, got {max_requests}")
    candidates = (itertools.count(interval, interval) if interval else
                  itertools.chain(PRESET_BUCKETS, itertools.count(2 * PRESET_INTERVAL,
                                                                  PRESET_INTERVAL)))
    sizes = []
    for size in candidates:
        sizes.append(size)
        if size >= max_requests:
            return sizes
    raise AssertionError("unreachable: the candidates never end")


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, cache, max_requests: int, tables: DecodeTables,
                 scratch_block: int, interval: int = 0, capture: bool = True,
                 layer_step=None, backend=None,
                 attention_dtype: torch.dtype = torch.float32) -> None:
        """`tables`: the decode fast path's width policy. `layer_step`: the decode
        path's compiled layer step (compile_paths.py), which the graphs then record, or
        None. `backend`: the runner's attention backend, which the recorded forwards
        call (its per-step gather in `attention_dtype`)."""
        self.model, self.cache, self.capture = model, cache, capture
        self.backend, self.attention_dtype = backend, attention_dtype
        self.layer_step = layer_step
        self.tables = tables
        self.sizes = graph_batch_sizes(min(max_requests, MAX_BUCKET), interval)
        self.widths = tables.widths()
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * cache.page_size
        device, largest = cache.device, self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(largest, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(largest, self.widths[-1], dtype=torch.int32,
                                       device=device)
        self.cu_seqlens_q = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self._pad(0, largest)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.failed = False
        """A recording failed: no more graphs, every step eager."""
        self.eager_pairs: set[tuple[int, int]] = set()
        """(bucket, width) pairs whose recording ran out of memory: eager steps."""
        self.num_steps = 0
        """Decode steps run through the static buffers (replayed, or eager)."""

    def fits(self, meta: AttentionMetadata, num_requests: int) -> bool:
        """Whether a step can replay a graph: decode fast path, no sliding group, at
        most the largest bucket, a width of the policy."""
        return (not self.failed and isinstance(meta, FixedTableMetadata) and meta.sliding is None
                and num_requests <= self.sizes[-1] and meta.block_table.shape[1] in self.widths)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """The final hidden states [B, hidden] of a decode step that `fits`."""
        num_requests, width = input_ids.numel(), meta.block_table.shape[1]
        size = next(s for s in self.sizes if s >= num_requests)
        self.input_ids[:num_requests].copy_(input_ids)
        self.positions[:num_requests].copy_(positions)
        self.slot_mapping[:num_requests].copy_(meta.slot_mapping)
        self.seq_lens[:num_requests].copy_(meta.seq_lens_k)
        self.block_table[:num_requests, :width].copy_(meta.block_table)
        self._pad(num_requests, size)
        self.num_steps += 1
        with self._on_device():
            if self._to_record((size, width)):
                self._record(size, width)
            if (size, width) not in self.graphs:
                return self._forward(size, width)[:num_requests]
            graph, output = self.graphs[size, width]
            graph.replay()
        return output[:num_requests]

    def reachable_pairs(self) -> list[tuple[int, int]]:
        """The (bucket, width) pairs some step can replay, largest first: a bucket's
        smallest step (one more request than the bucket below) must get that width."""
        pairs = []
        for width in reversed(self.widths):
            for below, size in reversed(list(zip([0] + self.sizes, self.sizes))):
                if self.tables.width_for(width, below + 1, self.cache.page_size) == width:
                    pairs.append((size, width))
        return pairs

    def capture_all(self) -> int:
        """Record every reachable (bucket, width) graph, largest first (the smaller recordings
        then fit in the memory the larger ones' intermediates left in the pool), with
        padding rows only, so the recordings' warm-up passes write only to the scratch
        page. Returns how many graphs there are."""
        if not self.capture:
            return 0
        self._pad(0, self.sizes[-1])
        with self._on_device():
            for pair in self.reachable_pairs():
                if self._to_record(pair):
                    self._record(*pair)
        return len(self.graphs)

    def release(self) -> None:
        """Drop the graphs and their memory pool (the manager's destroy)."""
        self.graphs.clear()
        self.pool = None

    def _pad(self, start: int, end: int) -> None:
        """Rows start..end-1 become padding: token 0 at position 0, its K/V written to
        and read from the scratch page."""
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[start:end] = self.scratch_slot
        self.seq_lens[start:end] = 1
        self.block_table[start:end] = self.scratch_block

    def _meta(self, size: int, width: int) -> FixedTableMetadata:
        """A new object on every call, inside each recorded forward: the backend's
        per-step gather is then built in the graph too, from the static buffers, and a
        recording never reuses tensors an earlier pass built."""
        seq_lens, table = self.seq_lens[:size], self.block_table[:size, :width]
        gather = self.backend.decode_gather(seq_lens, table, self.cache.page_size, None,
                                            self.attention_dtype)
        return FixedTableMetadata(
            slot_mapping=self.slot_mapping[:size], cu_seqlens_q=self.cu_seqlens_q[:size + 1],
            seq_lens_k=seq_lens, page_size=self.cache.page_size, block_table=table,
            gather=gather)

    def _forward(self, size: int, width: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.cache,
                          self._meta(size, width), self.backend, layer_step=self.layer_step)

    def _to_record(self, pair: tuple[int, int]) -> bool:
        return (self.capture and not self.failed and pair not in self.graphs
                and pair not in self.eager_pairs)

    def _on_device(self):
        """The cache's CUDA device as the current one: streams, recordings and replays
        belong to the current device, which is per thread (0 unless set)."""
        if self.cache.device.type != "cuda":
            return contextlib.nullcontext()
        return torch.cuda.device(self.cache.device)

    def _record(self, size: int, width: int) -> None:
        """Record the graph of (size, width); call within `_on_device`."""
        try:
            # one eager pass on a side stream first: lazy initialisation (cuBLAS
            # handles, workspaces) must not happen inside the recording
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(size, width)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                output = self._forward(size, width)
        except torch.cuda.OutOfMemoryError as error:   # a smaller pair may still fit
            logger.warning("CUDA graph of batch %d x %d blocks not recorded (%s); those "
                           "decode steps run eagerly", size, width, error)
            self.eager_pairs.add((size, width))
            return
        except RuntimeError as error:    # an op that cannot be recorded
            logger.warning("CUDA graphs off: recording batch %d x %d blocks failed (%s); "
                           "decode steps run eagerly", size, width, error)
            self.failed = True
            self.release()
            return
        self.pool = graph.pool()
        self.graphs[size, width] = (graph, output)
