"""StopStringMatcher: matches across piece boundaries, holds back possible prefixes."""

from server.text_pipeline.stop_strings import StopStringMatcher


def run(stops, pieces):
    matcher = StopStringMatcher(stops)
    released = [matcher.feed(p) for p in pieces]
    if matcher.matched is None:
        released.append(matcher.flush())
    return "".join(released), matcher.matched, released


def test_no_stop_strings_passes_text_through_unchanged():
    text, matched, released = run([], ["a", "b", "c"])
    assert (text, matched, released[:3]) == ("abc", None, ["a", "b", "c"])


def test_match_inside_one_piece_cuts_before_it():
    text, matched, _ = run(["END"], ["hello END world"])
    assert (text, matched) == ("hello ", "END")


def test_match_split_across_pieces():
    text, matched, released = run(["END"], ["The E", "N", "D!", "more"])
    assert (text, matched) == ("The ", "END")
    assert released == ["The ", "", "", ""]


def test_possible_prefix_is_held_then_released_when_it_diverges():
    text, matched, released = run(["END"], ["The E", "NX", " ok"])
    assert matched is None
    assert text == "The ENX ok"
    assert released[:3] == ["The ", "ENX", " ok"]


def test_earliest_of_several_stops_wins():
    text, matched, _ = run(["world", "lo w"], ["hel", "lo world"])
    assert (text, matched) == ("hel", "lo w")


def test_held_tail_is_flushed_at_the_end():
    text, matched, released = run(["\n\n"], ["line\n"])
    assert released == ["line", "\n"]
    assert (text, matched) == ("line\n", None)


def test_nothing_after_a_match():
    matcher = StopStringMatcher(["x"])
    assert matcher.feed("abxcd") == "ab"
    assert matcher.feed("more") == ""
    assert matcher.flush() == ""


def test_overlapping_prefix_candidates():
    # "aab": after "aa" both "a" and "aa" are prefixes; the longest must be held.
    text, matched, _ = run(["aab"], ["xa", "a", "b"])
    assert (text, matched) == ("x", "aab")
