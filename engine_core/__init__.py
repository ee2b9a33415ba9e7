"""llm-gateway's in-process inference engine: paged KV cache, continuous batching, Llama models."""

from engine_core.async_engine import AsyncEngine, EngineDeadError
from engine_core.config import EngineConfig
from engine_core.engine import LLMEngine, RequestError
from engine_core.loader import ModelLoadError
from engine_core.outputs import FINISH_EOS, FINISH_LENGTH, FINISH_STOP, RequestOutput
from engine_core.sampling.params import SamplingParams
from engine_core.sequence import TokenLogprob

__all__ = [
    "AsyncEngine", "EngineConfig", "EngineDeadError", "FINISH_EOS", "FINISH_LENGTH", "FINISH_STOP",
    "LLMEngine", "ModelLoadError", "RequestError", "RequestOutput", "SamplingParams", "TokenLogprob",
]
