"""The engine picks its dtype and its compiled kernels by the CPU it runs on, and says so.

`LLMGW_CPU_ISA` caps what the engine believes the CPU has, so an AVX-512 machine takes (and tests) the
path of an AVX2-only one; a machine without AVX-512 skips what it cannot run.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest
import torch

from engine_core.config import EngineConfig
from engine_core.cpu.features import ISA_ENV, ISA_LEVELS, cpu_features
from tests.server import ROOT


@pytest.fixture
def capped(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Set LLMGW_CPU_ISA for one test; cpu_features() is read once per process, so re-read it."""
    def cap(isa: str | None) -> None:
        if isa is None:
            monkeypatch.delenv(ISA_ENV, raising=False)
        else:
            monkeypatch.setenv(ISA_ENV, isa)
        cpu_features.cache_clear()

    yield cap
    cpu_features.cache_clear()


def test_auto_dtype_is_float32_without_native_bf16(capped) -> None:  # type: ignore[no-untyped-def]
    capped(None)
    have = ISA_LEVELS.index(cpu_features().isa)
    for isa in [level for level in ("avx2", "avx512", "scalar") if ISA_LEVELS.index(level) <= have]:
        capped(isa)
        dtype, reason = EngineConfig(dtype="auto", device="cpu").dtype_choice()
        assert dtype == torch.float32 and f"no native bf16 ({isa})" in reason


def test_auto_dtype_is_bf16_where_the_cpu_has_it(capped) -> None:  # type: ignore[no-untyped-def]
    capped(None)
    flags = cpu_features().flags
    dtype, reason = EngineConfig(dtype="auto", device="cpu").dtype_choice()
    if {"avx512f", "avx512bw", "avx512vl"} <= flags and ({"avx512_bf16", "amx_bf16"} & flags):
        assert dtype == torch.bfloat16 and "native bf16" in reason
    else:
        assert dtype == torch.float32


def test_a_forced_dtype_is_kept_whatever_the_cpu_and_float16_is_for_cuda(capped) -> None:  # type: ignore[no-untyped-def]
    capped("avx2")
    assert EngineConfig(dtype="bfloat16", device="cpu").dtype_choice() == (torch.bfloat16, "set in the config")
    assert EngineConfig(dtype="float32", device="cpu").dtype_choice()[0] == torch.float32
    with pytest.raises(ValueError, match="float16 is for CUDA"):
        EngineConfig(dtype="float16", device="cpu").dtype_choice()
    with pytest.raises(ValueError, match="unsupported dtype 'int4'"):
        EngineConfig(dtype="int4", device="cpu").dtype_choice()


def test_an_unknown_isa_cap_is_refused(capped) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="LLMGW_CPU_ISA='avx9'"):
        capped("avx9")
        cpu_features()


def test_check_config_says_which_dtype_auto_gives_and_why() -> None:
    out = subprocess.run([sys.executable, "-m", "gateway", "check-config", str(ROOT / "config.toml")],
                         capture_output=True, text=True, cwd=ROOT, env={**os.environ, ISA_ENV: "avx2"}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "backend local (type engine): model embedded, dtype auto -> float32 (auto: the CPU has no native bf16 " \
           "(avx2)" in out.stdout


ENGINE_ON_AVX2 = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from engine_core import EngineConfig, LLMEngine, SamplingParams
engine = LLMEngine(EngineConfig(model=sys.argv[1], dtype="bfloat16", num_blocks=64, max_num_seqs=2))
print("ATTENTION", engine.model.attention.name, "OPS", type(engine.model.ops).__name__)
[out] = engine.generate(["The capital of France is"], SamplingParams(max_new_tokens=8))
print("TOKENS", [o.token_id for o in out])
"""


def test_a_cpu_without_avx512_takes_the_avx2_build_and_logs_the_path(smollm_dir) -> None:  # type: ignore[no-untyped-def]
    """Forced bf16 on an AVX2-only CPU: the kernels are compiled for x86-64-v3 (no AVX-512 code, which
    would crash there), the bf16 fused layer ops (AVX-512 BF16 only) give way to torch's, and the log says all
    of it once, at start."""
    if "avx2" not in cpu_features().flags:
        pytest.skip("this CPU has no AVX2")
    run = subprocess.run([sys.executable, "-c", ENGINE_ON_AVX2, str(smollm_dir)], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, ISA_ENV: "avx2"}, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    log = run.stdout
    assert "dtype bfloat16 (set in the config)" in log and "path avx2" in log
    assert ("-march=x86-64-v3 -O3 -ffast-math -fopenmp, compiled for avx2, kernels DecoderStack, apply_token_bitmask_, "
            "linear_quant_, lora_delta_, paged_decode, rms_norm_f32, rotary_f32_, silu_and_mul_f32\n") in log
    assert "ATTENTION cpu-paged OPS TorchLayerOps" in log
    assert log.count("compiled for avx2") == 1  # once, at start
    assert len(ast.literal_eval(log.split("TOKENS ")[1].strip())) == 8
