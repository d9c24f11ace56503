"""Which proposed tokens a verify step keeps: the exact rule for greedy requests and
rejection sampling (Leviathan et al. 2023; Chen et al. 2023) for sampled ones.

A verify step scores a request's last token and its k drafts d_1..d_k in one
forward pass: row i of the target's distributions, p_i, is the model's next-token
distribution after d_1..d_{i-1} (row 0 after the last accepted token). Then

    greedy:  keep d_i while d_i == argmax p_{i-1}; the first row that disagrees
             gives its argmax as the next token, or, all kept, row k gives a bonus
             token. The output is the tokens plain greedy decoding gives.
    sampled: keep d_i with probability min(1, p_{i-1}(d_i) / q_{i-1}(d_i)), q the
             proposer's distribution; at the first rejection sample from
             max(0, p - q) renormalised; all kept: sample the bonus from p_k. Each
             emitted token is then distributed exactly as p (the standard proof),
             so sampling keeps its distribution whatever the drafts.

Proposers that copy tokens (prompt lookup, suffix matching) propose with certainty:
q is a point mass on d_i, the acceptance probability is p(d_i) and the residual is p
with d_i removed. A draft model passes its own distributions.

Every accepted count is at least 0 and the step always emits one token more than it
accepted, so a verify step never yields fewer tokens than a plain decode step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verdict:
    """`accepted` drafts kept, then `next_token` (the correction or the bonus)."""

    accepted: int
    next_token: int

    @property
    def tokens_emitted(self) -> int:
        return self.accepted + 1


def verify_greedy(argmax: list[int], drafts: list[int]) -> Verdict:
    """argmax[i]: the target's best token at row i (len(drafts) + 1 rows)."""
    if len(argmax) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} scored rows, "
                         f"got {len(argmax)}")
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == argmax[accepted]:
        accepted += 1
    return Verdict(accepted, argmax[accepted])


def verify_sampled(probs: torch.Tensor, drafts: list[int],
                   draft_probs: torch.Tensor | None = None,
                   generator: torch.Generator | None = None) -> Verdict:
    """probs [k + 1, V]: the target's distributions (after temperature, top-k/top-p
    and masks, rows summing to 1); draft_probs [k, V] the proposer's, or None for a
    proposer that copies its drafts (a point mass on each). The random draws come
    from `generator` (a seeded request's own: the same request repeats itself)."""
    k = len(drafts)
    if probs.dim() != 2 or probs.shape[0] != k + 1:
        raise ValueError(f"{k} drafts need probs of shape [{k + 1}, vocab], "
                         f"got {tuple(probs.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (k, probs.shape[1]):
        raise ValueError(f"draft_probs must be [{k}, {probs.shape[1]}], "
                         f"got {tuple(draft_probs.shape)}")
    uniforms = torch.rand(k, generator=generator, device=probs.device) if k else None
    for i, draft in enumerate(drafts):
        target = probs[i]
        proposed = 1.0 if draft_probs is None else float(draft_probs[i, draft])
        if proposed > 0 and float(uniforms[i]) * proposed < float(target[draft]):
            continue                                  # u < p / q: kept
        residual = target.clone()
        if draft_probs is None:
            residual[draft] = 0.0
        else:
            residual = (residual - draft_probs[i]).clamp_min_(0.0)
        total = float(residual.sum())
        if total <= 0.0:      # p == q: a rejection has probability 0; keep the target
            residual, total = target, float(target.sum())
        token = int(torch.multinomial(residual / total, 1, generator=generator))
        return Verdict(i, token)
    bonus = int(torch.multinomial(probs[k], 1, generator=generator))
    return Verdict(k, bonus)
