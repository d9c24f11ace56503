"""Speculative decoding: drafts from the scheduler's proposer (proposer.py over
prompt_lookup.py), checked by the verify rule (acceptance.py) on the step's logits;
the setting is config.py's. Import the modules themselves: the scheduler's side
imports no torch."""
