"""The native greedy pick equals torch.argmax: first index among equal maxima, NaN
counts as the largest, rows shorter and longer than one 16-lane vector."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import load_native_kernels
from engine.step.sampling import greedy_picks


@pytest.fixture(scope="module")
def kernels():
    built = load_native_kernels()
    assert built is not None, "a C compiler is part of this project's CI machine"
    return built


@pytest.mark.parametrize("vocab", [1, 7, 16, 33, 49152])
def test_argmax_equals_torch(kernels, vocab):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(20, vocab, generator=generator)
    logits[3] = 0.0                                      # all equal: index 0
    if vocab > 5:
        logits[4, 2] = logits[4, vocab - 1] = 100.0      # tie: the first
        logits[5, vocab // 2] = float("nan")             # NaN wins
        logits[6, 1] = logits[6, vocab - 2] = float("nan")
        logits[7] = float("-inf")
        logits[8, vocab - 1] = float("inf")
    if vocab > 16:
        # a tie whose first index sits in a later vector lane than the second's
        # (lanes 3 and 1 of 8, lanes 13 and 1 of 16)
        logits[9, 13] = logits[9, 3] = logits[9, 17] = 50.0
    assert torch.equal(kernels.argmax(logits), logits.argmax(dim=-1))
    assert torch.equal(greedy_picks(logits), logits.argmax(dim=-1))
