"""From request to prompt token ids: chat templates and plain prompts.

Chat messages go through the model's own chat template (a Jinja template shipped
with the tokenizer), rendered to text and then tokenized without adding special
tokens again: the template already wrote BOS and the role markers. Plain completion
prompts are tokenized with the tokenizer's usual special tokens. Template errors
(a template that insists on alternating roles, say) are the client's to fix: 400.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

from .chat_format import ChatFormat
from ..edge.errors import bad_request
from ..protocol.chat import ChatMessage
from ..protocol.completions import Prompt


@dataclass(frozen=True)
class RenderedChat:
    text: str
    ids: list[int]


def render_chat(tokenizer: Any, chat_format: ChatFormat, messages: list[ChatMessage],
                add_generation_prompt: bool = True, tools: list | None = None,
                template_kwargs: dict | None = None) -> RenderedChat:
    """Messages (+ tools, `chat_template_kwargs`) -> prompt text and token ids,
    through the chat template (chat_format.py). A content that spells a control
    token is tokenized as text (`_render_guarded`)."""
    dicts = [m.to_template_dict() for m in messages]
    spelled = [i for i, d in enumerate(dicts) if chat_format.spells_control_token(d["content"])]
    if spelled:
        return _render_guarded(tokenizer, chat_format, dicts, spelled, add_generation_prompt,
                               tools, template_kwargs)
    text = chat_format.render(tokenizer, dicts, tools=tools, template_kwargs=template_kwargs,
                              add_generation_prompt=add_generation_prompt)
    return RenderedChat(text, encode_text(tokenizer, text, add_special_tokens=False))


def _render_guarded(tokenizer: Any, chat_format: ChatFormat, dicts: list[dict],
                    spelled: list[int], add_generation_prompt: bool, tools: list | None,
                    template_kwargs: dict | None) -> RenderedChat:
    """The template rendered around placeholders; the template's own text tokenized
    as usual (its control tokens parsed), each placeholder's content with special
    tokens split into plain text. Other prompts never take this path, so their
    tokens stay exactly the usual ones."""
    marker = f"KVSERVE{uuid.uuid4().hex}"
    contents = {f"{marker}{i}X": dicts[i]["content"] for i in spelled}
    for i, key in zip(spelled, contents):
        dicts[i] = {**dicts[i], "content": key}
    text = chat_format.render(tokenizer, dicts, tools=tools, template_kwargs=template_kwargs,
                              add_generation_prompt=add_generation_prompt)
    if any(key not in text for key in contents):      # the template rewrote the content
        raise bad_request("A message spells a control token of this model, and this "
                          "chat template does not keep its text apart.", param="messages")
    ids: list[int] = []
    pieces = re.split("(" + "|".join(map(re.escape, contents)) + ")", text)
    for piece in pieces:
        if piece in contents:
            ids += tokenizer.encode(contents[piece], add_special_tokens=False,
                                    split_special_tokens=True)
        elif piece:
            ids += encode_text(tokenizer, piece, add_special_tokens=False)
    plain = "".join(contents.get(piece, piece) for piece in pieces)
    return RenderedChat(plain, ids)


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
