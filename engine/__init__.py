"""kvserve's continuous-batching engine: usable on its own, with no server.

    from engine import load_model, GenerationConfig
    model = load_model("smollm2-135m-instruct")
    outputs = model.generate_batch([model.tokenizer.encode("Hello")],
                                   GenerationConfig(max_new_tokens=16))
"""

from .config import ContinuousBatchingConfig
from .generation_config import GenerationConfig
from .manager import ContinuousBatchingManager
from .model_api import EngineModel, load_model
from .outputs import GenerationOutput, RequestStatus
from .pooling import Pooling

__all__ = [
    "ContinuousBatchingConfig", "ContinuousBatchingManager", "EngineModel",
    "GenerationConfig", "GenerationOutput", "Pooling", "RequestStatus", "load_model",
]
