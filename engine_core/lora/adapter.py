"""Load and validate a PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`) against
the base model, into the layout the batched delta uses.

The model fuses q/k/v and gate/up into one matmul each, so an adapter's weights are kept per fused
group: for each layer and group, `a` [in, n_sub * r] (the sub-modules' A stacked, transposed for
`x @ a`) and `b` [n_sub * r, out] block-diagonal (each sub-module's B, scaled, writes only its own
slice of the fused output). A group the adapter does not target is None and costs nothing.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine_core.models.args import ModelArgs, read_json_object

# the model's fused projections, in forward order, and the PEFT module names each one holds
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
# Phi-3's checkpoints (and so its PEFT adapters) hold q|k|v and gate|up as one module each
FUSED_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("qkv_proj",),
    "o": ("o_proj",),
    "gate_up": ("gate_up_proj",),
    "down": ("down_proj",),
}
FUSED_ARCHITECTURES = {"Phi3ForCausalLM"}
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
                  r"(?:\.[\w-]+)?\.weight$")
_uids = itertools.count(1)


class LoraError(ValueError):
    """An adapter that cannot be served on this base model; the message says why."""


def groups(args: ModelArgs) -> dict[str, tuple[str, ...]]:
    """The base model's adaptable groups: an MoE model's experts take no adapter, only its attention."""
    chosen = FUSED_GROUPS if args.architecture in FUSED_ARCHITECTURES else GROUPS
    return {g: m for g, m in chosen.items() if not args.num_experts or g in ("qkv", "o")}


def module_shapes(args: ModelArgs) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each adaptable module of the base model."""
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    h, i = args.hidden_size, args.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "qkv_proj": (h, q + 2 * kv),
              "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h), "gate_up_proj": (h, 2 * i)}
    adaptable = {m for modules in groups(args).values() for m in modules}
    return {m: shape for m, shape in shapes.items() if m in adaptable}


@dataclass(slots=True, eq=False)
class LoraAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    # (layer, group) -> (a [in, n_sub*r], b [n_sub*r, out]); absent: the group is not adapted in that layer
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    uid: int = field(default_factory=lambda: next(_uids))  # a fresh one per load: keys the prefix cache

    def groups(self) -> set[str]:
        return {group for _, group in self.weights}


def _config(directory: Path) -> dict:
    file = directory / "adapter_config.json"
    if not directory.is_dir():
        raise LoraError(f"{directory}: no such directory")
    return read_json_object(file, LoraError, "a PEFT adapter directory has adapter_config.json")


def _check_config(cfg: dict, where: Path, max_rank: int) -> tuple[int, float]:
    """The rank and scaling, after refusing what the engine does not implement."""
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise LoraError(f"{where}: peft_type {cfg.get('peft_type')!r} is not LORA")
    refused = [("use_dora", cfg.get("use_dora")), ("modules_to_save", cfg.get("modules_to_save")),
               ("rank_pattern", cfg.get("rank_pattern")), ("alpha_pattern", cfg.get("alpha_pattern")),
               ("fan_in_fan_out", cfg.get("fan_in_fan_out"))]
    for key, value in refused:
        if value:
            raise LoraError(f"{where}: {key} = {value!r} is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoraError(f"{where}: bias = {cfg.get('bias')!r} is not supported (only \"none\")")
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoraError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoraError(f"{where}: rank {rank} exceeds max_lora_rank {max_rank}")
    alpha = cfg.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise LoraError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def load_adapter(name: str, path: str | Path, args: ModelArgs, max_rank: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> LoraAdapter:
    """Read, validate and lay out an adapter; raises LoraError naming the file and the reason."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(path).expanduser()
    cfg = _config(directory)
    rank, scaling = _check_config(cfg, directory / "adapter_config.json", max_rank)
    file = directory / "adapter_model.safetensors"
    if not file.is_file():
        raise LoraError(f"{file}: missing (only safetensors adapter weights are supported)")
    try:
        state = load_file(file)
    except (SafetensorError, OSError) as exc:
        raise LoraError(f"{file}: cannot read weights: {exc}") from None
    shapes = module_shapes(args)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        match = _KEY.match(key)
        if match is None:
            raise LoraError(f"{file}: weight {key!r} is not a LoRA A/B of {', '.join(shapes)}")
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        if module not in shapes:
            raise LoraError(f"{file}: target module {module!r} is not supported on this base model (supported: "
                            f"{', '.join(shapes)})")
        if layer >= args.num_layers:
            raise LoraError(f"{file}: {key!r} is for layer {layer}; the base model has {args.num_layers}")
        fan_in, fan_out = shapes[module]
        want = (rank, fan_in) if which == "A" else (fan_out, rank)
        if tuple(tensor.shape) != want:
            raise LoraError(f"{file}: {key!r} has shape {list(tensor.shape)}, the base model needs {list(want)} "
                            f"(rank {rank}, {module} {fan_in} -> {fan_out})")
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        raise LoraError(f"{file}: no LoRA weights in it")
    for (layer, module), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoraError(f"{file}: layer {layer} {module} has lora_{''.join(ab)} but not both A and B")
    adapter = LoraAdapter(name, str(directory), rank, scaling, tuple(sorted({m for _, m in pairs})))
    for layer in range(args.num_layers):
        for group, modules in groups(args).items():
            present = [m for m in modules if (layer, m) in pairs]
            if not present:
                continue
            fan_in = shapes[modules[0]][0]
            outs = [shapes[m][1] for m in modules]
            a = torch.zeros(fan_in, len(modules) * rank)
            b = torch.zeros(len(modules) * rank, sum(outs))
            for j, module in enumerate(modules):
                if (layer, module) in pairs:
                    ab = pairs[(layer, module)]
                    a[:, j * rank:(j + 1) * rank] = ab["A"].float().t()
                    b[j * rank:(j + 1) * rank, sum(outs[:j]):sum(outs[:j + 1])] = ab["B"].float().t() * scaling
            adapter.weights[(layer, group)] = (a.to(device=device, dtype=dtype).contiguous(),
                                               b.to(device=device, dtype=dtype).contiguous())
    return adapter
