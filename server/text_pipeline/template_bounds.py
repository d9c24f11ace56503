"""Bounds on rendering a chat template: time, memory growth and output size.

A chat template is code from the model's files (a GGUF's metadata,
tokenizer_config.json) or the operator's `--chat-template`. transformers renders it
in Jinja's sandbox, which stops it reaching Python's internals (test_template_sandbox.py)
but not from looping or growing without end:

    {% for a in r %}{% for b in r %}{% for c in r %}{% endfor %}{% endfor %}{% endfor %}
    {% for i in range(100000) %}{{ 'x' * 100000000 }}{% endfor %}

Jinja compiles a template to Python code whose frames carry the file name
"<template>". While one renders, the rendering thread (a worker thread, never the
event loop) carries a trace function that follows only those frames: at every line
they run it checks the clock, and the process's resident memory once a millisecond; it raises
TemplateOverrun when the render has run past `seconds` or grown the process by more
than `max_growth_bytes`. The render's text is refused past `max_chars`. Frames of other
code (transformers, the tokenizer) run untraced, so a normal render costs what it cost
(a traced line costs a fraction of a microsecond more).

A single operation that builds a huge value (`'x' * 10**10`) cannot be interrupted
halfway: Python raises MemoryError when it cannot allocate, else the check after it
stops the render at its next line.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

TEMPLATE_FILE = "<template>"
"""The code file name Jinja gives a template compiled from a string."""
_PAGE = os.sysconf("SC_PAGE_SIZE")
MEMORY_EVERY_S = 0.001
"""How often a render's memory is read (a read of /proc costs some microseconds; a
template line, well under one)."""


class TemplateOverrun(Exception):
    """A render ran past its bounds; the message says which."""


@dataclass(frozen=True)
class TemplateBounds:
    seconds: float = 2.0
    max_growth_bytes: int = 512 * 2**20
    max_chars: int = 64 * 2**20

    def __post_init__(self) -> None:
        for name, value in (("seconds", self.seconds),
                            ("max_growth_bytes", self.max_growth_bytes),
                            ("max_chars", self.max_chars)):
            if not value > 0:
                raise ValueError(f"TemplateBounds.{name} must be positive, got {value!r}")


def resident_bytes() -> int:
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * _PAGE


def render_within(render: Callable[[], str], bounds: TemplateBounds) -> str:
    """render() with its template's frames bounded; TemplateOverrun past a bound."""
    started = last_measured = time.monotonic()
    baseline = resident_bytes()

    def trace_template_lines(frame, event, arg):
        nonlocal last_measured
        now = time.monotonic()
        if now - started > bounds.seconds:
            raise TemplateOverrun(f"the chat template ran longer than {bounds.seconds:g} s")
        if now - last_measured > MEMORY_EVERY_S:
            last_measured = now
            if resident_bytes() - baseline > bounds.max_growth_bytes:
                raise TemplateOverrun(f"the chat template grew the server's memory by more "
                                      f"than {bounds.max_growth_bytes // 2**20} MiB")
        return trace_template_lines

    def trace_calls(frame, event, arg):
        return trace_template_lines if frame.f_code.co_filename == TEMPLATE_FILE else None

    previous = sys.gettrace()
    sys.settrace(trace_calls)
    try:
        text = render()
    finally:
        sys.settrace(previous)
    if len(text) > bounds.max_chars:
        raise TemplateOverrun(f"the chat template's output ({len(text):,} characters) is "
                              f"longer than {bounds.max_chars:,}")
    return text
