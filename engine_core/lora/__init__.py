"""LoRA adapters over the base model: PEFT loading and validation, a registry, the batched delta."""

from engine_core.lora.adapter import LoraAdapter, LoraError, load_adapter
from engine_core.lora.batch import LoraBatch
from engine_core.lora.registry import LoraInUseError, LoraRegistry

__all__ = ["LoraAdapter", "LoraBatch", "LoraError", "LoraInUseError", "LoraRegistry", "load_adapter"]
