"""The container recipe, read as text: the properties the deployment issues ask of it, which a
careless edit would break, checked in a second (tests/test_image.py builds and runs the image)."""

from __future__ import annotations

import re

from tests.server import ROOT

DOCKERFILE = (ROOT / "Dockerfile").read_text()
INSTRUCTIONS = [line.strip() for line in re.sub(r"\\\n", " ", DOCKERFILE).splitlines()
                if line.strip() and not line.lstrip().startswith("#")]


def stages() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    current = ""
    for line in INSTRUCTIONS:
        match = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line, re.I)
        if match:
            current = match.group(2) or match.group(1)
            found[current] = [line]
        elif current:
            found[current].append(line)
    return found


def test_multi_stage_cpu_by_default_cuda_by_build_argument() -> None:
    named = stages()
    assert list(named) == ["build", "runtime"]
    assert "ARG VARIANT=cpu" in INSTRUCTIONS
    build = " ".join(named["build"])
    assert "download.pytorch.org/whl/cpu" in build and "download.pytorch.org/whl/cu" in build
    assert any("torch==2.13.0" in line and "TORCH_INDEX" in line for line in named["build"])  # torch first, pinned


def test_the_base_image_is_a_build_argument() -> None:
    """An offline build names a local base (deploy/ci/setup.sh makes one with debootstrap)."""
    assert "ARG BASE_IMAGE=python:3.11-slim" in INSTRUCTIONS
    assert all(stage[0].startswith("FROM ${BASE_IMAGE} AS ") for stage in stages().values())


def test_every_stage_declares_the_build_arguments_it_uses() -> None:
    """buildah (podman build) does not pass an ARG on from one stage to the next, nor a global one into
    a stage that does not redeclare it: it would expand to nothing there."""
    declared_anywhere = {re.match(r"ARG\s+(\w+)", line).group(1) for line in INSTRUCTIONS if line.startswith("ARG ")}
    for name, lines in stages().items():
        declared: set[str] = set()
        for line in lines[1:]:  # FROM lines take the global ones
            if line.startswith("ARG "):
                declared.add(re.match(r"ARG\s+(\w+)", line).group(1))
                continue
            used = set(re.findall(r"\$\{?(\w+)", line)) & declared_anywhere
            assert used <= declared, f"stage {name}: {line!r} uses {used - declared} before an ARG for it"


def test_the_build_stage_has_what_the_kernel_build_needs() -> None:
    build = stages()["build"]
    apt = " ".join(line for line in build if "apt-get install" in line)
    assert "g++" in apt and "ninja-build" in apt  # torch's extension builder needs ninja
    assert any("Python.h" in line for line in build)  # the headers are checked, with a clear message
    assert not re.search(r"^#\s*syntax=", DOCKERFILE, re.M)  # BuildKit would pull the frontend


def test_the_kernels_are_prebuilt_per_isa_level_and_not_forced_at_runtime() -> None:
    named = stages()
    isas = next(line for line in named["build"] if line.startswith("ARG KERNEL_ISAS="))
    assert "avx2" in isas and "avx512_bf16" in isas
    assert any("deploy/prebuild_cpu_kernels.py ${KERNEL_ISAS}" in line for line in named["build"])
    # the kernel layer sees only the kernel sources, so a code change elsewhere does not recompile them
    prebuild = next(i for i, line in enumerate(named["build"]) if "prebuild_cpu_kernels.py ${" in line)
    assert not any(line.startswith("COPY engine_core ") for line in named["build"][:prebuild])
    runtime = " ".join(named["runtime"])
    assert "LLMGW_KERNEL_MARCH" not in runtime and "TORCH_EXTENSIONS_DIR" not in runtime
    assert "libgomp1" in runtime  # the prebuilt modules link libgomp.so.1 (g++ -fopenmp)


def test_runtime_is_non_root_and_serves_the_embedded_model_without_network() -> None:
    runtime = stages()["runtime"]
    users = [line for line in runtime if line.startswith("USER ")]
    assert users and users[-1] not in ("USER root", "USER 0") and "10001" in users[-1]
    assert any("resolve_model_dir('embedded')" in line for line in stages()["build"])  # converted at build
    assert any(line.startswith("COPY --from=build") and "/opt/models" in line for line in runtime)
    env = " ".join(line for line in runtime if line.startswith("ENV "))
    assert "HF_HUB_OFFLINE=1" in env and "LLMGW_MODEL_CACHE=/opt/models" in env and "HOME=/tmp" in env
    assert any(line.startswith("HEALTHCHECK") and "/live" in line for line in runtime)
    assert runtime[-1].startswith("CMD") and "/etc/llm-gateway/config.toml" in runtime[-1]
    assert (ROOT / "deploy" / "config.toml").is_file()


def test_dockerignore_keeps_local_environments_and_tests_out_of_the_context() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv*", "tests", "bench-results", "deploy/ci"} <= set(ignored)


def test_the_image_default_config_is_valid() -> None:
    from gateway.config import load_config

    config = load_config(ROOT / "deploy" / "config.toml")
    assert config.server.host == "0.0.0.0" and config.server.drain_timeout < 30


def test_the_installed_package_carries_the_kernel_sources(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The image copies these folders, installs them with `pip install .`, then compiles the CPU kernels
    from the installed package: the wheel must hold every source and header they are built from."""
    import shutil
    import subprocess
    import sys
    import zipfile

    src = tmp_path / "src"  # a fresh copy, as the image's COPY lines make it: no stale build/ folder
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in ("gateway", "backends", "engine_core", "llmgw_bench"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist")], check=True, cwd=src)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {f"engine_core/cpu/csrc/{p.name}" for p in (ROOT / "engine_core" / "cpu" / "csrc").iterdir()}
    assert sources and {s for s in sources if s.endswith((".cpp", ".h"))} == sources
    assert sources <= names, sources - names
