"""How this server talks to its model in chats, chosen once at start from the chat
template (and the `chat_template` / `tool_parser` settings):

    template    the Jinja template rendering messages (None: the tokenizer's own)
    tools       the tool-call family (tool_formats.py)
    reasoning   whether the template knows <think> blocks (reasoning.py)
    control     the texts of the tokenizer's added tokens (<|im_start|>, ...) that a
                message's content may not turn into control tokens (prompts.py)

`render` turns a request's messages (plus tools and `chat_template_kwargs`) into
prompt text; the routes tokenize it off the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import bad_request
from .tool_formats import detect_format, tool_format


@dataclass(frozen=True)
class ChatFormat:
    template: str | None
    tools: Any
    """GenericFormat, HermesFormat, Llama3JsonFormat or MistralFormat."""
    reasoning: bool
    control: tuple[str, ...] = ()
    """Added-token texts, longest first; empty when contents may spell them
    (`parse_special_tokens_in_messages`)."""

    def spells_control_token(self, content: str) -> bool:
        return any(token in content for token in self.control)

    @property
    def capabilities(self) -> dict[str, Any]:
        """What /v1/models reports."""
        return {"tool_parser": self.tools.name, "native_tools": self.tools.name != "generic",
                "reasoning": self.reasoning}

    def render(self, tokenizer: Any, messages: list[dict], *, tools: list | None = None,
               template_kwargs: dict | None = None, add_generation_prompt: bool = True) -> str:
        """Prompt text; a template error (a template that insists on alternating
        roles, a bad kwarg) is the client's to fix: 400."""
        extra: dict[str, Any] = dict(template_kwargs or {})
        if tools:
            messages, tool_kwargs = self.tools.prepare(messages, tools)
            extra.update(tool_kwargs)
        template = self.template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise bad_request("This model has no chat template; use /v1/completions.",
                              param="messages")
        try:
            return tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                chat_template=template, **extra)
        except Exception as exc:  # jinja2 TemplateError, raise_exception() in templates
            raise bad_request(f"The chat template rejected the messages: {exc}",
                              param="messages") from None


def build_chat_format(tokenizer: Any, template_file: str | None, tool_parser: str,
                      parse_special_tokens: bool = False) -> ChatFormat:
    template = Path(template_file).read_text() if template_file else None
    text = template or getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(text, str):            # a dict of named templates: the default one
        text = str(text)
    family = detect_format(text) if tool_parser == "auto" else tool_parser
    control = () if parse_special_tokens else tuple(sorted(
        {t.content for t in tokenizer.added_tokens_decoder.values() if t.content},
        key=len, reverse=True))
    return ChatFormat(template, tool_format(family), "<think>" in text, control)
