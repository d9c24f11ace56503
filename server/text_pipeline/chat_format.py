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

from ..edge.errors import bad_request
from .template_bounds import TemplateBounds, TemplateOverrun, render_within
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
    bounds: TemplateBounds = TemplateBounds()
    """Time, memory and size a render may take (template_bounds.py)."""

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
            return self.bounded_render(tokenizer, template, messages, add_generation_prompt,
                                       extra)
        except TemplateOverrun as overrun:
            raise bad_request(f"The chat template was stopped: {overrun}.",
                              param="messages") from None
        except MemoryError:      # one operation asked for more than the host has
            raise bad_request("The chat template was stopped: its output does not fit in "
                              "memory.", param="messages") from None
        except Exception as exc:  # jinja2 TemplateError, raise_exception() in templates
            raise bad_request(f"The chat template rejected the messages: {exc}",
                              param="messages") from None

    def bounded_render(self, tokenizer: Any, template: str, messages: list[dict],
                       add_generation_prompt: bool, extra: dict[str, Any]) -> str:
        """The template's text within self.bounds (TemplateOverrun past them)."""
        return render_within(lambda: tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            chat_template=template, **extra), self.bounds)


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
    chat_format = ChatFormat(template, tool_format(family), "<think>" in text, control)
    if text:
        _probe(chat_format, tokenizer, text)
    return chat_format


def _probe(chat_format: ChatFormat, tokenizer: Any, template: str) -> None:
    """Render one short message at start: a template that runs past its bounds on it
    would stall every chat, so the server refuses it now, naming the bound. Other
    refusals (a template that wants a system message first) are left to requests."""
    try:
        chat_format.bounded_render(tokenizer, template, [{"role": "user", "content": "Hello"}],
                                   True, {})
    except TemplateOverrun as overrun:
        raise ValueError(f"chat template refused at start: {overrun}") from None
    except Exception:  # noqa: BLE001 - judged per request, as before
        pass
