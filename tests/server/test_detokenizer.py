"""Incremental detokenization with the default model's real tokenizer."""

import random

import pytest

from server.text_pipeline.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, decode_all, ids_decoder
from server.text_pipeline.token_text import TokenTexts

SAMPLES = [
    "héllo 日本語 🙂 world",
    "Tokyo (東京) and naïve café\n\n  spaced   out",
    "emoji run 👩‍👩‍👧‍👦🎉🎉 done",
    "tabs\tand\r\nCRLF, NUL \x00 and bell \x07",
]


@pytest.mark.parametrize("text", SAMPLES)
def test_pieces_join_to_the_text_and_are_never_broken(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"))
    pieces = [detokenizer.add(t) for t in ids] + [detokenizer.flush()]
    assert "".join(pieces) == text
    assert not any(REPLACEMENT_CHAR in p for p in pieces)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_direct_decoder_gives_the_tokenizers_text(tokenizer, skip_special_tokens):
    """The decoder the streams use (the fast tokenizer's backend, called directly) says
    what `tokenizer.decode` says, on every window of the samples and special tokens."""
    decode = ids_decoder(tokenizer, skip_special_tokens)
    assert decode.func != tokenizer.decode              # the direct path serves this one
    specials = [tokenizer.bos_token_id, tokenizer.eos_token_id]
    for text in SAMPLES:
        ids = specials + tokenizer.encode(text, add_special_tokens=False) + specials
        for start in range(len(ids)):
            for end in range(start, min(len(ids), start + 6) + 1):
                assert decode(ids[start:end]) == tokenizer.decode(
                    ids[start:end], skip_special_tokens=skip_special_tokens,
                    clean_up_tokenization_spaces=False)


def test_split_character_arrives_whole(tokenizer):
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(ids) >= 2, "the test needs a character spread over several tokens"
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.add(t) for t in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1)
    assert pieces[-1] == "🙂"


def test_flush_releases_an_unfinished_character(tokenizer):
    ids = tokenizer.encode("a🙂", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.add(t) for t in ids[:-1]]
    tail = detokenizer.flush()
    assert "".join(pieces) == "a"
    assert tail.endswith(REPLACEMENT_CHAR)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_a_whole_decode_is_the_stream_pieces_joined(tokenizer, skip_special_tokens):
    """decode_all (one call) gives what a stream of the same ids emits, on lists full of
    single-byte tokens that split and never finish characters."""
    rng = random.Random(7)
    byte_ids = [i for i, t in enumerate(tokenizer.convert_ids_to_tokens(range(len(tokenizer))))
                if len(t) == 1]
    for _ in range(200):
        ids = [rng.choice(byte_ids) if rng.random() < 0.7 else rng.randrange(len(tokenizer))
               for _ in range(rng.randrange(1, 30))]
        detokenizer = IncrementalDetokenizer(tokenizer, None, skip_special_tokens)
        pieces = [detokenizer.add(t) for t in ids] + [detokenizer.flush()]
        assert decode_all(tokenizer, ids, skip_special_tokens) == "".join(pieces), ids


def test_special_tokens_are_skipped(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Hi", add_special_tokens=False) + [eos]
    assert decode_all(tokenizer, ids) == "Hi"
    assert decode_all(tokenizer, ids, skip_special_tokens=False) == "Hi" + tokenizer.eos_token


def test_token_texts_recover_exact_bytes(tokenizer):
    texts = TokenTexts(tokenizer)
    text = "日本 🙂 ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    all_bytes = b"".join(bytes(texts.get(t)[1]) for t in ids)
    assert all_bytes.decode("utf-8") == text
    partial = [texts.get(t)[0] for t in ids if texts.get(t)[0].startswith("bytes:")]
    assert partial, "some token of a CJK/emoji text holds an incomplete character"
