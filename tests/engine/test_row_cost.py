"""How many drafts a step takes from the measured cost of one more row
(engine/speculative/row_cost.py): all of them where rows are nearly free, none in a
compute-bound batch unless they are nearly sure, every allowed one before the cost is
known; and the engine feeds the model its decode steps."""

from __future__ import annotations

import pytest

from engine.core.requests import RequestState
from engine.generation_config import SamplingParams
from engine.speculative.config import SpeculativeConfig
from engine.speculative.proposer import NgramProposer
from engine.speculative.row_cost import RowCost, acceptance_of


def measured(base: float, per_row: float, rows=(1, 2, 4, 8), steps: int = 5) -> RowCost:
    cost = RowCost()
    for _ in range(steps):
        for n in rows:
            cost.record(n, base + per_row * n)
    return cost


def test_the_line_is_fitted_to_the_steps():
    base, per_row = measured(0.060, 0.004).line()
    assert base == pytest.approx(0.060) and per_row == pytest.approx(0.004)


def test_before_two_row_counts_are_known_every_allowed_draft_is_taken():
    cost = measured(0.060, 0.050, rows=(1,))
    assert cost.line() is None
    assert cost.drafts_worth(0.1, 1, 6) == 6
    cost.record(2, 0.16)                       # a second row count, seen once: not yet
    assert cost.drafts_worth(0.1, 1, 6) == 6


def test_cheap_rows_take_drafts_that_are_kept_now_and_then():
    cost = measured(0.060, 0.002)             # a row: 3% of a one-row step
    assert cost.drafts_worth(0.7, 1, 8) == 8   # 0.7 ** 8 = 0.058 >= 0.032
    assert cost.drafts_worth(0.3, 1, 8) == 2   # 0.3 ** 2 = 0.09, 0.3 ** 3 = 0.027


def test_a_compute_bound_batch_takes_none_unless_they_are_nearly_sure():
    cost = measured(0.010, 0.020)             # each row a full share of the step
    assert cost.drafts_worth(0.7, 8, 4) == 0
    assert cost.drafts_worth(0.99, 8, 4) == 4  # kept nearly always: still worth it


def test_a_row_count_seen_often_does_not_drown_the_others():
    cost = measured(0.060, 0.004)
    for _ in range(1000):
        cost.record(1, 0.064)
    assert cost.line()[1] == pytest.approx(0.004)


def test_a_requests_acceptance_starts_from_the_engines():
    assert acceptance_of(0, 0, 0, 0) == pytest.approx(0.5)
    assert acceptance_of(0, 0, 89, 98) == pytest.approx(0.9)
    assert acceptance_of(0, 20, 89, 98) < 0.2   # its own record outweighs the prior


def _request(generated: int) -> RequestState:
    request = RequestState("r", list(range(40)) * 2, 64, (), SamplingParams())
    request.generated_tokens.extend([1] * generated)
    return request


def test_the_proposer_offers_what_the_rows_are_worth():
    proposer = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    request = _request(0)
    assert proposer.limit(request, batch_size=8) == 4          # cost unknown yet
    for _ in range(5):
        for rows in (8, 12, 16):
            proposer.record_step(rows, 0.010 + 0.020 * rows)   # compute-bound
    assert proposer.limit(request, batch_size=8) == 0
    assert proposer.propose(request, budget=64, batch_size=8) == ()
    cheap = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    for _ in range(5):
        for rows in (1, 3, 5):
            cheap.record_step(rows, 0.060 + 0.002 * rows)
    assert cheap.limit(request, batch_size=1) == 4


def test_a_seeded_sampled_request_keeps_its_allowance():
    """Its tokens hang on how many drafts it takes, so timing must not decide them."""
    proposer = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    for _ in range(5):
        for rows in (8, 12, 16):
            proposer.record_step(rows, 0.010 + 0.020 * rows)   # compute-bound
    seeded = _request(0)
    seeded.sampling = SamplingParams(do_sample=True, temperature=0.7, seed=5)
    assert proposer.limit(seeded, batch_size=8) == 4
    unseeded = _request(0)
    unseeded.sampling = SamplingParams(do_sample=True, temperature=0.7)
    assert proposer.limit(unseeded, batch_size=8) == 0
