"""Tiny random-weight checkpoints of every family the engine serves, made with transformers' own config
classes, each with its family's special fields switched on (sliding windows shorter than the prompts, soft-caps,
partial rotary with longrope, q/k-norm, experts), and SmolLM2's tokenizer and vocabulary."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

WINDOW = 24  # shorter than the test prompts, and not a multiple of the block size

COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.3, eos_token_id=2,
              bos_token_id=1, pad_token_id=0, tie_word_embeddings=False)

LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
            "short_factor": [1.0 + 0.1 * i for i in range(4)], "long_factor": [2.0 + 0.5 * i for i in range(4)]}

# family -> (transformers config class, model class, overrides of COMMON)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 500000.0})),
    "llama_linear": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters={
        "rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW, head_dim=16)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=WINDOW,
                                                      max_window_layers=1, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=4.0,
        final_logit_softcapping=5.0, num_hidden_layers=3, tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24, num_hidden_layers=6, tie_word_embeddings=True)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        partial_rotary_factor=0.5, rope_parameters=LONGROPE, original_max_position_embeddings=64)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        num_hidden_layers=3, mlp_only_layers=[1], intermediate_size=96)),
}


def build_family_model(family: str, dest: Path, tokenizer_dir: Path, **overrides: Any) -> Path:
    import transformers

    config_name, model_name, settings = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**COMMON, **settings, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():  # norms start at 1 (or 0 for Gemma's 1 + w): make them matter
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(dest)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, dest / name)
    return dest
