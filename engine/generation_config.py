"""GenerationConfig (model side: sampling and stopping) and the per-request
SamplingParams resolved from it plus `add_request` keyword arguments."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidRequestError


def _eos_list(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@dataclass(frozen=True)
class GenerationConfig:
    """Uses transformers' field names; `from_any` also takes a transformers
    GenerationConfig (or any object with these attributes)."""

    max_new_tokens: int = 20
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = 50
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        params = SamplingParams.from_generation_config(self)
        params.validate(prefix="GenerationConfig")

    @classmethod
    def from_any(cls, value: Any) -> "GenerationConfig":
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):     # settings the engine does not run: unsupported_settings
            return cls(**{k: v for k, v in value.items() if k not in UNSUPPORTED_SETTINGS})
        kwargs = {}
        for f in dataclasses.fields(cls):
            attr = getattr(value, f.name, None)
            if attr is not None:
                kwargs[f.name] = list(attr) if isinstance(attr, tuple) else attr
        return cls(**kwargs)

    def replace(self, **changes: Any) -> "GenerationConfig":
        return dataclasses.replace(self, **changes)


UNSUPPORTED_SETTINGS: dict[str, tuple] = {
    "num_beams": (1,), "diversity_penalty": (0.0,), "no_repeat_ngram_size": (0,),
    "encoder_no_repeat_ngram_size": (0,), "bad_words_ids": (), "min_length": (0,),
    "min_new_tokens": (0,), "suppress_tokens": (), "begin_suppress_tokens": (),
    "forced_bos_token_id": (), "forced_eos_token_id": (), "sequence_bias": (),
    "typical_p": (1.0,), "epsilon_cutoff": (0.0,), "eta_cutoff": (0.0,),
    "encoder_repetition_penalty": (1.0,), "exponential_decay_length_penalty": (),
    "guidance_scale": (1.0,), "watermarking_config": (), "renormalize_logits": (False,),
    "remove_invalid_values": (False,),
}
"""transformers GenerationConfig settings whose logits processors (or search modes) the
engine does not run, with the values that ask for nothing (None and empty always do)."""


def unsupported_settings(value: Any) -> list[str]:
    """`name=value` for each setting of a generation config (transformers', a dict,
    any object) that asks for a processor the engine does not run. The model's entry
    points drop them with a warning, or refuse them with `drop_unsupported_processors`
    False."""
    if value is None or isinstance(value, GenerationConfig):
        return []
    found = []
    for name, neutral in UNSUPPORTED_SETTINGS.items():
        setting = value.get(name) if isinstance(value, dict) else getattr(value, name, None)
        if setting is None or setting in neutral or (
                isinstance(setting, (list, tuple, dict)) and not setting):
            continue
        found.append(f"{name}={setting!r}")
    return found


SAMPLING_KWARGS = (
    "do_sample", "temperature", "top_k", "top_p", "min_p", "seed",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias",
    "logprobs", "top_logprobs", "speculative",
)
"""Per-request keyword arguments accepted by `add_request`."""


@dataclass(frozen=True)
class SamplingParams:
    """Everything the sampler needs for one request. Greedy when `do_sample` is
    False or `temperature` is 0."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0              # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0          # 0 = off
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0
    speculative: bool = True
    """False: the request never takes drafts (speculative decoding off for it alone)."""

    @property
    def is_greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0.0

    @property
    def needs_token_counts(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @classmethod
    def from_generation_config(cls, config: GenerationConfig) -> "SamplingParams":
        return cls(
            do_sample=bool(config.do_sample),
            temperature=float(config.temperature if config.temperature is not None else 1.0),
            top_k=int(config.top_k or 0),
            top_p=float(config.top_p if config.top_p is not None else 1.0),
            min_p=float(config.min_p or 0.0),
            repetition_penalty=float(config.repetition_penalty or 1.0),
        )

    def with_overrides(self, overrides: dict[str, Any], vocab_size: int | None) -> "SamplingParams":
        unknown = sorted(set(overrides) - set(SAMPLING_KWARGS))
        if unknown:
            raise InvalidRequestError(f"unknown generation argument(s): {', '.join(unknown)}")
        values = {k: v for k, v in overrides.items() if v is not None}
        if "top_k" in values:
            values["top_k"] = values["top_k"] or 0
        if "min_p" in values:
            values["min_p"] = values["min_p"] or 0.0
        if "logit_bias" in values:
            values["logit_bias"] = {int(k): float(v) for k, v in values["logit_bias"].items()}
        if "temperature" in values and "do_sample" not in values:
            values["do_sample"] = values["temperature"] > 0
        params = dataclasses.replace(self, **values)
        params.validate(prefix="request", vocab_size=vocab_size)
        return params

    def validate(self, prefix: str, vocab_size: int | None = None) -> None:
        def bad(name: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(f"{prefix}.{name}: {message}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, f"must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be a non-negative integer")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= 20:
            raise bad("top_logprobs", "must be an integer in [0, 20]")
        if not isinstance(self.speculative, bool):
            raise bad("speculative", f"must be true or false, got {self.speculative!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed", "must be an integer")
        for token_id, bias in self.logit_bias.items():
            if vocab_size is not None and not 0 <= token_id < vocab_size:
                raise bad("logit_bias", f"token id {token_id} outside the vocabulary")
            if not math.isfinite(bias):
                raise bad("logit_bias", "biases must be finite numbers")


def resolve_eos(config_eos: Any, request_eos: Any) -> tuple[int, ...]:
    """A request's EOS ids: its own when given (an empty list disables EOS), else the
    generation config's."""
    if request_eos is not None:
        return _eos_list(request_eos)
    return _eos_list(config_eos)
