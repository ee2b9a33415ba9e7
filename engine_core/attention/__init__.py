from engine_core.attention.metadata import AttentionBackend, AttentionMetadata
from engine_core.attention.torch_ref import TorchReferenceAttention

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchReferenceAttention"]
