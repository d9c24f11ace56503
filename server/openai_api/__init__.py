"""OpenAI's dialect: chat completions, completions and Responses (stored ones too),
each a thin translation of its body onto the one generation path (generation.py)
and of the engine's outputs back into its answer and stream shapes. Their wire
models are in server/protocol/."""
