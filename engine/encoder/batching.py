"""One encoder step: a group of embedding requests, padded into one batch, run
through the encoder, each row pooled.

    requests  [ids_0 (5 tokens), ids_1 (3 tokens)]
    input_ids [[t t t t t], [t t t p p]]     p: the pad token      [B, L]
    attention [[1 1 1 1 1], [1 1 1 0 0]]     padding attends to nothing
    hidden    encoder(...).last_hidden_state                        [B, L, hidden]

Each row's pooled state is read from its own tokens only (mean over the unpadded
rows, the first row, or its last real row), then pooling_step.embedding_of finishes
it as the paged engine does (mean's division, normalisation).

`token_groups` splits the waiting requests into such batches: in arrival order, each
batch's padded size (rows x longest input) within the token budget.
"""

from __future__ import annotations

import torch

from ..pooling import Pooling
from ..step.pooling_step import embedding_of


def token_groups(lengths: list[int], max_batch_tokens: int) -> list[list[int]]:
    """Indices of `lengths` in batches of at most `max_batch_tokens` padded tokens
    (an input longer than the budget runs alone)."""
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index, length in enumerate(lengths):
        wider = max(longest, length)
        if current and wider * (len(current) + 1) > max_batch_tokens:
            groups.append(current)
            current, wider = [], length
        current.append(index)
        longest = wider
    if current:
        groups.append(current)
    return groups


@torch.inference_mode()
def encode_batch(module: torch.nn.Module, inputs: list[list[int]], poolings: list[Pooling],
                 pad_token_id: int, device: torch.device) -> list[list[float]]:
    """The embedding of each input (see the module docstring)."""
    longest = max(len(ids) for ids in inputs)
    input_ids = torch.full((len(inputs), longest), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(inputs), longest), dtype=torch.long)
    for row, ids in enumerate(inputs):
        input_ids[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention[row, :len(ids)] = 1
    hidden = module(input_ids=input_ids.to(device),
                    attention_mask=attention.to(device)).last_hidden_state   # [B, L, hidden]
    vectors = []
    for row, (ids, pooling) in enumerate(zip(inputs, poolings)):
        states = hidden[row, :len(ids)].float()                          # [n, hidden]
        if pooling.kind == "mean":
            pooled = states.sum(dim=0)
        else:
            pooled = states[0] if pooling.kind == "cls" else states[-1]
        vectors.append(embedding_of(pooled, pooling, len(ids)))
    return vectors
