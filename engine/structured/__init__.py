"""Structured output: grammars compiled from JSON schemas, regexes and tool formats
(grammar.py) and the token masks they give each step (grammar_masks.py)."""
