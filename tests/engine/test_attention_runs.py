"""Mixed steps over a bf16 cache (kernels/paged_attention.c): the rows of a prefill
chunk, 8 or more of them, go to prefill_attention.c's blocked tiles as one job
(step_runs.c), every other row (decodes, short chunks) is attended one at a time.
Checked against float64 attention over the same cache, full and sliding-window
steps, and against the blocked kernel's own result for each chunk bit for bit (the
rows took the tiles: one at a time they would differ from it by ~1e-3)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import default_kernels

kernels = default_kernels()
needs_tiles = pytest.mark.skipif(
    kernels is None or not kernels.library.prefill_attention_apply(64),
    reason="needs the native kernels built with AVX512-BF16")

HEADS, KV_HEADS, DIM, SCALE = 9, 3, 64, 0.125


def _step(requests, window=None, num_slots=400, seed=0):
    """requests: (first position, rows) per request, a decode being one row. -> the
    step's queries, caches and the per-row arguments _with_step_queries builds: slot
    rows of each request's context (its window's part), starts and lengths."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(num_slots, KV_HEADS, DIM, generator=generator).bfloat16()
    values = torch.randn(num_slots, KV_HEADS, DIM, generator=generator).bfloat16()
    width = max(start + rows for start, rows in requests)
    slots = torch.randperm(num_slots, generator=generator)[:len(requests) * width]
    slots = slots.view(len(requests), width)
    slot_rows, starts, lengths = [], [], []
    for index, (start, rows) in enumerate(requests):
        first = 0 if window is None else max(0, start - window + 1)   # the row's first position
        for position in range(start, start + rows):
            keys_from = 0 if window is None else max(0, position - window + 1)
            slot_rows.append(index)
            starts.append(keys_from - first)
            lengths.append(position + 1 - keys_from)
        slots[index, :width - first] = slots[index, first:].clone()   # row holds first ..
    query = 2 * torch.randn(len(lengths), HEADS, DIM, generator=generator)
    as_long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    return (query, keys, values, slots, as_long(slot_rows),
            None if window is None else as_long(starts), as_long(lengths))


def _reference(query, keys, values, slots, slot_rows, starts, lengths):
    """float64 attention of each row over its own keys."""
    out = torch.empty(query.shape, dtype=torch.float64)
    for b in range(query.shape[0]):
        first = 0 if starts is None else int(starts[b])
        context = slots[slot_rows[b], first:first + lengths[b]]
        k = keys[context].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = values[context].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
        scores = torch.einsum("hd,lhd->hl", query[b].double(), k) * SCALE
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v)
    return out


def _tiles(query, keys, values, slots, rows, start_key, num_keys, window):
    """The blocked kernel alone on rows [rows) of the step: queries at key positions
    start_key .. of a context of num_keys slots."""
    out = torch.empty(len(rows), HEADS, DIM)
    part = query[rows].contiguous()
    context = slots[:num_keys].contiguous()
    status = kernels.library.prefill_attention_bf16(
        part.data_ptr(), HEADS * DIM, keys.data_ptr(), values.data_ptr(), context.data_ptr(),
        num_keys, keys.shape[0], 0, start_key, len(rows), HEADS, KV_HEADS, DIM, window, SCALE,
        out.data_ptr(), HEADS * DIM, kernels.num_threads)
    assert status == 0
    return out


FULL = [(25, 1), (30, 20), (0, 5), (0, 12), (60, 1)]      # decode, chunks of 20, 5, 12
SLIDING = [(5, 30), (40, 20), (70, 1), (10, 3), (0, 9)]   # window 16: chunks crossing it


@needs_tiles
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("requests,window", [(FULL, None), (SLIDING, 16)])
def test_chunk_rows_take_the_tiles_and_others_stay_exact(monkeypatch, threads, requests, window):
    monkeypatch.setattr(kernels, "num_threads", threads)
    query, keys, values, slots, slot_rows, starts, lengths = _step(requests, window)
    got = kernels.paged_decode_attention(query, keys, values, slots, lengths, SCALE,
                                         slot_rows=slot_rows, starts=starts)
    want = _reference(query, keys, values, slots, slot_rows, starts, lengths)
    row = 0
    for index, (start, rows) in enumerate(requests):
        span = list(range(row, row + rows))
        error = (got[span].double() - want[span]).abs().max().item()
        if rows >= 8:        # bf16 queries and probabilities: ~3e-3; a wrong window 0.1+
            first = 0 if window is None else max(0, start - window + 1)
            tiles = _tiles(query, keys, values, slots[index], span, start - first,
                           start + rows - first, window or 0)
            assert torch.equal(got[span], tiles), f"request {index}"
            assert error <= 1.5e-2 * want[span].abs().max().item(), f"request {index}"
        else:                # one row at a time, queries in two bf16 halves
            assert error <= 3e-5, f"request {index}"
        row += rows


@needs_tiles
def test_rows_that_are_no_chunk_stay_apart():
    """Eight rows of one slot row that do not see one key more each (the same decode
    position repeated, as no step schedules) are attended one at a time: no run forms."""
    query, keys, values, slots, slot_rows, starts, lengths = _step([(30, 1)])
    query = query.repeat(8, 1, 1) + torch.randn(8, HEADS, DIM)
    slot_rows, lengths = slot_rows.repeat(8), lengths.repeat(8)
    got = kernels.paged_decode_attention(query, keys, values, slots, lengths, SCALE,
                                         slot_rows=slot_rows)
    want = _reference(query, keys, values, slots, slot_rows, None, lengths)
    assert (got.double() - want).abs().max() <= 3e-5


@needs_tiles
def test_a_run_keeps_one_window():
    """Rows whose ends follow on but whose starts change window halfway (10 keys, then
    12) are cut into two runs, each with its own window."""
    query, keys, values, slots, _, _, _ = _step([(0, 40)])
    ends = torch.arange(20, 36)
    starts = torch.cat([ends[:8] - 10, ends[8:] - 12])
    lengths = ends - starts
    slot_rows = torch.zeros(16, dtype=torch.long)
    query = query[:16].contiguous()
    got = kernels.paged_decode_attention(query, keys, values, slots, lengths, SCALE,
                                         slot_rows=slot_rows, starts=starts)
    want = _reference(query, keys, values, slots, slot_rows, starts, lengths)
    assert (got.double() - want).abs().max() <= 1.5e-2 * want.abs().max()
