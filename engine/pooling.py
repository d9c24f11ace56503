"""Embeddings: a request that wants its prompt's pooled hidden state instead of a
continuation (the server's /v1/embeddings).

Such a request runs through the engine's batching as prefill-only work: its prompt
is fed in chunks beside other requests' prefills and decodes, and when the last
chunk has run it finishes with `GenerationOutput.embedding`, no token generated.

    Pooling(kind, normalize)
      last   the final hidden state (after the model's last norm) of the last prompt
             token: decoder embedding models (Qwen3-Embedding, e5-mistral)
      mean   the mean over every prompt token's, summed chunk by chunk
      cls    the first token's (BERT-style checkpoints)
      normalize: scaled to unit L2 norm
      classify: the pooled state goes through the checkpoint's sequence-classification
             head (a `*ForSequenceClassification` checkpoint's `score` linear layer),
             and the output carries its num_labels logits instead of a vector:
             cross-encoder rerankers (the server's /v1/rerank and /v1/score)

The reductions run on the engine thread over each step's hidden states (runner.py,
`pooled_parts`); this module is plain Python (the scheduler imports requests.py,
which holds a Pooling).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidRequestError

POOLING_KINDS = ("last", "mean", "cls")


@dataclass(frozen=True)
class Pooling:
    kind: str = "last"
    normalize: bool = True
    classify: bool = False

    def __post_init__(self) -> None:
        if self.kind not in POOLING_KINDS:
            raise InvalidRequestError(f"pooling.kind: must be one of {', '.join(POOLING_KINDS)}, "
                                      f"got {self.kind!r}")
        if self.classify and self.normalize:
            raise InvalidRequestError("pooling.normalize: a classifying request's logits are "
                                      "not normalised; pass normalize=False")
