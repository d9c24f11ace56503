"""What the server does with its model: generate text, or only embed (`task`).

    generate   the generation routes (chat, completions, responses, messages), and
               /v1/embeddings from the same model
    embed      /v1/embeddings only (and /v1/rerank, /v1/score for a sequence
               classifier); the generation routes answer 400 naming why

Unset, the checkpoint decides: a model that cannot generate (an encoder such as
BERT, or a *ForSequenceClassification checkpoint: no LM head) or a
sentence-transformers checkpoint (a modules.json beside the weights) embeds;
anything else generates. Asking a model without an LM head to generate stops the
server at start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TASKS = ("generate", "embed")


def serving_task(requested: str | None, model: Any, model_spec: str) -> str:
    """The task for `model` (an EngineModel or EncoderModel, whose `generates` says
    whether it has an LM head) loaded from `model_spec`; ValueError naming the
    conflict when `requested` is "generate" and the model cannot."""
    if requested == "generate" and not model.generates:
        raise ValueError("task 'generate': this model has no LM head (an encoder or a "
                         "sequence classifier); serve it with --task embed")
    if requested is not None:
        return requested
    if not model.generates or (Path(model_spec) / "modules.json").is_file():
        return "embed"
    return "generate"
