"""Constrained decoding: grammars a request's output must match, and the per-request
matcher that says which tokens may come next.

    GrammarSpec (what the caller asks for: a JSON schema, any JSON object, a regex,
      or a Lark grammar)
      -> GrammarCompiler.compile (any thread; InvalidRequestError naming the problem)
      -> CompiledGrammar (validated once; shared by every request that uses it)
      -> GrammarMatcher (one per request: engine thread only)

The matching itself is llguidance's (a Rust Earley parser over the tokenizer's
vocabulary, computing a token bitmask per step). It was chosen over xgrammar because
it needs nothing else at run time (xgrammar pulls in torch, transformers and triton
as dependencies of its wheel), compiles a schema lazily and computes masks on CPU
quickly enough to run beside a step (docs/structured-output.md, Why llguidance).

JSON is compact: no whitespace between tokens of the JSON text, so a constrained
answer cannot spend its budget on blank lines and closes as soon as its value does.
Once the grammar cannot be extended (the JSON value is complete) the request ends
with finish reason "stop" without waiting for an EOS token.

A budget that runs out mid-value would leave an invalid answer (a 135M model can
write digits forever), so each matcher watches its request's remaining tokens: near the end it plays out,
on a copy, a short way to complete the grammar (forced tokens first, else the first
allowed of a few closing characters: `" } ] , 0` ...), and once that path no longer
leaves a margin to spare, the request follows it token by token. The margin is what
one freely sampled token may add to the path: at most the path of a whole new value
(`},{"` starts another array item), so it is the grammar's path from its start.

No torch here (the scheduler imports requests.py, which imports this module); the
sampler fills and applies the masks (grammar_masks.py).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequestError

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "lark")

_JSON_OPTIONS = {"whitespace_flexible": False}
"""Compact JSON (llguidance's separators "," and ":", no free whitespace)."""

CLOSING_WINDOW = 64
"""Remaining tokens below which a matcher looks for its way to a complete output (or
three margins, when that is more)."""
CLOSING_MARGIN = 4
"""The least margin: one freely sampled token can open this many levels (`":[{"` is
one token in common vocabularies)."""
CLOSING_CHARACTERS = '"}],:01ntf' + "abcdefghijklmopqrsuvwxyz" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ" + "23456789[{<> .-_"
"""Tried in this order when no token is forced: closers first (the quote first, since
inside a string `}` is just a character; the comma before digits, since inside a
number another digit is always allowed), then what starts the shortest values and
spells property names, then openers; blanks last, since optional whitespace is
allowed almost anywhere and leads nowhere."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match.

    kind: "json_schema" (value: the schema, a dict or its JSON text), "json_object"
    (any JSON object; value ignored), "regex" (value: the pattern; the whole output
    matches it) or "lark" (value: a Lark grammar, llguidance's dialect: `start` is
    the top rule, `%json {...}` embeds a schema)."""

    kind: str
    value: Any = None
    closing_hints: tuple[str, ...] = ()
    """Texts the closing path tries first, each once, before single characters: what
    ends a part of the grammar where any character is allowed (`</think>` after a
    model's free reasoning)."""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidRequestError(
                f"grammar.kind: must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")
        if self.kind == "json_schema" and not isinstance(self.value, (dict, str, bool)):
            raise InvalidRequestError("grammar.value: a JSON schema (an object or its JSON text)")
        if self.kind in ("regex", "lark") and not (isinstance(self.value, str) and self.value):
            raise InvalidRequestError(f"grammar.value: a non-empty {self.kind} string")

    def to_llguidance(self) -> str:
        """The grammar in llguidance's own (JSON) form."""
        from llguidance import LLMatcher

        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.value)
        if self.kind == "lark":
            return LLMatcher.grammar_from_lark(self.value)
        schema = {"type": "object"} if self.kind == "json_object" else self.value
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise InvalidRequestError(f"grammar.value: not valid JSON: {exc}") from None
        try:
            return LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"grammar.value: {exc}") from None


@dataclass(frozen=True)
class CompiledGrammar:
    """A validated grammar bound to one tokenizer. Immutable and shareable: each
    request gets its own matcher from `new_matcher`."""

    spec: GrammarSpec
    _template: Any        # llguidance.LLMatcher in its start state; only deep-copied

    grammar_eos: tuple[int, ...]
    """The EOS ids llguidance allows once the grammar is complete (the model's)."""
    vocab_size: int

    closing_tokens: tuple[int, ...]
    """CLOSING_CHARACTERS as single-token ids of this vocabulary, in order."""
    closing_hints: tuple[tuple[int, ...], ...] = ()
    """The spec's closing hints as token ids."""
    closing_margin: int = CLOSING_MARGIN
    """Tokens kept to spare on the way to the end (the module docstring)."""

    def new_matcher(self, eos_token_ids: tuple[int, ...]) -> "GrammarMatcher":
        """A matcher at the start of the output, for a request ending on
        `eos_token_ids` (its own: empty under ignore_eos, or with stop ids added)."""
        own = tuple(eos_token_ids)
        return GrammarMatcher(self._template.deep_copy(), own, self.vocab_size,
                              eos_fix=None if set(own) == set(self.grammar_eos)
                              else (self.grammar_eos, own), closing_tokens=self.closing_tokens,
                              closing_hints=self.closing_hints,
                              closing_margin=self.closing_margin)


class GrammarCompiler:
    """Compiles specs against one tokenizer. Any thread; the llguidance view of the
    tokenizer (a pass over the whole vocabulary) is built on first use."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._ll_tokenizer = None
        self._closing_tokens: tuple[int, ...] = ()
        self._lock = threading.Lock()

    def ll_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                if self._tokenizer is None:
                    raise InvalidRequestError("grammar: this model has no tokenizer to match against")
                import llguidance.hf

                try:
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(
                        self._tokenizer, n_vocab=self.vocab_size, eos_token=self._eos or None)
                except ValueError as exc:   # a slow (Python) tokenizer
                    raise InvalidRequestError(f"grammar: {exc}") from None
                single = [self._ll_tokenizer.tokenize_str(c) for c in CLOSING_CHARACTERS]
                self._closing_tokens = tuple(ids[0] for ids in single if len(ids) == 1)
            return self._ll_tokenizer

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Raises InvalidRequestError with llguidance's message (it names the schema
        part, regex position or grammar line) when the grammar cannot be used."""
        from llguidance import LLMatcher

        grammar = spec.to_llguidance()
        tokenizer = self.ll_tokenizer()
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise InvalidRequestError(f"grammar ({spec.kind}): {messages[0].strip()}")
        template = LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise InvalidRequestError(f"grammar ({spec.kind}): {template.get_error()}")
        hints = tuple(tuple(tokenizer.tokenize_str(hint)) for hint in spec.closing_hints)
        compiled = CompiledGrammar(spec, template, tuple(tokenizer.eos_tokens), self.vocab_size,
                                   self._closing_tokens, hints)
        whole = compiled.new_matcher(compiled.grammar_eos)._path_to_completion(256)
        return dataclasses.replace(compiled, closing_margin=max(CLOSING_MARGIN, len(whole or ())))


class GrammarMatcher:
    """One request's position in its grammar. Engine thread only.

    The tokens it has consumed are exactly the request's generated tokens, so it
    survives preemption (recompute or offload) untouched: neither changes a token."""

    def __init__(self, matcher: Any, eos_token_ids: tuple[int, ...], vocab_size: int,
                 eos_fix: tuple[tuple[int, ...], tuple[int, ...]] | None,
                 closing_tokens: tuple[int, ...],
                 closing_hints: tuple[tuple[int, ...], ...] = (),
                 closing_margin: int = CLOSING_MARGIN) -> None:
        self._matcher = matcher
        self._closing_tokens = closing_tokens
        self._closing_hints = closing_hints
        self._closing_margin = closing_margin
        self._closing_path: list[int] = []
        """Once the budget is short: the tokens that complete the output, in order."""
        self._closing = False
        self.eos_token_ids = eos_token_ids
        self.mask_words = (vocab_size + 31) // 32
        """32-bit words of this matcher's bitmask."""
        self.eos_fix = eos_fix
        """(llguidance's EOS ids, the request's) when they differ: the mask drops the
        first and, while the grammar accepts, allows the second (grammar_masks.py)."""

    @property
    def llguidance_matcher(self) -> Any:
        """For llguidance's batched mask fill (grammar_masks.py)."""
        return self._matcher

    def eos_allowed(self) -> bool:
        return self._matcher.is_accepting()

    def accept(self, token_id: int) -> None:
        """Advance over a sampled token. An EOS token of the request ends it anyway
        (the engine checks EOS first); anything else the mask forbade puts the
        matcher in its error state (`error`)."""
        if token_id in self.eos_token_ids:
            return
        if self._closing_path and self._closing_path[0] == token_id:
            self._closing_path.pop(0)
        self._matcher.consume_token(token_id)

    def draftable(self, drafts: tuple[int, ...], remaining: int) -> tuple[int, ...]:
        """The longest prefix of a step's drafts (speculative decoding) the grammar
        accepts from here, with no EOS among them; none while the output is closing
        or may start to within the step (so every verify row is masked as plainly
        decoding it would be: freely, by the grammar alone)."""
        window = max(CLOSING_WINDOW, 3 * self._closing_margin)
        if self._closing or self._closing_path or remaining - len(drafts) - 1 <= window:
            return ()
        clean = next((i for i, t in enumerate(drafts) if t in self.eos_token_ids), len(drafts))
        return drafts[:self._matcher.validate_tokens(list(drafts[:clean]))]

    def draft_bitmasks(self, drafts: tuple[int, ...]) -> list[tuple[bytes, bool]]:
        """(bitmask, EOS allowed) before each draft and after the last (k + 1 rows),
        drafts already `draftable`; the matcher is rolled back to where it was."""
        masks = []
        for i in range(len(drafts) + 1):
            masks.append((self._matcher.compute_bitmask(), self._matcher.is_accepting()))
            if i < len(drafts) and not self._matcher.consume_token(drafts[i]):
                raise RuntimeError(f"draft {drafts[i]} left a grammar it was checked against")
        self._matcher.rollback(len(drafts))
        return masks

    def forced_token(self, remaining: int) -> int | None:
        """The only token allowed next when `remaining` tokens are left and the
        output must start closing now to stay valid; None while sampling is free.
        An output that already matches is left free; one that was closed this way
        ends on the request's EOS once it matches."""
        if self._closing_path:
            return self._closing_path[0]
        if self._closing and self._matcher.is_accepting() and self.eos_token_ids:
            return self.eos_token_ids[0]
        if remaining <= max(CLOSING_WINDOW, 3 * self._closing_margin):
            path = self._path_to_completion(remaining)
            # a path this long came from one token, or a new value may cost as much
            self._closing_margin = max(self._closing_margin, len(path or ()))
            if path and len(path) + self._closing_margin >= remaining:
                self._closing, self._closing_path = True, path
                return path[0]
        return None

    def _path_to_completion(self, limit: int) -> list[int] | None:
        """A short token path from here to an output that matches (within `limit`),
        found greedily on a copy; None when none is found."""
        probe = self._matcher.deep_copy()
        path: list[int] = []
        hints = list(self._closing_hints)
        while not probe.is_accepting():
            if len(path) >= limit or probe.is_stopped():
                return None
            hint = next((h for h in hints if probe.validate_tokens(list(h)) == len(h)), None)
            if hint is not None:
                hints.remove(hint)
                if not probe.consume_tokens(list(hint)):
                    return None
                path.extend(hint)
                continue
            forced = probe.compute_ff_tokens()
            token = forced[0] if forced else next(
                (t for t in self._closing_tokens if probe.validate_tokens([t]) == 1), None)
            if token is None:                # none of those: the lowest allowed token
                allowed = int.from_bytes(probe.compute_bitmask(), "little")
                token = (allowed & -allowed).bit_length() - 1 if allowed else None
            if token is None or not probe.consume_token(token):
                return None
            path.append(token)
        return path

    @property
    def is_complete(self) -> bool:
        """Nothing can follow: the output matches and cannot be extended."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None
