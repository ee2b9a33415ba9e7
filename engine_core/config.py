"""Engine configuration: what to load and how much memory and batch it may use."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine_core.cpu.features import cpu_features
from engine_core.spec_decode.config import SpeculativeConfig

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


@dataclass(slots=True)
class EngineConfig:
    model: str = "embedded"  # "embedded", a local HF directory, or a hub id
    # "auto": bf16 on CUDA and on CPUs with native bf16 (AVX512-BF16, AMX), else float32: on an AVX2-only CPU
    # torch's bf16 matmul is ~4x slower than fp32. Or force "float32", "bfloat16", "float16" (CUDA).
    dtype: str = "auto"
    # "auto": a checkpoint as it is stored (a .gguf keeps its block formats where a kernel exists, others in
    # the dtype); "none": every weight in the dtype; "int8" (per output channel) / "int4" (groups of 32, a
    # scale and a min): each matmul's weight, the LM head and the embedding table quantized once at load
    quantization: str = "auto"
    block_size: int = 16
    kv_cache_bytes: int = 512 * 1024**2  # memory budget for the paged KV cache
    num_blocks: int | None = None  # overrides kv_cache_bytes when set (tests)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # vLLM's: above 0, a prompt gets at most this many tokens a step, so a long prefill's chunks leave room in
    # the budget for the prompts that arrive behind it (0: a chunk may take the whole budget)
    long_prefill_token_threshold: int = 0
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    enable_prefix_caching: bool = False
    num_threads: int | None = None  # torch intra-op threads; None keeps torch's default
    # "auto": Triton kernels on CUDA; on CPU the compiled paged-decode kernel (any dtype) when it builds,
    # else the torch reference. "torch": always the reference. "triton": the Triton kernels (on CPU only
    # under TRITON_INTERPRET=1).
    attention_backend: str = "auto"
    device: str = "auto"  # "auto": CUDA when torch sees a GPU, else the CPU
    cuda_graphs: bool = True  # decode steps replayed from graphs captured per batch-size bucket (CUDA only)
    lora_adapters: dict[str, str] = field(default_factory=dict)  # name -> PEFT adapter directory, loaded at start
    max_loras: int = 4  # distinct LoRA adapters in one step (more wait for a later step)
    max_lora_rank: int = 16  # adapters of a higher rank are refused
    speculative: SpeculativeConfig | None = None  # speculative decoding; None: off

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        return self.dtype_choice()[0]

    def dtype_choice(self) -> tuple[torch.dtype, str]:
        """The weights' dtype, and why it was chosen (for the start log and /info)."""
        if self.dtype != "auto":
            dtype = _DTYPES.get(self.dtype)
            if dtype is None:
                raise ValueError(f"unsupported dtype {self.dtype!r}; use 'auto' or one of {sorted(_DTYPES)}")
            if dtype == torch.float16 and self.torch_device().type != "cuda":
                raise ValueError("dtype float16 is for CUDA; on a CPU use float32 or bfloat16 (or auto)")
            return dtype, "set in the config"
        if self.torch_device().type == "cuda":
            if torch.cuda.is_bf16_supported():
                return torch.bfloat16, "auto: CUDA with bf16"
            return torch.float16, "auto: CUDA without bf16"
        cpu = cpu_features()
        if cpu.native_bf16:
            return torch.bfloat16, f"auto: the CPU has native bf16 ({cpu.isa})"
        return torch.float32, f"auto: the CPU has no native bf16 ({cpu.isa}), where fp32 matmuls are faster"
