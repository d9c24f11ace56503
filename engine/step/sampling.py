"""Sampler: next tokens for every sampling row of a step in one vectorised pass.

Rows are requests; each carries its own SamplingParams. Processors run in
transformers' order (penalties and logit bias, temperature, top-k, top-p, min-p) on
the whole [S, vocab] matrix with per-row parameter vectors. Greedy rows take argmax.

Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. draws a token
with probability p. Each seeded request draws E from its own torch.Generator, so its
tokens depend only on its seed and its own logits, never on what else is in the batch.

A request's logit bias becomes two tensors once, when the engine takes the request
(ids and values, `RequestSampling`); each step adds every biased row's values in one
index_add over the flattened logits, however many entries a request has (a full-
vocabulary bias is 49,152 of them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..structured.grammar_masks import NO_MASKS, PendingMasks, apply_masks
from ..core.requests import RequestState
from ..speculative.acceptance import Verdict, verify_greedy, verify_sampled


@dataclass(frozen=True)
class RequestSampling:
    """The sampler's per-request state (RequestState.sampler_state)."""

    generator: torch.Generator | None
    """The seeded request's own random stream; None: the shared one."""
    bias_ids: torch.Tensor | None
    """[K] long token ids of the logit bias, on the logits' device; None: no bias."""
    bias_values: torch.Tensor | None
    """[K] fp32 biases."""


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None                       # of the chosen tokens (raw model)
    top_logprobs: list[list[tuple[int, float]] | None]


class Sampler:
    def __init__(self, device: torch.device, seed: int | None) -> None:
        self.device = device
        self.shared_generator = torch.Generator(device=device)
        if seed is not None:
            self.shared_generator.manual_seed(seed)
        else:
            self.shared_generator.seed()

    def init_request(self, request: RequestState) -> None:
        """A seeded request's own random stream and a biased request's bias tensors
        (engine thread, once per request)."""
        generator = bias_ids = bias_values = None
        if request.sampling.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(request.sampling.seed)
        if request.sampling.logit_bias:
            bias = request.sampling.logit_bias
            bias_ids = torch.tensor(list(bias.keys()), dtype=torch.long, device=self.device)
            bias_values = torch.tensor(list(bias.values()), dtype=torch.float32,
                                       device=self.device)
        request.sampler_state = RequestSampling(generator, bias_ids, bias_values)

    def sample(self, logits: torch.Tensor, requests: list[RequestState],
               masks: PendingMasks = NO_MASKS) -> SampleResult:
        """logits: [S, vocab] fp32, one row per request in `requests`."""
        return self.launch(logits, requests, masks).result()

    def launch(self, logits: torch.Tensor, requests: list[RequestState],
               masks: PendingMasks = NO_MASKS) -> "PendingSample":
        """The picks as device tensors, without waiting for them (greedy rows never
        wait; sampling rows wait only on their parameters' small copies). Async
        batching feeds `token_ids` to the next step before reading them back.
        `masks`: the grammar masks of the constrained rows (grammar_masks.py);
        logprobs stay the raw model's."""
        params = [r.sampling for r in requests]
        want_logprobs = [r.want_logprobs or r.sampling.top_logprobs > 0 for r in requests]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        logits = self._apply_penalties_and_bias(logits, requests)
        if masks.rows:
            logits = apply_masks(logits, masks.rows, masks.wait())

        token_ids = greedy_picks(logits)
        sample_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if sample_rows:
            rows = on_device(sample_rows, logits.device)
            probs = self._processed_probs(logits[rows], [params[i] for i in sample_rows])
            token_ids[rows] = self._race(probs, [requests[i] for i in sample_rows])
        picks = [token_ids]
        if raw_logprobs is not None:
            picks.append(raw_logprobs.gather(1, token_ids[:, None]).squeeze(1))
            most = max(p.top_logprobs for p in params)
            if most:
                picks.extend(raw_logprobs.topk(most, dim=-1))     # values, indices
        host, ready = _copy_to_host(picks)
        return PendingSample(token_ids, params, host, ready)

    @staticmethod
    def _apply_penalties_and_bias(logits: torch.Tensor, requests: list[RequestState]) -> torch.Tensor:
        rows = [i for i, r in enumerate(requests) if r.sampling.needs_token_counts]
        biased = [i for i, r in enumerate(requests) if r.sampling.logit_bias]
        if not rows and not biased:
            return logits
        logits = logits.clone()
        for i in rows:
            params, request = requests[i].sampling, requests[i]
            row = logits[i]
            if params.repetition_penalty != 1.0:
                # transformers' rule, over prompt and output: divide positive logits,
                # multiply negative ones.
                seen = torch.tensor(sorted(set(request.prompt_ids + request.generated_tokens)),
                                    device=logits.device)
                scores = row[seen]
                row[seen] = torch.where(scores > 0, scores / params.repetition_penalty,
                                        scores * params.repetition_penalty)
            if params.presence_penalty or params.frequency_penalty:
                # OpenAI's rule, over the generated tokens only.
                counts = torch.bincount(
                    torch.tensor(request.generated_tokens, dtype=torch.long, device=logits.device),
                    minlength=row.shape[0]).to(row.dtype)
                row -= counts * params.frequency_penalty + (counts > 0).to(row.dtype) * params.presence_penalty
        if biased:          # after the penalties; one index_add for every biased row
            vocab = logits.shape[1]
            states = [requests[i].sampler_state for i in biased]
            flat_ids = torch.cat([s.bias_ids + i * vocab for i, s in zip(biased, states)])
            logits.view(-1).index_add_(0, flat_ids, torch.cat([s.bias_values for s in states]))
        return logits

    @staticmethod
    def _processed_probs(logits: torch.Tensor, params) -> torch.Tensor:
        """[N, vocab] logits of sampling rows -> probabilities after temperature,
        top-k, top-p and min-p."""
        # the choices are made on the host values: no wait on the device here
        device, vocab = logits.device, logits.shape[-1]
        temperature = on_device([p.temperature for p in params], device)
        logits = logits / temperature[:, None]
        top_k_values = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
        if min(top_k_values) < vocab:
            top_k = on_device(top_k_values, device)
            kth = logits.topk(max(top_k_values), dim=-1).values.gather(1, (top_k - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if any(p.top_p < 1.0 for p in params):
            top_p = on_device([p.top_p for p in params], device)
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            # drop a token when the ones before it already cover top_p (keeps >= 1)
            drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= top_p[:, None]
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        probs = logits.softmax(dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = on_device([p.min_p for p in params], device)
            threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs

    def verify(self, logits: torch.Tensor, request: RequestState, drafts: tuple[int, ...],
               greedy: list[int]) -> Verdict:
        """A verify entry's verdict from its rows' logits [k + 1, vocab] (`greedy`:
        their argmax, already on the host): the greedy rule, or rejection sampling
        over the request's processed distributions with its own random stream
        (speculative/acceptance.py)."""
        params = request.sampling
        if params.is_greedy:
            return verify_greedy(greedy, list(drafts))
        probs = self._processed_probs(logits, [params] * logits.shape[0])
        own = request.sampler_state.generator if request.sampler_state else None
        return verify_sampled(probs, list(drafts), None, own or self.shared_generator)

    def _race(self, probs: torch.Tensor, requests: list[RequestState]) -> torch.Tensor:
        noise = torch.empty_like(probs)
        for i, request in enumerate(requests):
            own = request.sampler_state.generator if request.sampler_state else None
            noise[i].exponential_(generator=own or self.shared_generator)
        return (probs / noise).argmax(dim=-1)


@dataclass(frozen=True)
class PendingSample:
    token_ids: torch.Tensor                  # [S] long, on the logits' device
    params: list
    host: list[torch.Tensor]
    """The picks on their way to the host: token ids [S], and when a row asked for
    logprobs the chosen ones [S] (+ top values and indices [S, k] when one asked for
    alternatives). On CUDA pinned tensors that a copy queued at launch fills."""
    ready: "torch.cuda.Event | None" = None
    """Recorded after those copies (CUDA only)."""

    def result(self) -> SampleResult:
        """The picks on the host. On CUDA this waits for this step's copies only, not
        for a step queued after it (async batching's overlap depends on that)."""
        if self.ready is not None:
            self.ready.synchronize()
        token_list = self.host[0].tolist()
        if len(self.host) == 1:
            return SampleResult(token_list, None, [None] * len(self.params))
        chosen = self.host[1].tolist()
        top: list = [None] * len(self.params)
        if len(self.host) == 4:
            values, indices = self.host[2].tolist(), self.host[3].tolist()
            top = [list(zip(indices[i][:p.top_logprobs], values[i][:p.top_logprobs]))
                   if p.top_logprobs else None for i, p in enumerate(self.params)]
        return SampleResult(token_list, chosen, top)


def _copy_to_host(tensors: list[torch.Tensor]
                  ) -> tuple[list[torch.Tensor], "torch.cuda.Event | None"]:
    """Device tensors -> host tensors filled by copies queued now, and the event that
    marks them done. Reading a CUDA tensor with .tolist() would wait for everything
    queued on the stream, the next step too; a fresh pinned buffer per step (two steps
    can be in flight) and an event wait for this step's work alone. On CPU: as is."""
    if tensors[0].device.type != "cuda":
        return tensors, None
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for target, source in zip(host, tensors):
        target.copy_(source, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(tensors[0].device))
    return host, ready


def on_device(values: list, device: torch.device) -> torch.Tensor:
    """A small host list on `device` without waiting for the device's queued work."""
    tensor = torch.tensor(values)
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)


def greedy_picks(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1), through the native kernel for CPU fp32 rows (torch's
    compares one value at a time)."""
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.is_contiguous() and logits.shape[1] > 0):
        from ..kernels import default_kernels
        kernels = default_kernels()
        if kernels is not None:
            return kernels.argmax(logits)
    return logits.argmax(dim=-1)
