"""Engine configuration: what to load and how much memory and batch it may use."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


@dataclass(slots=True)
class EngineConfig:
    model: str = "embedded"  # "embedded", a local HF directory, or a hub id
    dtype: str = "float32"
    block_size: int = 16
    kv_cache_bytes: int = 512 * 1024**2  # memory budget for the paged KV cache
    num_blocks: int | None = None  # overrides kv_cache_bytes when set (tests)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    enable_prefix_caching: bool = False
    num_threads: int | None = None  # torch intra-op threads; None keeps torch's default
    # "auto": Triton kernels on CUDA; on CPU the compiled paged-decode kernel for bf16/fp16 when it
    # builds, else the torch reference. "torch": always the reference (fp32 on CPU always uses it: it
    # is what the exactness tests check). "triton": the Triton kernels (on CPU only under TRITON_INTERPRET=1).
    attention_backend: str = "auto"
    device: str = "auto"  # "auto": CUDA when torch sees a GPU, else the CPU
    cuda_graphs: bool = True  # decode steps replayed from graphs captured per batch-size bucket (CUDA only)

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        try:
            return _DTYPES[self.dtype]
        except KeyError:
            raise ValueError(f"unsupported dtype {self.dtype!r}; use one of {sorted(_DTYPES)}") from None
