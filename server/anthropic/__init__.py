"""Anthropic's Messages API (/v1/messages), a translation onto the chat path:
protocol.py (the request schema), translate.py (onto ChatCompletionRequest),
serving.py (the route), stream_blocks.py (streamed content blocks), errors.py
(Anthropic's error shape)."""
