"""ChoiceDecoder on engine outputs: EOS handling, stop strings, usage counts."""

from engine.outputs import GenerationOutput, RequestStatus

from server.text_pipeline.choice_decoder import ChoiceDecoder


def output(tokens, status=RequestStatus.DECODING, finish_reason=None, logprobs=None):
    return GenerationOutput(request_id="r", prompt_ids=[1], generated_tokens=list(tokens),
                            status=status, finish_reason=finish_reason, logprobs=logprobs)


def stream_outputs(ids, finish_reason):
    """One output per token with cumulative tokens, the last one finished."""
    outs = [output(ids[:i + 1]) for i in range(len(ids) - 1)]
    outs.append(output(ids, RequestStatus.FINISHED, finish_reason))
    return outs


def run(decoder, outputs):
    deltas = [decoder.step(o) for o in outputs]
    return "".join(d.text for d in deltas), deltas


def test_eos_is_counted_but_not_text(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Paris is nice.", add_special_tokens=False) + [eos]
    decoder = ChoiceDecoder(tokenizer, [1], [], [eos])
    text, deltas = run(decoder, stream_outputs(ids, "stop"))
    assert text == "Paris is nice."
    assert decoder.finish_reason == "stop"
    assert decoder.num_generated == len(ids)
    assert eos not in [t for d in deltas for t in d.token_ids]


def test_streaming_and_single_output_give_the_same_text(tokenizer):
    ids = tokenizer.encode("日本語 and 🙂 emoji", add_special_tokens=False)
    streamed, _ = run(ChoiceDecoder(tokenizer, [1], [], [2]), stream_outputs(ids, "length"))
    whole, _ = run(ChoiceDecoder(tokenizer, [1], [], [2]),
                   [output(ids, RequestStatus.FINISHED, "length")])
    assert streamed == whole == "日本語 and 🙂 emoji"


def test_stop_string_across_tokens_ends_the_choice(tokenizer):
    ids = tokenizer.encode("one two three four five", add_special_tokens=False)
    decoder = ChoiceDecoder(tokenizer, [1], ["o thr"], [2])
    outs = stream_outputs(ids, "length")
    text, deltas = run(decoder, outs)
    assert text == "one tw"
    assert decoder.finish_reason == "stop"
    # Usage counts the tokens consumed up to the one that completed the match.
    consumed = next(i for i, d in enumerate(deltas) if d.finish_reason) + 1
    assert decoder.num_generated == consumed < len(ids)
    assert all(d.is_empty() for d in deltas[consumed:])


def test_length_finish_and_logprobs_alignment(tokenizer):
    ids = tokenizer.encode("a b c", add_special_tokens=False)
    logprobs = [-0.1 * (i + 1) for i in range(len(ids))]
    decoder = ChoiceDecoder(tokenizer, [1], [], [2], want_logprobs=True)
    outs = [output(ids[:i + 1], logprobs=logprobs[:i + 1]) for i in range(len(ids) - 1)]
    outs.append(output(ids, RequestStatus.FINISHED, "length", logprobs))
    text, deltas = run(decoder, outs)
    assert text == "a b c" and decoder.finish_reason == "length"
    assert [t for d in deltas for t in d.token_ids] == ids
    assert [lp for d in deltas for lp in d.logprobs] == logprobs
