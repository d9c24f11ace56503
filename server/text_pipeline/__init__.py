"""The text pipeline between messages and tokens: chat templates (bounded), prompts,
detokenizing, stop strings, reasoning blocks, tool-call formats and their streaming,
logprobs, and the grammars of structured output."""
