"""Typed errors the engine raises for bad input or bad state."""


class EngineError(Exception):
    """Base class of the engine's own errors."""


class RequestTooLongError(EngineError, ValueError):
    """A request's prompt plus `max_new_tokens` can never fit in the KV cache or the
    model's context window."""


class InvalidRequestError(EngineError, ValueError):
    """A request argument is malformed (empty prompt, token id out of range, bad
    sampling parameter, unknown keyword)."""


class ManagerStoppedError(EngineError, RuntimeError):
    """The manager no longer accepts requests (stopped or destroyed)."""


class QueueFullError(EngineError, RuntimeError):
    """`max_queue_size` requests are already waiting."""


class ModelLoadError(RuntimeError):
    """The model spec could not be resolved or read (loading/model_files.py, loading/hf_check.py)."""
