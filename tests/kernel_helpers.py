"""The compiled CPU kernels' builds under test: each ISA level's build runs where this CPU has that ISA,
and is skipped with the reason elsewhere."""

from __future__ import annotations

from types import ModuleType

import pytest

from engine_core.cpu.kernels import build_for_isa

ISAS = ["avx512_bf16", "avx2"]


def kernels_for(isa: str) -> ModuleType:
    build = build_for_isa(isa)
    if build is None:
        pytest.skip(f"this CPU cannot run the {isa} build (or there is no C++ compiler)")
    return build.module
