"""Speculative decoding: proposers draft tokens, the engine's step verifies them exactly."""

from engine_core.spec_decode.config import SpeculativeConfig
from engine_core.spec_decode.decoder import SpecCounters, SpecDecoder, build_spec_decoder, draft_accepted

__all__ = ["SpecCounters", "SpecDecoder", "SpeculativeConfig", "build_spec_decoder", "draft_accepted"]
