"""Model sources on real files: GGUF of several architectures, sharded safetensors, the local Hugging Face cache."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine_core.loader import (
    ModelLoadError,
    cache_root,
    embedded_gguf_path,
    load_state_dict,
    load_tokenizer,
    resolve_model_dir,
)


@functools.cache
def reader(path: Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(path)  # 15 s for Gemma's 262,144-token vocabulary: once


def gguf_tensor(path: Path, name: str) -> torch.Tensor:
    """One tensor of a GGUF file dequantized by gguf-py, in the Hugging Face (rows, columns) order."""
    tensor = next(t for t in reader(path).tensors if t.name == name)
    return torch.from_numpy(np.array(gguf.dequantize(tensor.data, tensor.tensor_type)))


def gguf_chat_template(path: Path) -> str | None:
    field = reader(path).fields.get("tokenizer.chat_template")
    return None if field is None else str(field.contents())


def test_gemma3_gguf_converts_once_into_the_cache(gemma3_gguf: Path, gemma3_dir: Path) -> None:
    files = {file.name: file.stat().st_mtime_ns for file in gemma3_dir.iterdir()}
    assert resolve_model_dir(str(gemma3_gguf)) == gemma3_dir  # the same key: found, not converted again
    assert {file.name: file.stat().st_mtime_ns for file in gemma3_dir.iterdir()} == files
    assert gemma3_dir.parent == cache_root() and gemma3_dir.name.startswith("gemma-3-270m-q4_k_m-")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(files)

    cfg = json.loads((gemma3_dir / "config.json").read_text())
    # the engine's registry dispatches on `architectures`: transformers writes the text-only class itself
    assert (cfg["architectures"], cfg["model_type"]) == (["Gemma3ForCausalLM"], "gemma3_text")
    shape = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "intermediate_size", "vocab_size", "sliding_window", "query_pre_attn_scalar")
    assert [cfg[key] for key in shape] == [18, 640, 4, 1, 256, 2048, 262144, 512, 256]
    assert [i for i, kind in enumerate(cfg["layer_types"]) if kind == "full_attention"] == [5, 11, 17]
    assert cfg["rope_parameters"]["full_attention"]["rope_theta"] == 1e6
    assert cfg["rope_parameters"]["sliding_attention"]["rope_theta"] == 1e4
    assert cfg["tie_word_embeddings"] is True and cfg["hidden_activation"] == "gelu_pytorch_tanh"


def test_gemma3_weights_are_the_gguf_dequantized(gemma3_gguf: Path, gemma3_dir: Path) -> None:
    state = load_state_dict(gemma3_dir)
    assert "lm_head.weight" not in state and all(t.dtype == torch.float32 for t in state.values())
    assert len([name for name in state if name.startswith("model.layers.0.")]) == 13
    # the Q8_0 embedding as gguf-py dequantizes it; llama.cpp stores Gemma norms as 1 + w
    assert torch.equal(state["model.embed_tokens.weight"], gguf_tensor(gemma3_gguf, "token_embd.weight"))
    assert torch.equal(state["model.norm.weight"], gguf_tensor(gemma3_gguf, "output_norm.weight") - 1)
    assert torch.equal(state["model.layers.0.self_attn.q_norm.weight"],
                       gguf_tensor(gemma3_gguf, "blk.0.attn_q_norm.weight") - 1)


def test_gemma3_tokenizer_round_trips_and_has_no_chat_template(gemma3_gguf: Path, gemma3_dir: Path) -> None:
    tokenizer = load_tokenizer(gemma3_dir)
    assert tokenizer("Hello world, how are you?").input_ids == [2, 9259, 1902, 236764, 1217, 659, 611, 236881]
    text = "Gemma's tokenizer keeps  double spaces,\ttabs, 日本語 and émojis 🙂."
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id == 2 and tokenizer.decode(ids, skip_special_tokens=True) == text
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<eos>", "<pad>")
    # the pretrained base model's GGUF carries no `tokenizer.chat_template`, so the converted one has none
    assert gguf_chat_template(gemma3_gguf) is None
    assert tokenizer.chat_template is None and not (gemma3_dir / "chat_template.jinja").exists()


def test_embedded_smollm2_goes_through_the_same_gguf_path(smollm_dir: Path) -> None:
    gguf_file = embedded_gguf_path()
    template = gguf_chat_template(gguf_file)
    assert template and (smollm_dir / "chat_template.jinja").read_text() == template
    assert json.loads((smollm_dir / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    state = load_state_dict(smollm_dir)
    assert torch.equal(state["model.norm.weight"], gguf_tensor(gguf_file, "output_norm.weight"))
    # the kept blocks live in a folder of their own: vLLM and transformers load every top-level *.safetensors
    assert [p.name for p in smollm_dir.glob("*.safetensors")] == ["model.safetensors"]
    report = json.loads((smollm_dir / "gguf" / "report.json").read_text())
    assert report["model.embed_tokens.weight"] == "Q8_0" and report["model.layers.0.mlp.down_proj.weight"] == "Q4_1"
    kept = load_state_dict(smollm_dir, keep_quantized=True)
    assert kept["model.layers.0.mlp.down_proj.weight"].format == "Q4_1"  # type: ignore[union-attr]
    assert torch.equal(kept["model.layers.0.mlp.down_proj.weight"].dequantize(),  # type: ignore[union-attr]
                       state["model.layers.0.mlp.down_proj.weight"])


# a byte-level BPE vocabulary as llama.cpp writes one: the 256 byte symbols, a few merges, control tokens
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w"]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def write_tiny_gguf(path: Path, arch: str, seed: int = 0, head_dim: int = 16,
                    drop: str = "") -> dict[str, torch.Tensor]:
    """A random-weight `arch` model written as llama.cpp's converter does (tensor names, metadata, tokenizer,
    2-D weights in Q8_0); returns the tensors, by Hugging Face name, that a correct conversion yields."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values()) + [merge.replace(" ", "") for merge in MERGES] + SPECIAL
    config = AutoConfig.for_model(arch, vocab_size=len(tokens), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                                  max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny {arch}")
    writer.add_context_length(512)
    writer.add_embedding_length(64)
    writer.add_block_count(2)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIAL)) +
                           [gguf.TokenType.CONTROL] * len(SPECIAL))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_chat_template(TEMPLATE)
    arch_id = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    expected = {}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == drop:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        data = tensor.numpy()
        if data.ndim == 2:
            data = gguf.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            expected[hf_name] = torch.from_numpy(gguf.dequantize(data, gguf.GGMLQuantizationType.Q8_0))
            writer.add_tensor(f"{names.get_name(base)}.{suffix}", data, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            expected[hf_name] = tensor
            writer.add_tensor(f"{names.get_name(base)}.{suffix}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


# transformers reads no head_dim from a qwen3 GGUF (its `attention.key_length` is unmapped): Qwen3's 128 it is
@pytest.mark.parametrize("arch, architecture, head_dim", [("qwen2", "Qwen2ForCausalLM", 16),
                                                         ("qwen3", "Qwen3ForCausalLM", 128)])
def test_a_gguf_of_another_architecture_converts(arch: str, architecture: str, head_dim: int, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMGW_MODEL_CACHE", str(tmp_path / "cache"))
    path = tmp_path / f"tiny-{arch}.gguf"
    expected = write_tiny_gguf(path, arch, head_dim=head_dim)
    model_dir = resolve_model_dir(str(path))
    assert model_dir.parent == tmp_path / "cache" and model_dir.name.startswith(f"tiny-{arch}-")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [model_dir.name]  # no temporary directory left
    cfg = json.loads((model_dir / "config.json").read_text())
    assert (cfg["architectures"], cfg["model_type"], cfg["num_hidden_layers"], cfg["num_key_value_heads"]) == (
        [architecture], arch, 2, 2)
    state = load_state_dict(model_dir)
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[name], expected[name]) for name in expected)
    tokenizer = load_tokenizer(model_dir)
    assert len(tokenizer("hello").input_ids) == 1  # the merges are used
    assert tokenizer.decode(tokenizer("hello world, ça va?").input_ids) == "hello world, ça va?"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == (
        "<|im_start|>user\nhi<|im_end|>\n")


def test_a_gguf_that_does_not_fill_its_model_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers would leave random weights where a tensor is missing or of another shape."""
    monkeypatch.setenv("LLMGW_MODEL_CACHE", str(tmp_path / "cache"))
    write_tiny_gguf(tmp_path / "gap.gguf", "qwen2", drop="model.layers.1.post_attention_layernorm.weight")
    with pytest.raises(ModelLoadError, match=r"gap.gguf: transformers' model for this GGUF does not match its "
                                             r"tensors \(1, e.g. model.layers.1.post_attention_layernorm.weight\)"):
        resolve_model_dir(str(tmp_path / "gap.gguf"))
    write_tiny_gguf(tmp_path / "odd.gguf", "qwen3", head_dim=16)  # transformers builds head_dim 128
    with pytest.raises(ModelLoadError, match=r"odd.gguf: .* does not match its tensors \(12, e.g. "
                                             r"model.layers.0.self_attn.k_norm.weight \(16,\) vs \(128,\)"):
        resolve_model_dir(str(tmp_path / "odd.gguf"))
    assert not list(tmp_path.glob("cache/*"))  # nothing saved, no temporary directory left


def test_a_changed_gguf_is_converted_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMGW_MODEL_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "qwen2", seed=0)
    first = resolve_model_dir(str(path))
    stat = path.stat()
    expected = write_tiny_gguf(path, "qwen2", seed=1)  # same size; the same mtime too: only the bytes differ
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size
    second = resolve_model_dir(str(path))
    assert second != first and torch.equal(load_state_dict(second)["lm_head.weight"], expected["lm_head.weight"])


def test_broken_gguf_and_other_files_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMGW_MODEL_CACHE", str(tmp_path / "cache"))
    (tmp_path / "model.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match=r"model.bin: neither a directory .* nor a .gguf file"):
        resolve_model_dir(str(tmp_path / "model.bin"))
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    with pytest.raises(ModelLoadError, match=r"broken.gguf: cannot convert this GGUF with transformers"):
        resolve_model_dir(str(tmp_path / "broken.gguf"))
    assert not any((tmp_path / "cache").glob("*/config.json"))
    with pytest.raises(ModelLoadError, match=r"missing.gguf: no such directory or .gguf file"):
        resolve_model_dir("some/missing.gguf")


def save_tiny_llama(dest: Path, **save_options: str) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(dest, **save_options)
    return dest


def test_sharded_checkpoint_loads_the_files_its_index_names(tmp_path: Path) -> None:
    single = save_tiny_llama(tmp_path / "single")
    sharded = save_tiny_llama(tmp_path / "sharded", max_shard_size="50KB")
    shards = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"].values()
    assert len(set(shards)) > 2
    from safetensors.torch import save_file

    save_file({"stray": torch.zeros(1)}, sharded / "stale-copy.safetensors")  # not in the index: not loaded
    expected, state = load_state_dict(single), load_state_dict(sharded)
    assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in expected)

    missing = sorted(set(shards))[1]
    (sharded / missing).unlink()
    with pytest.raises(ModelLoadError, match=rf"index.json: names shards that are missing: {missing}"):
        load_state_dict(sharded)


def cache_snapshot(hub_cache: Path, repo_id: str, model_dir: Path) -> Path:
    """Lay `model_dir` out in a Hugging Face cache as huggingface_hub does: blobs by hash, a snapshot of
    symlinks to them, and refs/main naming the snapshot's commit."""
    repo = hub_cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for file in model_dir.iterdir():
        blob = hashlib.sha256(file.read_bytes()).hexdigest()
        (repo / "blobs" / blob).write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_hub_id_resolves_from_the_local_cache_only(tmp_path: Path) -> None:
    snapshot = cache_snapshot(tmp_path / "hub", "testorg/tiny-llama", save_tiny_llama(tmp_path / "model"))
    code = """if True:
        import json
        from engine_core.loader import ModelLoadError, resolve_model_dir
        from engine_core.models.registry import load_model_args
        found = resolve_model_dir("testorg/tiny-llama")
        try:
            resolve_model_dir("testorg/not-cached")
        except ModelLoadError as exc:
            missing = str(exc)
        print(json.dumps([str(found), load_model_args(found).num_layers, missing]))
    """
    # huggingface_hub reads its cache location and offline switch when imported: a process of its own
    env = {**os.environ, "HF_HOME": str(tmp_path / "home"), "HF_HUB_CACHE": str(tmp_path / "hub"),
           "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    found, layers, missing = json.loads(out.stdout)
    assert (Path(found), layers) == (snapshot, 2)
    assert missing.startswith(f"model 'testorg/not-cached' is not in the local Hugging Face cache ({tmp_path}/hub)")
    assert "hf download testorg/not-cached" in missing
