"""Rotary position embeddings (HF's rotate-half layout) with the scalings transformers has for the families we
serve: linear, dynamic, llama3 (Llama 3.1/3.2) and longrope (Phi-3/4); and partial rotary (Phi), where only
the first `rotary_dim` dims of a head turn.

Scalings whose frequencies transformers changes with the sequence's length are fixed once per deployment, as
vLLM does, so a cached key never needs re-rotating:
- dynamic NTK changes nothing below `max_position_embeddings`, the engine's cap on a sequence: plain RoPE;
- longrope takes its long factors for every position when the deployment's max length passes
  `original_max_position_embeddings`, else its short ones (transformers switches per forward on the length).
"""

from __future__ import annotations

import math
from typing import Any

import torch

SCALINGS = ("default", "linear", "dynamic", "llama3", "longrope")


def scaling_type(scaling: dict[str, Any] | None) -> str:
    return str((scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default")


def inverse_frequencies(rotary_dim: int, theta: float, scaling: dict[str, Any] | None,
                        max_positions: int = 0) -> tuple[torch.Tensor, float]:
    """The inverse frequencies and the factor cos and sin are multiplied by (longrope's attention factor)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    kind = scaling_type(scaling)
    if kind in ("default", "dynamic"):
        return inv_freq, 1.0
    assert scaling is not None
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low_freq_factor, old_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "longrope":
        original = int(scaling["original_max_position_embeddings"])
        factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        ext = scaling["long_factor"] if max_positions > original else scaling["short_factor"]
        shape = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        return 1.0 / (torch.tensor(ext, dtype=torch.float32) * theta ** shape), float(attention_factor)
    raise ValueError(f"unsupported rope_scaling type {kind!r}")


class RotaryEmbedding:
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
                 dtype: torch.dtype, device: torch.device | str = "cpu", rotary_dim: int | None = None) -> None:
        self.rotary_dim = rotary_dim or head_dim
        inv_freq, attention_factor = inverse_frequencies(self.rotary_dim, theta, scaling, max_positions)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = (emb.cos() * attention_factor).to(device=device, dtype=dtype)  # [max_positions, rotary_dim]
        self.sin = (emb.sin() * attention_factor).to(device=device, dtype=dtype)

        half = self.rotary_dim // 2
        self.signed_sin = torch.cat([-self.sin[:, :half], self.sin[:, half:]], dim=-1)  # folds rotate-half's sign

    def rotation(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of one step's positions, [T, 1, D] each: gathered once for every layer."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [T, H, D] (queries and keys together). x·cos + rotate_half(x)·sin, where rotate_half(x) is
        (-x2, x1): rolling by half gives (x2, x1), and the sign lives in signed_sin. With partial rotary the
        dims past rotary_dim pass through."""
        cos, signed_sin = rotation
        if self.rotary_dim != x.shape[-1]:
            turned, kept = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
            return torch.cat([self.apply(turned, rotation), kept], dim=-1)
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
