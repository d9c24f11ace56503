"""The base of every request schema: strict, closed, finite.

Strict: a JSON string is not a number and 2.0 is not an integer. Closed: an unknown
key is a 400 naming it. Finite: NaN and Infinity are refused.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
