"""Speculative decoding: proposers (prompt_lookup.py), the verify rule
(acceptance.py) and the setting (config.py)."""

from .acceptance import Verdict, verify_greedy, verify_sampled
from .config import SpeculativeConfig
from .prompt_lookup import PromptLookup

__all__ = ["PromptLookup", "SpeculativeConfig", "Verdict", "verify_greedy", "verify_sampled"]
