"""Stop strings, found across token boundaries and cut from the output.

A stop string may arrive split over several tokens ("\\n\\n" as "\\n" + "\\n", or "END"
as "E" + "ND"), so text cannot be released as soon as it is decoded: the tail that
could still grow into a stop string is held back until the next piece decides.

    stop = ["END"]      pieces: "The E"  -> release "The ",  hold "E"
                                "ND!"    -> buffer "END!": match -> release "", stop

Holding back exactly the longest suffix that is a prefix of some stop string is
enough: any later match must start inside the held part, because text before it
could not begin one. Released text therefore never contains (part of) a stop string.
"""

from __future__ import annotations


class StopStringMatcher:
    """Feed decoded pieces in; get back the text that is safe to show."""

    def __init__(self, stop_strings: list[str]) -> None:
        self._stops = [s for s in stop_strings if s]
        self._held = ""
        self.matched: str | None = None
        """The stop string that ended the text, once one was found."""

    def feed(self, piece: str) -> str:
        """Add a decoded piece; return text now known not to be part of a stop string.

        After a match, `matched` is set, the text from the stop string on is dropped,
        and later calls return "".
        """
        if self.matched is not None:
            return ""
        if not self._stops:
            return piece
        buffer = self._held + piece
        cut, stop = self._earliest_match(buffer)
        if stop is not None:
            self.matched = stop
            self._held = ""
            return buffer[:cut]
        keep = self._longest_partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep:]
        return buffer[:len(buffer) - keep]

    def flush(self) -> str:
        """The held-back tail, at the end of generation when no more text comes."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _earliest_match(self, text: str) -> tuple[int, str | None]:
        best, best_stop = len(text) + 1, None
        for stop in self._stops:
            index = text.find(stop)
            if index != -1 and index < best:
                best, best_stop = index, stop
        return best, best_stop

    def _longest_partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that begins some stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
