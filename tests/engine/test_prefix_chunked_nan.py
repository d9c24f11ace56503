"""Prefix caching with chunked prefill: a page cached in the step being built is
written by that step's forward pass, so it is no source of a partial-page copy (the
copies run before the forward pass).

The case: prompts share their first ~30 tokens (a chat template's system prompt), page
size 16, a 64-token budget. Request A prefills its 36 tokens and registers its two full
pages at scheduling time; B, the same prompt, admitted in the same step, finds both
pages cached (fine: within the forward pass every layer writes before it attends);
C shares page 0 and 14 tokens of page 1. C once took those 14 slots from B's page 1,
i.e. A's block, copied before the forward pass wrote it: uninitialised K/V, NaN
logits on the CPU (its cache is torch.empty), greedy token 0 forever.
"""

import pytest
import torch

from engine import ContinuousBatchingConfig, GenerationConfig, load_model
from engine.generation_config import SamplingParams
from engine.kv_cache.allocator import BlockAllocator
from engine.kv_cache.paged_cache import PagedKVCache
from engine.core.requests import RequestState
from engine.core.scheduler import Scheduler

from tests.helpers import random_prompts

PAGE = 16
SYSTEM = random_prompts(1, 30, 30, seed=41)[0]
TAILS = random_prompts(6, 5, 9, seed=42)
PROMPTS = [SYSTEM + tail for tail in TAILS] * 2       # lengths 35..39, each one twice


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    config = LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, eos_token_id=2, bos_token_id=1)
    path = tmp_path_factory.mktemp("tiny-llama-prefix-nan")
    LlamaForCausalLM(config).save_pretrained(path)
    return load_model(path, progress=False)


@pytest.fixture
def poisoned_caches(monkeypatch):
    """CPU caches start all NaN (instead of whatever torch.empty's memory held): a
    slot read before it is written poisons the logits every time, not only when the
    allocator hands back dirty memory. The CPU backend never reads an unwritten slot,
    masked or not (paged_cache.py), so a correct engine is unaffected."""
    original = PagedKVCache.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        for cache in self.key_caches + self.value_caches:
            if cache.device.type == "cpu":
                cache.fill_(float("nan"))

    monkeypatch.setattr(PagedKVCache, "__init__", init)


def _generate(model, **config):
    """Greedy tokens per prompt, and how many logits rows held a NaN."""
    nan_rows = [0]
    module = model.module
    compute_logits = module.compute_logits

    def checked(hidden):
        logits = compute_logits(hidden)
        nan_rows[0] += int(torch.isnan(logits).any(dim=-1).sum())
        return logits

    module.compute_logits = checked
    try:
        outputs = model.generate_batch(
            PROMPTS, GenerationConfig(max_new_tokens=8, eos_token_id=[]),
            ContinuousBatchingConfig(**config))
    finally:
        del module.compute_logits
    return [o.generated_tokens for o in outputs.values()], nan_rows[0]


@pytest.mark.parametrize("overrides", [
    {},
    {"scheduler_type": "prefill_first"},
    {"page_size": 32},
    {"max_batch_tokens": 512},
])
def test_chunked_prefill_with_shared_prefixes_matches_no_sharing(tiny_model, poisoned_caches,
                                                                 overrides):
    config = {"page_size": PAGE, "num_blocks": 256, "max_batch_tokens": 64, **overrides}
    shared, shared_nans = _generate(tiny_model, **config)
    unshared, unshared_nans = _generate(tiny_model, allow_block_sharing=False, **config)
    assert unshared_nans == 0
    assert shared_nans == 0
    assert shared == unshared


def _request(request_id: str, prompt: list[int]) -> RequestState:
    return RequestState(request_id, list(prompt), 4, (), SamplingParams())


@pytest.mark.parametrize("policy", ["fifo", "prefill_first"])
def test_no_copy_reads_a_slot_the_same_step_writes(policy):
    """Scheduler level: in every step, no slot a prefix copy reads is one that the
    step's forward pass writes (nor unwritten at all); copies still happen."""
    scheduler = Scheduler(BlockAllocator(64, enable_caching=True), PAGE, 64, 16, 0.0, policy)
    # each prompt twice in a row: the second finds the first's pages cached in the
    # step that writes them, the next prompt shares 14 slots of their page 1
    prompts = [SYSTEM + tail for tail in TAILS for _ in range(2)]
    requests = [_request(f"r{i}", prompt) for i, prompt in enumerate(prompts)]
    for request in requests:
        scheduler.add(request)
    written: set[int] = set()            # slots holding K/V before the step
    num_copies = 0
    for _ in range(40):
        batch = scheduler.schedule()
        if batch is None:
            break
        step_writes = {request_slot
                       for entry in batch.entries
                       for request_slot in (
                           entry.request.block_ids[p // PAGE] * PAGE + p % PAGE
                           for p in range(entry.start, entry.end))}
        for source, target, count in batch.prefix_copies:
            num_copies += 1
            for offset in range(count):
                slot = source * PAGE + offset
                assert slot in written and slot not in step_writes, (source, offset)
            written.update(target * PAGE + offset for offset in range(count))
        written |= step_writes
        for entry in batch.entries:      # what the engine loop does after the step
            entry.request.num_computed_tokens = entry.end
            if entry.samples:
                entry.request.generated_tokens.append(7)
                if len(entry.request.generated_tokens) >= 2:
                    scheduler.finish(entry.request)
        scheduler.check_invariants()
    assert not scheduler.has_work()
    assert num_copies > 0
