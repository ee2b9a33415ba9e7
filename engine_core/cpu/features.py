"""What the CPU can do, read once from /proc/cpuinfo: it decides the engine's default dtype and which
compiled kernel path runs.

Machines of one kind differ here: some have AVX-512 with native bf16 (vdpbf16ps), where bf16 weights
halve the memory traffic at full speed; others only AVX2, where torch's bf16 matmul runs ~4x slower than
fp32. `LLMGW_CPU_ISA` (avx512_bf16 | avx512 | avx2 | scalar) caps what the engine believes it has, so
one machine can take (and test) the path of a lesser one.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

ISA_ENV = "LLMGW_CPU_ISA"
ISA_LEVELS = ("scalar", "avx2", "avx512", "avx512_bf16")  # each implies the ones before it
FLAGS_THAT_MATTER = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni",
                     "amx_bf16", "amx_tile")


@dataclass(frozen=True, slots=True)
class CpuFeatures:
    model_name: str
    flags: frozenset[str]
    isa: str  # the best of ISA_LEVELS this CPU has (after the LLMGW_CPU_ISA cap)

    @property
    def native_bf16(self) -> bool:
        """bf16 matmuls at (or above) fp32 speed: AVX512-BF16 or AMX."""
        return self.isa == "avx512_bf16"

    @property
    def amx_bf16(self) -> bool:
        """AMX tiles for bf16 (Sapphire Rapids and later): oneDNN's bf16 GEMM runs on them, several times
        faster than any AVX-512 kernel from a few rows up."""
        return self.native_bf16 and {"amx_bf16", "amx_tile"} <= self.flags

    def describe(self) -> str:
        shown = [f for f in FLAGS_THAT_MATTER if f in self.flags]
        return f"{self.model_name} ({' '.join(shown) or 'no SIMD flags'}; path {self.isa})"


def _read_cpuinfo() -> tuple[str, frozenset[str]]:
    """The first processor's model name and flags (every core of these machines is the same)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the end of the first processor's block
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:  # not Linux: no flags known, the portable paths run
        pass
    model = fields.get("model name") or platform.processor() or platform.machine()
    return model, frozenset(fields.get("flags", "").split())


def _isa_of(flags: frozenset[str]) -> str:
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return "avx512_bf16" if "avx512_bf16" in flags or "amx_bf16" in flags else "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return "scalar"


@functools.cache
def cpu_features() -> CpuFeatures:
    model, flags = _read_cpuinfo()
    isa = _isa_of(flags)
    cap = os.environ.get(ISA_ENV)
    if cap:
        if cap not in ISA_LEVELS:
            raise ValueError(f"{ISA_ENV}={cap!r}; use one of {', '.join(ISA_LEVELS)}")
        isa = ISA_LEVELS[min(ISA_LEVELS.index(isa), ISA_LEVELS.index(cap))]
    return CpuFeatures(model, flags, isa)
