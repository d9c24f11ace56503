"""GenerationPlan: OpenAI parameters -> engine arguments, and the context check."""

from types import SimpleNamespace

import pytest

from server.edge.body import validate_model
from server.edge.errors import OpenAIError
from server.protocol.chat import ChatCompletionRequest
from server.protocol.completions import CompletionRequest
from server.sampling import build_plan

# Only what build_plan reads from the serving state.
STATE = SimpleNamespace(vocab_size=100, eos_token_ids=[2])


def plan_for(max_tokens=None, logprobs=False, top_logprobs=0, **fields):
    request = validate_model(ChatCompletionRequest,
                             {"messages": [{"role": "user", "content": "hi"}], **fields})
    return build_plan(request, STATE, max_tokens=max_tokens, logprobs=logprobs,
                      top_logprobs=top_logprobs)


def test_openai_defaults():
    plan = plan_for()
    assert plan.sampling["temperature"] == 1.0 and plan.sampling["do_sample"] is True
    assert plan.sampling["top_k"] == 0 and plan.sampling["top_p"] == 1.0
    assert plan.eos_token_ids == [2] and plan.n == 1 and not plan.stream
    assert "logprobs" not in plan.sampling


def test_temperature_zero_is_greedy_and_top_k_minus_one_is_off():
    plan = plan_for(temperature=0, top_k=-1)
    assert plan.sampling["do_sample"] is False and plan.sampling["top_k"] == 0


def test_eos_handling():
    assert plan_for(stop_token_ids=[5, 2]).eos_token_ids == [2, 5]
    assert plan_for(ignore_eos=True).eos_token_ids == []
    assert plan_for(ignore_eos=True, stop_token_ids=[7]).eos_token_ids == [7]


def test_seed_differs_per_choice_and_wraps():
    plan = plan_for(seed=2**63 - 1, n=3)
    seeds = [plan.sampling_for_choice(i)["seed"] for i in range(3)]
    assert seeds == [2**63 - 1, 2**63, 2**63 + 1]
    assert plan_for(seed=-1).sampling_for_choice(1)["seed"] == 0


def test_logit_bias_keys_become_token_ids_within_the_vocabulary():
    assert plan_for(logit_bias={"7": -100, "8": 5.5}).sampling["logit_bias"] == {7: -100.0, 8: 5.5}
    with pytest.raises(OpenAIError) as info:
        plan_for(logit_bias={"100": 1})
    assert info.value.param == "logit_bias"


def test_stop_strings_make_the_engine_stream():
    assert not plan_for().engine_streaming
    assert plan_for(stop="x").engine_streaming and plan_for(stop="x").stop_strings == ["x"]


def test_context_budget():
    assert plan_for().max_new_tokens(100, max_model_len=4096) == 3996
    assert plan_for(max_tokens=50).max_new_tokens(100, 4096) == 50
    with pytest.raises(OpenAIError) as info:
        plan_for(max_tokens=10**12).max_new_tokens(100, 4096)
    assert info.value.param == "max_tokens" and "maximum context length is 4096" in info.value.message
    for prompt_len in (4096, 9000):  # no room left for even one token
        with pytest.raises(OpenAIError) as info:
            plan_for().max_new_tokens(prompt_len, 4096)
        assert info.value.param == "messages"


def test_completion_prompt_param_in_errors():
    request = validate_model(CompletionRequest, {"prompt": "hi"})
    plan = build_plan(request, STATE, max_tokens=None, logprobs=False, top_logprobs=0)
    with pytest.raises(OpenAIError) as info:
        plan.max_new_tokens(9000, 4096)
    assert info.value.param == "prompt"
