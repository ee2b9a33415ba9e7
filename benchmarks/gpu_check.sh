#!/usr/bin/env bash
# One prepared GPU check, for the `device` machine (under 8 minutes): the Triton kernel tests on the
# GPU, the paged-decode kernel's GB/s against a device-to-device copy, and the engine's end-to-end
# throughput with and without CUDA graphs. The timeouts add up to under 8 minutes. Prints short
# tables; record them in docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
if ! $PY -c "import torch, triton" 2>/dev/null; then
    $PY -m pip install -q torch==2.13.0 triton pytest numpy
fi
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
echo "== kernel tests and the engine's GPU path (Triton attention in the engine, CUDA graphs) on the GPU"
timeout 170 $PY -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_engine_gpu_path.py
echo "== paged-decode kernel, bf16"
timeout 90 $PY benchmarks/gpu_kernels.py
echo "== end-to-end engine throughput on CUDA, with CUDA graphs, against transformers' generate on the GPU"
timeout 150 $PY benchmarks/engine_throughput.py --device cuda --concurrency 1 32 128 --hf-requests 2
echo "== the same at batch 1 without CUDA graphs"
timeout 50 $PY benchmarks/engine_throughput.py --device cuda --concurrency 1 --hf-requests 1 --no-cuda-graphs
