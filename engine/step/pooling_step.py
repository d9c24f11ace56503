"""The torch side of embedding requests (pooling.py): each step's part of a pooled
hidden state, and the finished embedding.

Per chunk of an embedding request's prompt (rows r0 .. r0 + n of the step's final
hidden states [T, hidden]):

    last   the chunk's last row, if the chunk ends the prompt, else nothing
    mean   the sum of the chunk's rows (the engine loop adds the chunks' sums)
    cls    row r0, if the chunk starts at position 0, else nothing

and once the prompt is done: mean divides by the prompt's length, then either
normalize scales to unit L2 norm, in fp32, or (classify) the model's classification
head turns the pooled state into its label logits.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..pooling import Pooling
from ..core.scheduler import ScheduledBatch, ScheduledRequest


def pooled_parts(hidden: torch.Tensor, batch: ScheduledBatch,
                 pooling_entries) -> list[tuple[ScheduledRequest, torch.Tensor]]:
    parts = []
    for index, row in pooling_entries:
        entry = batch.entries[index]
        kind = entry.request.pooling.kind
        rows = hidden[row:row + entry.num_tokens].float()
        if kind == "mean":
            parts.append((entry, rows.sum(dim=0)))
        elif kind == "last" and entry.samples:
            parts.append((entry, rows[-1].clone()))
        elif kind == "cls" and entry.start == 0:
            parts.append((entry, rows[0].clone()))
    return parts


def add_part(pooled: torch.Tensor | None, part: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """The pooled state after one more chunk's part."""
    return part if pooled is None or pooling.kind != "mean" else pooled + part


def embedding_of(pooled: torch.Tensor, pooling: Pooling, num_tokens: int,
                 classify: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[float]:
    """The finished request's output: its vector, or (pooling.classify) the label
    logits `classify` ([hidden] -> [num_labels]) gives for it."""
    vector = pooled / num_tokens if pooling.kind == "mean" else pooled
    if pooling.classify:
        return classify(vector).cpu().tolist()
    if pooling.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.cpu().tolist()
