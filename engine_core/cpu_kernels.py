"""The engine's compiled CPU kernels (`engine_core/csrc/`), built once per machine.

One extension module holds the paged decode attention and the fused layer ops (RMSNorm with the
residual add, rotary embeddings; only where the CPU has AVX-512 BF16). torch's extension builder
compiles it on first use for this CPU (-march=native, or $LLMGW_KERNEL_MARCH) with OpenMP, so that
torch's threads share the work, and caches it under ~/.cache/torch_extensions (or
$TORCH_EXTENSIONS_DIR). A container image builds it ahead of time and installs it as a module. With
no C++ compiler the engine keeps its torch reference paths.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
from pathlib import Path
from types import ModuleType

log = logging.getLogger("llmgw.engine")
CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / name for name in ("paged_decode.cpp", "layer_ops.cpp", "bindings.cpp")]
# the target CPU: "native" where it runs; an image built on one machine for others sets e.g. x86-64-v3
MARCH_ENV = "LLMGW_KERNEL_MARCH"
_module: ModuleType | None = None
_tried = False


def module_name() -> str:
    """Named for the target CPU and the sources (headers included, which torch's builder does not
    track), so that a changed kernel is never served from a stale build."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(CSRC.iterdir()) if p.suffix in (".cpp", ".h")))
    return f"llmgw_cpu_kernels_{os.environ.get(MARCH_ENV, 'native').replace('-', '_')}_{digest.hexdigest()[:10]}"


def cpu_kernels() -> ModuleType | None:
    """The compiled module, built on first use; None when it cannot be built here."""
    global _module, _tried
    if not _tried:
        _tried = True
        march = os.environ.get(MARCH_ENV, "native")
        try:
            try:  # built ahead of time and installed as a module (the container image does this)
                _module = importlib.import_module(module_name())
            except ImportError:
                from torch.utils.cpp_extension import load

                # -fopenmp: at::parallel_for is a header template, so without it a kernel runs on one thread
                _module = load(name=module_name(), sources=[str(s) for s in SOURCES],
                               extra_cflags=["-O3", f"-march={march}", "-ffast-math", "-fopenmp"],
                               extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as exc:  # no compiler, no headers: the reference paths still work
            log.warning("CPU kernels unavailable, using the torch reference paths: %s", exc)
    return _module
