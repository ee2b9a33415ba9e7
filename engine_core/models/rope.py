"""Rotary position embeddings (HF's rotate-half layout), with llama3 and linear scaling."""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])  # type: ignore[index]
    if kind == "llama3":
        assert scaling is not None
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
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r}")


class RotaryEmbedding:
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)  # [max_positions, head_dim]
        self.sin = emb.sin().to(device=device, dtype=dtype)

        half = head_dim // 2
        self.signed_sin = torch.cat([-self.sin[:, :half], self.sin[:, half:]], dim=-1)  # folds rotate-half's sign

    def rotation(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of one step's positions, [T, 1, D] each: gathered once for every layer."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [T, H, D] (queries and keys together). x·cos + rotate_half(x)·sin, where rotate_half(x) is
        (-x2, x1): rolling by half gives (x2, x1), and the sign lives in signed_sin."""
        cos, signed_sin = rotation
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
