"""A sparse mixture-of-experts MLP (Qwen3-MoE, OLMoE-style routing): a router picks each token's top-k experts
by a softmax over all experts in fp32, optionally renormalized over the k (`norm_topk_prob`); each expert is a
SwiGLU MLP. Work is grouped by expert: one pass of matmuls per expert over all the step's tokens routed to it,
never a loop per token."""

from __future__ import annotations

import torch

from engine_core.models.args import ModelArgs
from engine_core.models.layers.layer_ops import TorchLayerOps
from engine_core.models.layers.linear import Linear, QuantLinear
from engine_core.models.layers.weights import Weights


class SparseMoE:
    def __init__(self, weights: Weights, prefix: str, args: ModelArgs) -> None:
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.router = Linear(weights.take(prefix + "gate.weight"))  # routing stays in the dtype
        experts = prefix + "experts."
        self.experts: list[tuple[Linear | QuantLinear, Linear | QuantLinear]] = []
        if weights.has(experts + "gate_up_proj"):  # transformers 5's stacked [E, 2I, H] and [E, H, I]
            gate_up, down = weights.take(experts + "gate_up_proj"), weights.take(experts + "down_proj")
            self.experts = [(weights.linear_of([weights.matrix(gate_up[e].contiguous())]),
                             weights.linear_of([weights.matrix(down[e].contiguous())]))
                            for e in range(args.num_experts)]
        else:  # one module per expert, as the published checkpoints store them
            self.experts = [(weights.linear(f"{experts}{e}.gate_proj", f"{experts}{e}.up_proj"),
                             weights.linear(f"{experts}{e}.down_proj")) for e in range(args.num_experts)]

    def __call__(self, x: torch.Tensor, ops: TorchLayerOps) -> torch.Tensor:
        probs = torch.softmax(self.router(x), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        # the (token, slot) pairs sorted by expert: each expert's rows are one contiguous run
        order = chosen.flatten().argsort(stable=True)
        counts = torch.bincount(chosen.flatten(), minlength=len(self.experts)).tolist()
        tokens = order // self.top_k
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            pairs, rows = order[start:start + count], tokens[start:start + count]
            start += count
            gate_up, down = self.experts[expert]
            y = down(ops.silu_and_mul(gate_up(x.index_select(0, rows))))
            out.index_add_(0, rows, y * weights.view(-1)[pairs].unsqueeze(1))
        return out
