"""LoRA adapters made with `peft` on a base model directory, deterministically (fixed seeds, nonzero A and B)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_dir: Path, dest: Path, seed: int, rank: int = 8, alpha: int = 16,
                 target_modules: list[str] | None = None, scale: float = 1.0, **config: object) -> Path:
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) for `base_dir`.
    `init_lora_weights=False` gives random A and B (peft's default leaves B zero: a no-op adapter)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if (dest / "adapter_model.safetensors").exists():
        return dest
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora = LoraConfig(r=rank, lora_alpha=alpha, target_modules=target_modules or ALL_MODULES, lora_dropout=0.0,
                      init_lora_weights=False, task_type="CAUSAL_LM", **config)
    model = get_peft_model(base, lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.mul_(scale)
    model.save_pretrained(dest)
    return dest


def merged_model(base_dir: Path, adapter_dir: Path) -> torch.nn.Module:
    """peft's own merge of the adapter into the base weights, in fp32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()


def teacher_forced_argmax(model: torch.nn.Module, prompt: list[int], generated: list[int]) -> list[int]:
    """The model's greedy choice at each generated position, fed the engine's own tokens before it."""
    ids = torch.tensor([prompt + generated[:-1]])
    with torch.inference_mode():
        logits = model(ids).logits[0]
    return logits[len(prompt) - 1:].argmax(-1).tolist()


def edit_config(adapter_dir: Path, dest: Path, **changes: object) -> Path:
    """A copy of an adapter with its adapter_config.json changed."""
    dest.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    cfg.update(changes)
    (dest / "adapter_config.json").write_text(json.dumps(cfg))
    (dest / "adapter_model.safetensors").write_bytes((adapter_dir / "adapter_model.safetensors").read_bytes())
    return dest
