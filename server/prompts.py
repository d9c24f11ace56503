"""From request to prompt token ids: chat templates and plain prompts.

Chat messages go through the model's own chat template (a Jinja template shipped
with the tokenizer), rendered to text and then tokenized without adding special
tokens again: the template already wrote BOS and the role markers. Plain completion
prompts are tokenized with the tokenizer's usual special tokens. Template errors
(a template that insists on alternating roles, say) are the client's to fix: 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .chat_format import ChatFormat
from .errors import bad_request
from .protocol.chat import ChatMessage
from .protocol.completions import Prompt


@dataclass(frozen=True)
class RenderedChat:
    text: str
    ids: list[int]


def render_chat(tokenizer: Any, chat_format: ChatFormat, messages: list[ChatMessage],
                add_generation_prompt: bool = True, tools: list | None = None,
                template_kwargs: dict | None = None) -> RenderedChat:
    """Messages (+ tools, `chat_template_kwargs`) -> prompt text and token ids,
    through the chat template (chat_format.py)."""
    text = chat_format.render(tokenizer, [m.to_template_dict() for m in messages], tools=tools,
                              template_kwargs=template_kwargs,
                              add_generation_prompt=add_generation_prompt)
    return RenderedChat(text, encode_text(tokenizer, text, add_special_tokens=False))


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise bad_request(f"Token id {token_id} is outside the vocabulary "
                              f"[0, {vocab_size}).", param=param)


def completion_prompt_ids(tokenizer: Any, prompts: list[Prompt], vocab_size: int) -> list[list[int]]:
    """Each prompt (text or token ids) -> token ids; empty prompts are refused."""
    result = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            ids = encode_text(tokenizer, prompt)
        else:
            check_token_ids(prompt, vocab_size, param="prompt")
            ids = list(prompt)
        if not ids:
            raise bad_request(f"Prompt {index} is empty after tokenization.", param="prompt")
        result.append(ids)
    return result
