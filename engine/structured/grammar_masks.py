"""Token bitmasks of constrained rows, applied to a step's logits.

Per step, every sampling row whose request carries a grammar (grammar.py) gets the
bitmask of its allowed next tokens, computed by llguidance on the host into one
int32 buffer [rows, ceil(vocab / 32)] (bit i of word i // 32 is token i), in
parallel across rows. The bits are expanded to a bool mask on the logits' device
through a 256-entry byte table (one gather, no per-bit shifts) and disallowed
logits become -inf, before penalties, temperature and the picks.

Who calls what: the runner starts the masks of a step (`GrammarMasks.start`) before
the forward pass and the sampler waits for them (`PendingMasks.wait`) once the
logits exist; on a CPU the masks are computed on a helper thread meanwhile
(llguidance drops the interpreter lock while it works), on CUDA the forward pass is
queued and the host is free anyway.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch


_BYTE_BLOCKED = torch.tensor([[not (byte >> bit) & 1 for bit in range(8)] for byte in range(256)],
                             dtype=torch.bool)
"""[256, 8]: for each byte value, which of its bits are clear (lowest first; the
words are little-endian), i.e. which of its 8 tokens are not allowed."""


@dataclass(frozen=True)
class PendingMasks:
    rows: list[int]
    """Sampling rows (indices into the step's picks) the masks belong to."""
    future: Future | None
    bitmask: torch.Tensor | None
    """[len(rows) + the verify rows, words] int32 on the host, filled by `future`."""
    verify_rows: dict[int, slice] = field(default_factory=dict)
    """A constrained verify entry (its index among the step's verify entries) -> its
    k + 1 rows of `bitmask`, after the sampling rows'."""

    def wait(self) -> torch.Tensor:
        """The sampling rows' masks, once all are filled."""
        if self.future is not None:
            self.future.result()
        return self.bitmask[:len(self.rows)] if self.bitmask is not None else None


NO_MASKS = PendingMasks([], None, None)


class GrammarMasks:
    """The engine's mask computation: an llguidance executor and, on CPU, one helper
    thread that runs it beside the forward pass. Engine thread only."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._executor = None
        self._helper: ThreadPoolExecutor | None = None

    def start(self, requests: list, verifying: list = ()) -> PendingMasks:
        """Begin the masks of `requests` (a step's sampling rows, in order) and of
        the verify entries' rows (`verifying`: ScheduledRequests with drafts)."""
        rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        drafted = [(i, entry) for i, entry in enumerate(verifying)
                   if entry.request.grammar is not None]
        if not rows and not drafted:
            return NO_MASKS
        verify_rows, first = {}, len(rows)
        for i, entry in drafted:
            verify_rows[i] = slice(first, first + len(entry.drafts) + 1)
            first += len(entry.drafts) + 1
        constrained = [requests[i] for i in rows]
        words = (constrained[0] if constrained else drafted[0][1].request).grammar.mask_words
        bitmask = torch.empty((first, words), dtype=torch.int32,
                              pin_memory=self.device.type == "cuda")
        if self._executor is None:
            from llguidance import LLExecutor
            self._executor = LLExecutor()
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="kvserve-masks")
        future = self._helper.submit(self._fill, constrained, bitmask,
                                     [(entry, verify_rows[i]) for i, entry in drafted])
        return PendingMasks(rows, future, bitmask, verify_rows)

    def verify_masks(self, masks: PendingMasks, index: int) -> torch.Tensor | None:
        """Verify entry `index`'s [k + 1, words] masks (None: unconstrained)."""
        rows = masks.verify_rows.get(index)
        if rows is None:
            return None
        masks.wait()
        return masks.bitmask[rows]

    @torch.inference_mode()     # the bitmask was made under the runner's inference mode
    def _fill(self, requests: list, bitmask: torch.Tensor, drafted: list) -> None:
        """Helper thread, while the engine thread runs the forward pass: the engine
        thread touches neither these requests' matchers nor `bitmask` until `wait`."""
        free, free_rows = [], set()
        for row, request in enumerate(requests):
            remaining = request.max_new_tokens - len(request.generated_tokens)
            forced = request.grammar.forced_token(remaining)
            if forced is None:
                free.append((request.grammar.llguidance_matcher, row))
                free_rows.add(row)
            else:                          # closing: exactly one token allowed
                bitmask[row] = 0
                bitmask[row].view(torch.uint8)[forced // 8] = 1 << (forced % 8)
        if free:
            self._executor.unsafe_compute_mask_ptr(free, bitmask.data_ptr(),
                                                   bitmask.shape[1] * 4, len(requests))
        for row, request in enumerate(requests):
            if request.grammar.eos_fix is not None and row in free_rows:
                _fix_eos(bitmask[row], request.grammar.eos_fix, request.grammar.eos_allowed())
        for entry, rows in drafted:      # a verify entry's rows: one after another
            grammar = entry.request.grammar
            width = bitmask.shape[1] * 4         # llguidance's masks may run a word longer
            for row, (words, eos_allowed) in zip(range(rows.start, rows.stop),
                                                 grammar.draft_bitmasks(entry.drafts)):
                bitmask[row].view(torch.uint8).copy_(torch.frombuffer(bytearray(words[:width]),
                                                                      dtype=torch.uint8))
                if grammar.eos_fix is not None:
                    _fix_eos(bitmask[row], grammar.eos_fix, eos_allowed)

    def close(self) -> None:
        """End the helper thread (the manager's destroy)."""
        if self._helper is not None:
            self._helper.shutdown(wait=True)
            self._helper = self._executor = None


def _fix_eos(words: torch.Tensor, eos_fix: tuple, eos_allowed: bool) -> None:
    """Swap llguidance's EOS ids for the request's own (GrammarMatcher.eos_fix): the
    request ends on its ids (none under ignore_eos), allowed only where the grammar
    is complete (`eos_allowed`). Works on the row's bytes (little-endian words:
    token i is bit i % 8 of byte i // 8)."""
    grammar_eos, own = eos_fix
    as_bytes = words.view(torch.uint8)
    for token_id in grammar_eos:
        as_bytes[token_id // 8] &= 0xFF ^ (1 << (token_id % 8))
    if eos_allowed:
        for token_id in own:
            as_bytes[token_id // 8] |= 1 << (token_id % 8)


def apply_masks(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """logits [S, vocab] with the disallowed tokens of `rows` at -inf (a new tensor
    unless the caller already owns `logits`). bitmask: [len(rows), words] int32."""
    vocab = logits.shape[1]
    device = logits.device
    as_bytes = bitmask.to(device, non_blocking=True).view(torch.uint8)    # [R, words * 4]
    blocked = _BYTE_BLOCKED.to(device)[as_bytes.int()].view(len(rows), -1)  # [R, words * 32]
    if blocked.shape[1] < vocab:         # logits wider than the tokenizer: never allowed
        blocked = torch.nn.functional.pad(blocked, (0, vocab - blocked.shape[1]), value=True)
    blocked = blocked[:, :vocab]
    if len(rows) == logits.shape[0]:     # every row constrained: no gather and scatter
        return logits.masked_fill(blocked, float("-inf"))
    index = torch.tensor(rows) if device.type == "cpu" else \
        torch.tensor(rows).to(device, non_blocking=True)
    return logits.index_copy(0, index, logits[index].masked_fill(blocked, float("-inf")))
