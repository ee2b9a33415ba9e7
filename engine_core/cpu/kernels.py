"""The engine's compiled CPU kernels (`engine_core/cpu/csrc/`), built once per machine.

One extension module holds the paged decode attention, the grammar bitmask, the LoRA delta and the fused layer ops
(RMSNorm with the residual add, rotary embeddings, silu * up: in fp32 for every CPU, in bf16 only where
the CPU has AVX-512 BF16, as is the bf16 linear layer) and the linear layer over int8/int4 codes (every CPU).
torch's extension builder compiles it on first use for the CPU it runs on (-march from the CPU's ISA, or
$LLMGW_KERNEL_MARCH) with OpenMP, so that torch's threads share the work, and caches it under
~/.cache/torch_extensions (or $TORCH_EXTENSIONS_DIR). A container image builds it ahead of time and installs
it as a module; a build whose ISA this CPU lacks is not used. With no C++ compiler the engine keeps its torch
reference paths.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from engine_core.cpu.features import ISA_LEVELS, cpu_features

log = logging.getLogger("llmgw.engine")
CSRC = Path(__file__).with_name("csrc")
# only bindings.cpp includes torch/extension.h (pybind11): the others take ATen/ATen.h and at:: names, which
# compile in 8 s a file instead of 29 (a whole build 96 s instead of 330 on 2 AVX2 cores)
SOURCES = [CSRC / name for name in
           ("paged_decode.cpp", "layer_ops.cpp", "layer_ops_f32.cpp", "token_bitmask.cpp", "lora_delta.cpp",
            "linear_bf16.cpp", "linear_bf16_amx.cpp", "linear_quant.cpp", "linear_quant_bf16.cpp",
            "linear_quant_amx.cpp", "linear_quant_rows.cpp", "decoder_stack.cpp", "bindings.cpp")]
# the target CPU: by default the ISA this CPU has; an image built on one machine for others sets e.g. x86-64-v3
MARCH_ENV = "LLMGW_KERNEL_MARCH"
# -march for each ISA level, named rather than "native": a capped ISA (LLMGW_CPU_ISA) builds what it says,
# and a build made on one machine (an image) runs on any other of its level (cooperlake: x86-64-v4 + BF16)
MARCH_FOR_ISA = {"avx512_bf16": "cooperlake", "avx512": "x86-64-v4", "avx2": "x86-64-v3", "scalar": "x86-64"}
CFLAGS = ["-O3", "-ffast-math", "-fopenmp"]  # -fopenmp: at::parallel_for is a header template


@dataclass(frozen=True, slots=True)
class KernelBuild:
    module: ModuleType
    march: str
    isa: str  # what the module was compiled for
    source: str  # "prebuilt" (an installed module, as in the image), "cache" or "compiled"
    seconds: float

    @property
    def kernels(self) -> list[str]:
        names = ("paged_decode", "apply_token_bitmask_", "rms_norm", "rotary_", "silu_and_mul", "rms_norm_f32",
                 "rotary_f32_", "silu_and_mul_f32", "lora_delta_", "linear_bf16", "linear_quant_", "DecoderStack")
        return sorted(n for n in names if hasattr(self.module, n))

    def describe(self) -> str:
        how = {"prebuilt": "imported the prebuilt module", "cache": "loaded from the cache"}.get(self.source,
                                                                                                 "compiled")
        return (f"{how} in {self.seconds:.1f} s, -march={self.march} {' '.join(CFLAGS)}, "
                f"compiled for {self.isa}, kernels {', '.join(self.kernels)}")


_builds: dict[str, KernelBuild | None] = {}  # by -march


def target_march() -> str:
    return os.environ.get(MARCH_ENV) or MARCH_FOR_ISA[cpu_features().isa]


def module_name(march: str | None = None) -> str:
    """Named for the target CPU and the sources (headers included, which torch's builder does not
    track), so that a changed kernel is never served from a stale build."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(CSRC.iterdir()) if p.suffix in (".cpp", ".h")))
    return f"llmgw_cpu_kernels_{(march or target_march()).replace('-', '_')}_{digest.hexdigest()[:10]}"


def _runs_here(isa: str) -> bool:
    return isa in ISA_LEVELS and ISA_LEVELS.index(isa) <= ISA_LEVELS.index(cpu_features().isa)


def kernel_build() -> KernelBuild | None:
    """The compiled module for this CPU, built on first use (logged with its flags, ISA and duration);
    None when it cannot be built here."""
    return build_for_march(target_march())


def build_for_isa(isa: str) -> KernelBuild | None:
    """The build of one ISA level's paths (tests check each level this CPU can run)."""
    return build_for_march(MARCH_FOR_ISA[isa]) if _runs_here(isa) else None


def build_for_march(march: str) -> KernelBuild | None:
    if march not in _builds:
        _builds[march] = _load(march)
    return _builds[march]


def _load(march: str) -> KernelBuild | None:
    name, started = module_name(march), time.perf_counter()
    try:  # built ahead of time and installed as a module (the container image does this)
        module: ModuleType | None = importlib.import_module(name)
        source = "prebuilt"
    except ImportError:
        module, source = None, "compiled"
    if module is not None and not _runs_here(module.compiled_isa()):
        log.warning("the prebuilt CPU kernels target %s, which this CPU (%s) lacks; compiling for it",
                    module.compiled_isa(), cpu_features().isa)
        return build_for_march(MARCH_FOR_ISA[cpu_features().isa])
    try:
        if module is None:
            from torch.utils.cpp_extension import _get_build_directory, load

            build_dir = Path(_get_build_directory(name, verbose=False))
            _clear_stale_lock(build_dir)
            cached = (build_dir / f"{name}.so").is_file()
            source = "cache" if cached else "compiled"
            log.info("CPU kernels: %s (-march=%s) ...", "loading the cached build" if cached
                     else "compiling for this CPU, once (about a minute)", march)
            module = load(name=name, sources=[str(s) for s in SOURCES], extra_cflags=[*CFLAGS, f"-march={march}"],
                          extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, no headers: the reference paths still work
        log.warning("CPU kernels unavailable, using the torch reference paths: %s", exc)
        return None
    return KernelBuild(module, march, module.compiled_isa(), source, time.perf_counter() - started)


STALE_LOCK_SECONDS = 600.0  # no file of a live build stays untouched this long (one source compiles in < 1 min)


def _clear_stale_lock(build_dir: Path) -> None:
    """torch's build lock left by a process killed mid-build makes every later load wait on it forever:
    remove it when nothing in the build folder has changed for STALE_LOCK_SECONDS."""
    lock = build_dir / "lock"
    try:
        newest = max(p.stat().st_mtime for p in build_dir.iterdir())
        if lock.exists() and time.time() - newest > STALE_LOCK_SECONDS:
            log.warning("CPU kernels: removing a stale build lock (%s, untouched for %.0f s: its build was killed)",
                        lock, time.time() - newest)
            lock.unlink(missing_ok=True)
    except (OSError, ValueError):  # no folder yet (ValueError: empty), or another process removed it first
        pass


def cpu_kernels() -> ModuleType | None:
    build = kernel_build()
    return None if build is None else build.module
