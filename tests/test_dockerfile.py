"""The container recipe, read as text (this machine has no Docker daemon to build it): the
properties the deployment issue asks of it, which a careless edit would break."""

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
    assert {"torch-cpu", "torch-cuda", "build", "runtime"} <= set(named)
    assert "ARG VARIANT=cpu" in INSTRUCTIONS
    assert named["build"][0].startswith("FROM torch-${VARIANT}")
    assert any("download.pytorch.org/whl/cpu" in line for line in named["torch-cpu"])
    assert any("whl/cu" in line for line in named["torch-cuda"])
    assert any("torch==2.13.0" in line for line in named["build"])  # torch first and pinned


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
    assert {".git", ".venv*", "tests", "bench-results"} <= set(ignored)


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
    sources = {f"engine_core/csrc/{p.name}" for p in (ROOT / "engine_core" / "csrc").iterdir()}
    assert sources and {s for s in sources if s.endswith((".cpp", ".h"))} == sources
    assert sources <= names, sources - names
