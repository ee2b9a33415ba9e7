from engine_core.attention.metadata import AttentionMetadata
from engine_core.attention.torch_ref import TorchReferenceAttention

__all__ = ["AttentionMetadata", "TorchReferenceAttention"]
