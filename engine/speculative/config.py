"""SpeculativeConfig: how a server speculates, in vLLM's setting shape.

    --speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
                           "prompt_lookup_max": 4, "prompt_lookup_min": 2}'

`method`: "ngram", prompt lookup over the request's own prompt and output
(prompt_lookup.py); or "suffix", the same plus the outputs of recent requests
(suffix_cache.py): `suffix_decoding_max_cached_requests` of them are kept (the
oldest evicted), and a shared continuation is proposed while its estimated
probability stays at `suffix_decoding_min_token_prob` or more (both unread by
"ngram"); or "draft_model", a small model with the target's vocabulary (`model`:
any spec load_model takes) proposing greedily (draft_model.py).
`prompt_lookup_min`/`_max` bound the n-grams "ngram" and "suffix" match. `num_speculative_tokens` caps the
drafts per step. `disable_by_batch_size`: at this many running requests or more, steps decode
plainly (a large batch is compute-bound, and verifying drafts there costs more than
it saves). Validated once; errors name the field.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..json_setting import json_setting_fields

METHODS = ("ngram", "suffix", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int | None = None
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_min_token_prob: float = 0.1
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, "
                             f"got {self.method!r}")
        for name, value, low in (("num_speculative_tokens", self.num_speculative_tokens, 1),
                                 ("prompt_lookup_max", self.prompt_lookup_max, 1),
                                 ("prompt_lookup_min", self.prompt_lookup_min, 1),
                                 ("suffix_decoding_max_cached_requests",
                                  self.suffix_decoding_max_cached_requests, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"speculative_config.{name} must be an integer >= {low}, "
                                 f"got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min})"
                             f" must not exceed prompt_lookup_max ({self.prompt_lookup_max})")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config.model: required for method draft_model "
                             "(the draft's path, GGUF or name), and only for it")
        if self.model is not None and not (isinstance(self.model, str) and self.model):
            raise ValueError(f"speculative_config.model must be a non-empty string, got "
                             f"{self.model!r}")
        prob = self.suffix_decoding_min_token_prob
        if (not isinstance(prob, (int, float)) or isinstance(prob, bool)
                or not 0.0 <= prob <= 1.0):
            raise ValueError(f"speculative_config.suffix_decoding_min_token_prob must be a "
                             f"number in [0, 1], got {prob!r}")
        size = self.disable_by_batch_size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool)
                                 or size < 1):
            raise ValueError(f"speculative_config.disable_by_batch_size must be an integer "
                             f">= 1 or null, got {size!r}")

    @classmethod
    def from_any(cls, value: "SpeculativeConfig | dict | str | None"
                 ) -> "SpeculativeConfig | None":
        """A config from itself, a dict of its fields or their JSON text; None, "" or
        "null" turn speculation off. Unknown keys are an error naming them."""
        value = json_setting_fields(value, cls, "speculative_config")
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if "method" not in value:
            raise ValueError("speculative_config.method is required")
        return cls(**value)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
