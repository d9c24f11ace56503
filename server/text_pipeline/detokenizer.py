"""Incremental detokenization: token ids in, text pieces out, never broken UTF-8.

Decoding one token at a time does not work: a byte-level BPE token may hold half of
a multi-byte character (the emoji "🙂" can be two tokens), and SentencePiece tokens
decode differently at the start of a string than after other text. So, as vLLM and
TGI do, we decode a small window and emit only the difference:

    ids:      ... p p p | r r | n          (p = already emitted, before prefix_offset..
                 ^prefix_offset  ^read_offset                 read_offset = last emission)

    prefix_text = decode(ids[prefix_offset:read_offset])
    full_text   = decode(ids[prefix_offset:])
    new piece   = full_text[len(prefix_text):]

If the new piece ends in U+FFFD the last token stopped mid-character: emit nothing and
wait for the next token, which completes the character. `flush()` at the end emits
whatever is left, even an incomplete character (as U+FFFD).

The window starts with the last few prompt tokens, so the first generated token is
decoded in context (its leading space survives).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5


def ids_decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """`tokenizer.decode` without the tokenization-space clean-up, as a function of the
    ids alone. A fast tokenizer's decode is its Rust backend's behind a wrapper that
    costs more than the decoding of a few ids; where the tokenizer
    class keeps transformers' own `_decode`, the backend is called directly (the same
    text), else the wrapper."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:      # another transformers layout: the wrapper serves
        TokenizersBackend = None
    backend = getattr(tokenizer, "_tokenizer", None)
    if (TokenizersBackend is not None and isinstance(tokenizer, TokenizersBackend)
            and type(tokenizer)._decode is TokenizersBackend._decode and backend is not None):
        return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens,
                             clean_up_tokenization_spaces=False)


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text, piece by piece."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._decode = ids_decoder(tokenizer, skip_special_tokens)
        context = list(prompt_ids or [])[-PROMPT_CONTEXT_TOKENS:]
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    def _new_piece(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text):
            return ""
        if full_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""  # mid-character: wait for the bytes that complete it
        piece = full_text[len(prefix_text):]
        # Slide the window: what was read becomes context, and drop older ids.
        self._ids = self._ids[self._read_offset:] if not final else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        return piece

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text it completes (maybe "")."""
        self._ids.append(token_id)
        return self._new_piece(final=False)

    def flush(self) -> str:
        """Return text still held back (an unfinished character shows as U+FFFD)."""
        if self._read_offset == len(self._ids):
            return ""
        return self._new_piece(final=True)


def decode_all(tokenizer: Any, token_ids: list[int], skip_special_tokens: bool = True) -> str:
    """The text of a complete token list: one call into the decoder the streams use.
    The pieces a stream emits join to this same text (tests/server/test_detokenizer.py
    checks it on split characters); decoding piece by piece here would hold the
    interpreter for seconds on a long list and stall the engine thread beside it."""
    return ids_decoder(tokenizer, skip_special_tokens)(list(token_ids))
