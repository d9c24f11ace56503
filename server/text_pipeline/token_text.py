"""The text and exact bytes of single tokens, for logprobs responses.

OpenAI reports each token of a logprobs list as `{"token": str, "bytes": [int]}`.
A single token need not be valid UTF-8 on its own (half of "🙂"), so `decode([id])`
would return U+FFFD and lose the bytes. Byte-level BPE tokenizers (GPT-2 style, as in
SmolLM2, Llama 3, Qwen) store each byte as a printable stand-in character; inverting
that table gives the token's true bytes. Other tokenizers fall back to the UTF-8 of
`decode([id])`.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def _byte_level_table() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: stand-in character -> byte value."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return type(decoder).__name__ == "ByteLevel"


class TokenTexts:
    """Cached (text, bytes) of token ids for one tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._byte_level = _is_byte_level(tokenizer)
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._compute(token_id)
            if len(self._cache) < 200_000:
                self._cache[token_id] = cached
        return cached

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        if self._byte_level and token_id not in self._special:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            table = _byte_level_table()
            if isinstance(piece, str) and all(ch in table for ch in piece):
                raw = bytes(table[ch] for ch in piece)
                return _bytes_to_text(raw), list(raw)
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text, list(text.encode("utf-8"))


def _bytes_to_text(raw: bytes) -> str:
    """UTF-8 text when valid, else the "bytes:\\xNN" notation vLLM uses."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
