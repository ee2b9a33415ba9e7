"""Every command and config the README and the docs show is exercised, so the docs cannot rot silently.

- TOML blocks pass `llmgw check-config` (a block without `[models...]` is a fragment: it is laid over the
  shipped config.toml first, as a user would paste it into theirs).
- Shell blocks that talk to a gateway (`localhost:8080`) run as bash scripts against a real one serving the
  embedded model, with curl failing on any HTTP error; the others are checked command by command: `llmgw` lines
  against the CLI's own parser (`check-config` runs), `make` targets against the Makefile, scripts against their
  `--help`, `vllm serve` flags against vLLM's own parser. Upstream servers this machine cannot run
  (trtllm-serve, TGI, Triton, a container engine's `run`) are listed in NOT_RUN with what covers them instead.
- Python blocks run against that gateway with the real `openai`, `anthropic` and `huggingface_hub` clients.
- YAML and JSON blocks parse.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomlkit
import yaml

from gateway.cli import main as cli_main
from gateway.cli.commands import build_parser
from llmgw_bench.cli import build_compare_parser
from llmgw_bench.cli import build_parser as build_bench_parser
from tests.server import CLIENT_TIMEOUT, ROOT, running_gateway

DOC_FILES = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
GATEWAY_ADDRESSES = ("localhost:8080", "127.0.0.1:8080")
ADMIN_KEY = "docs-test-admin-key"

# Commands the docs show that this machine cannot run, and what checks them instead.
NOT_RUN = {
    "trtllm-serve": "TensorRT-LLM needs an NVIDIA GPU; its wire quirks are tested against recorded answers "
                    "(tests/test_remote_backends*.py)",
    "text-generation-launcher": "TGI needs its own image; the tgi backend is tested against TGI's protocol",
    "tritonserver": "Triton needs its own image; the triton backend is tested against its generate extension",
    "docker": "no Docker daemon here; tests/test_image.py runs the image the same way with podman",
    "podman": "tests/test_image.py builds and runs the image with podman, --read-only, as shown",
    "helm": "no cluster here; tests/test_helm_chart.py renders the chart with Helm's own library, values as shown",
}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    text: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def code_blocks(path: Path) -> list[Block]:
    text = path.read_text()
    if path.name == "benchmarks.md":  # a dated log of what ran: only its headline table is current
        text = text[: text.index("\n## History")]
    return [Block(path, text.count("\n", 0, match.start()) + 1, match.group(1), match.group(2))
            for match in re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```", text, re.S | re.M)]


BLOCKS = [block for path in DOC_FILES for block in code_blocks(path)]


def blocks_of(*langs: str) -> list[Block]:
    return [block for block in BLOCKS if block.lang in langs]


def live(block: Block) -> bool:
    """A block of requests to a gateway (curl lines): it runs. `llmgw bench` blocks are checked, not run (their
    loads take minutes; tests/test_bench.py runs the tool)."""
    return any(address in block.text for address in GATEWAY_ADDRESSES) and re.search(r"^curl ", block.text, re.M)


def test_every_code_block_has_a_language_the_checks_know() -> None:
    unknown = [(block.id, block.lang) for block in BLOCKS
               if block.lang not in {"toml", "sh", "python", "yaml", "json", "text", "mermaid"}]
    assert not unknown, "a block the docs tests would not check (give it one of the known languages)"


# --- configs -----------------------------------------------------------------------------------------------

def merged(base: dict, fragment: dict) -> dict:
    out = dict(base)
    for key, value in fragment.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def env_names(value: object) -> list[tuple[str, str]]:
    """(key, variable) for every `*_env` key: the variables a config reads its secrets from."""
    if isinstance(value, dict):
        return [pair for key, item in value.items()
                for pair in ([(key, item)] if key.endswith("_env") and isinstance(item, str) else env_names(item))]
    if isinstance(value, list):
        return [pair for item in value for pair in env_names(item)]
    return []


@pytest.mark.parametrize("block", blocks_of("toml"), ids=lambda b: b.id)
def test_config_snippet_passes_check_config(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    snippet = tomllib.loads(block.text)
    config = snippet if "models" in snippet else merged(tomllib.loads((ROOT / "config.toml").read_text()), snippet)
    for key, variable in env_names(config):
        monkeypatch.setenv(variable, {"database_env": f"sqlite:///{tmp_path}/state.db",
                                      "redis_env": "redis://127.0.0.1:6379/0"}.get(key, "docs-test-secret"))
    path = tmp_path / "config.toml"
    path.write_text(tomlkit.dumps(config))
    assert cli_main(["check-config", str(path)]) == 0
    assert "model " in capsys.readouterr().out


# --- shell: commands checked without a gateway ----------------------------------------------------------------

def commands(script: str) -> list[str]:
    """The script's commands: continuation lines joined, `;` and `&&` split, comments and heredoc bodies dropped,
    `$(...)` replaced by a word."""
    out: list[str] = []
    lines = iter(script.replace("\\\n", " ").splitlines())
    for line in lines:
        heredoc = re.search(r"<<\s*'?(\w+)'?", line)
        if heredoc:
            for body in lines:
                if body.strip() == heredoc.group(1):
                    break
        lexer = shlex.shlex(re.sub(r"\$\([^)]*\)", "1", line), posix=True, punctuation_chars=";&")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words: list[str] = []
        for word in [*lexer, ";"]:
            if word in {";", "&&"}:
                if words:
                    out.append(shlex.join(words))
                words = []
            else:
                words.append(word)
    return out


def make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))


def script_help(script: str) -> str:
    result = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def check_vllm_flags(args: list[str]) -> None:
    python = os.environ.get("LLMGW_VLLM_PYTHON")
    if not python:
        pytest.skip("no vLLM venv (LLMGW_VLLM_PYTHON): `make test` sets it")
    code = ("import sys\n"  # vLLM's own `vllm serve` parser, as its CLI builds it, without running the server
            "from vllm.entrypoints.cli.serve import cmd_init\n"
            "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
            "parser = FlexibleArgumentParser(prog='vllm')\n"
            "subparsers = parser.add_subparsers(dest='subparser')\n"
            "for command in cmd_init():\n"
            "    command.subparser_init(subparsers)\n"
            "parser.parse_args(['serve', *sys.argv[1:]])\n")
    result = subprocess.run([python, "-c", code, *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"vLLM refuses `vllm serve {' '.join(args)}`: {result.stderr[-2000:]}"


def check_command(command: str, tmp_path: Path) -> None:
    words = shlex.split(command)
    while words and re.fullmatch(r"\w+=\S*", words[0]):  # VAR=value prefixes
        words = words[1:]
    if not words:
        return
    program, args = Path(words[0]).name, words[1:]
    if program in NOT_RUN:
        return
    if program == "make":
        targets = [a for a in args if "=" not in a and not a.startswith("-")]
        assert set(targets) <= make_targets(), f"`{command}`: no such make target"
    elif program == "llmgw":
        if args[0] == "check-config":
            assert cli_main(["check-config", str(ROOT / args[1])]) == 0
        elif args[:2] == ["bench", "compare"]:
            build_compare_parser().parse_args(args[2:])
        elif args[0] == "bench":
            build_bench_parser().parse_args(args[1:])
        else:
            build_parser().parse_args(args)
    elif program == "vllm":
        assert args[0] == "serve"
        check_vllm_flags(args[1:])
    elif program == "pip":
        for requirement in (a for a in args[1:] if not a.startswith("-")):
            importlib.metadata.version(re.split(r"[=<>]", requirement)[0])
    elif program.startswith("python"):
        if args[0] == "-c":
            result = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
            assert result.returncode == 0, result.stderr
        else:
            assert (ROOT / args[0]).is_file(), f"`{command}`: no such script"
            flags = [a.split("=")[0] for a in args[1:] if a.startswith("--")]
            usage = script_help(args[0]) if flags else ""  # a script without flags may have no --help either
            for flag in flags:
                assert flag in usage, f"`{command}`: {args[0]} has no {flag}"
    elif program.endswith(".sh"):
        assert (ROOT / words[0]).is_file(), f"`{command}`: no such script"
    elif program == "cat":
        pass  # a heredoc writing a file the next command reads
    else:
        pytest.fail(f"`{command}`: a command the docs tests do not know how to check (add it to check_command "
                    "or, with the reason, to NOT_RUN)")


@pytest.mark.parametrize("block", [b for b in blocks_of("sh") if not live(b)], ids=lambda b: b.id)
def test_shell_commands_are_real(block: Block, tmp_path: Path) -> None:
    for command in commands(block.text):
        check_command(command, tmp_path)


def test_benchmark_headline_commands_are_real(tmp_path: Path) -> None:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    table = text[: text.index("\n## History")]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "benchmarks/" in line]
    assert len(rows) >= 10, "the headline table lost its rows"
    for row in rows:
        command = re.findall(r"`([^`]*benchmarks/[^`]*)`", row)[-1]
        for part in command.split("; "):
            check_command(part, tmp_path)


@pytest.mark.parametrize("block", [b for b in blocks_of("yaml") if b.text.startswith("# values")],
                         ids=lambda b: b.id)
def test_helm_values_snippet_renders_a_config_that_passes_check_config(block: Block, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from tests.helm_chart import config_toml, render

    path = tmp_path / "config.toml"
    path.write_text(config_toml(render(yaml.safe_load(block.text))))
    assert cli_main(["check-config", str(path)]) == 0
    assert "model llama" in capsys.readouterr().out


def test_yaml_and_json_snippets_parse() -> None:
    for block in blocks_of("yaml"):
        assert list(yaml.safe_load_all(block.text)), block.id
    for block in blocks_of("json"):
        json.loads(block.text)


# --- against a real gateway -----------------------------------------------------------------------------------

def start_gateway(tmp: Path, state: bool) -> contextlib.AbstractContextManager[str]:
    """The shipped config.toml with an admin key; with `[state]` (stored keys, usage) when a block manages keys:
    a gateway with a state database asks every request for a key, so the other blocks get one without."""
    config = (ROOT / "config.toml").read_text().replace("[server]", '[server]\nadmin_key_env = "LLMGW_ADMIN_KEY"')
    return running_gateway(config + ("\n[state]\n" if state else ""), tmp, env={"LLMGW_ADMIN_KEY": ADMIN_KEY})


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with start_gateway(tmp_path_factory.mktemp("docs-gateway"), state=False) as url:
        yield url


@pytest.fixture(scope="module")
def state_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with start_gateway(tmp_path_factory.mktemp("docs-state-gateway"), state=True) as url:
        yield url


def needs_state(block: Block) -> bool:
    return "/admin/keys" in block.text or "llmgw keys" in block.text


def at(text: str, url: str) -> str:
    for address in GATEWAY_ADDRESSES:
        text = text.replace(f"http://{address}", url).replace(address, url.removeprefix("http://"))
    return text


# curl fails on an HTTP error; llmgw's admin commands go to the test gateway
PRELUDE = """set -euo pipefail
curl() { command curl --fail-with-body -sS --max-time %(timeout)d "$@"; echo; }
llmgw() { command llmgw "$@" --url %(url)s; }
"""


@pytest.mark.parametrize("block", [b for b in blocks_of("sh") if live(b)], ids=lambda b: b.id)
def test_shell_block_runs_against_a_gateway(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    gateway = request.getfixturevalue("state_gateway" if needs_state(block) else "gateway")
    script = PRELUDE % {"timeout": CLIENT_TIMEOUT, "url": gateway} + at(block.text, gateway)
    env = {**os.environ, "LLMGW_ADMIN_KEY": ADMIN_KEY,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=CLIENT_TIMEOUT * 5)
    assert result.returncode == 0, f"{block.id} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


@pytest.mark.parametrize("block", blocks_of("python"), ids=lambda b: b.id)
def test_python_example_runs_against_a_gateway(block: Block, gateway: str, tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-c", at(block.text, gateway)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=CLIENT_TIMEOUT * 5)
    assert result.returncode == 0, f"{block.id} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert result.stdout.strip(), f"{block.id} printed nothing"
