"""How /v1/embeddings pools the served model's hidden states, read once at start.

A sentence-transformers checkpoint says it beside its weights: `modules.json` lists
its modules, a `sentence_transformers.models.Pooling` one names a folder whose
`config.json` sets `pooling_mode_cls_token`, `pooling_mode_mean_tokens` or
`pooling_mode_lasttoken`, and a `Normalize` module asks for unit vectors. Anything
else (a plain decoder, a GGUF file, a built-in name) pools the last token and
normalises, as decoder embedding models do; an encoder without that config takes
the mean of its tokens (sentence-transformers' default), normalised.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine import Pooling

_MODES = (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
          ("pooling_mode_cls_token", "cls"))


def checkpoint_pooling(model_spec: str, encoder: bool = False) -> Pooling:
    """`encoder`: the model is an encoder (BERT-like), whose default is the mean."""
    folder = Path(model_spec)
    modules_file = folder / "modules.json"
    if not folder.is_dir() or not modules_file.is_file():
        return Pooling("mean" if encoder else "last", normalize=True)
    modules = json.loads(modules_file.read_text())
    kinds = {module.get("type", "").rsplit(".", 1)[-1]: module.get("path", "")
             for module in modules}
    kind = "last"
    if "Pooling" in kinds:
        config = json.loads((folder / kinds["Pooling"] / "config.json").read_text())
        kind = next((name for key, name in _MODES if config.get(key)), "last")
    return Pooling(kind, normalize="Normalize" in kinds)
