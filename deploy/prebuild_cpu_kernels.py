"""Build the engine's CPU kernels ahead of time for the ISA levels an image serves, and install each
as an importable module (`engine_core.cpu.kernels.module_name(march)`) in site-packages, where the engine imports
it instead of compiling at start; each CPU then takes the build of its own level (`target_march()`).

    python deploy/prebuild_cpu_kernels.py avx2 avx512 avx512_bf16

Compiling for an ISA does not need the CPU to have it, running the result does: every level is built,
and only those this machine can run are import-checked (the others are loaded where they run; a CPU
that lacks a prebuilt module's ISA skips it). The flags are the engine's own (engine_core.cpu.kernels.CFLAGS and
the level's named -march), built as torch's `cpp_extension.load()` builds them, less its import.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
import sysconfig
import tempfile
import time
import types
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "engine_core"
# engine_core.cpu.kernels and .features alone, not the package's __init__ (which needs every dependency
# of the project): the image builds the kernels from their sources before it installs the project
if "engine_core" not in sys.modules:
    _package = types.ModuleType("engine_core")
    _package.__path__ = [str(PACKAGE)]
    sys.modules["engine_core"] = _package
cpu_kernels = importlib.import_module("engine_core.cpu.kernels")
ISA_LEVELS = importlib.import_module("engine_core.cpu.features").ISA_LEVELS
cpu_features = importlib.import_module("engine_core.cpu.features").cpu_features


def build(isa: str, dest: Path) -> Path:
    """What torch's `cpp_extension.load()` does when the engine compiles at start (its ninja build, with
    the engine's flags), without the import that ends `load()`."""
    from torch.utils.cpp_extension import _write_ninja_file_and_build_library

    march = cpu_kernels.MARCH_FOR_ISA[isa]
    name = cpu_kernels.module_name(march)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        _write_ninja_file_and_build_library(
            name=name, sources=[str(s) for s in cpu_kernels.SOURCES],
            extra_cflags=[*cpu_kernels.CFLAGS, f"-march={march}"], extra_cuda_cflags=[], extra_sycl_cflags=[],
            extra_ldflags=["-fopenmp"], extra_include_paths=[], build_directory=tmp, verbose=False,
            with_cuda=False, with_sycl=False, is_standalone=False)
        target = dest / f"{name}.so"
        shutil.copy2(Path(tmp, f"{name}.so"), target)
    print(f"{isa}: -march={march} -> {target} ({target.stat().st_size // 1024} KiB, "
          f"{time.perf_counter() - started:.0f} s)", flush=True)
    return target


def check(isa: str) -> None:
    """Import the installed module the way the engine does, and see that it is the prebuilt one."""
    march = cpu_kernels.MARCH_FOR_ISA[isa]
    got = cpu_kernels.build_for_march(march)
    assert got is not None and got.source == "prebuilt" and got.isa == isa, (isa, got)
    print(f"{isa}: imported {got.module.__name__}: {got.describe()}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("isas", nargs="+", choices=ISA_LEVELS)
    parser.add_argument("--dest", type=Path, default=Path(sysconfig.get_paths()["platlib"]))
    args = parser.parse_args()
    if str(args.dest) not in sys.path:
        sys.path.insert(0, str(args.dest))  # where the checks import them from
    here = cpu_features()
    print(f"this machine: {here.describe()}", flush=True)
    for isa in args.isas:
        build(isa, args.dest)
    runnable = [isa for isa in args.isas if ISA_LEVELS.index(isa) <= ISA_LEVELS.index(here.isa)]
    for isa in runnable:
        check(isa)
    skipped = sorted(set(args.isas) - set(runnable))
    if skipped:
        print(f"not import-checked (this CPU lacks the ISA): {' '.join(skipped)}", flush=True)
    if not runnable:
        print("warning: this machine can run none of these builds: none was import-checked", flush=True)


if __name__ == "__main__":
    main()
