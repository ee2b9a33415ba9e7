"""The compiled LoRA delta kernel (`lora_delta_`) against a per-row torch reference, for both kinds of build,
and the engine's kernel path against its torch (mask) path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_core import EngineConfig, LLMEngine, SamplingParams
from tests.engine_helpers import random_prompts
from tests.kernel_helpers import ISAS, kernels_for
from tests.lora_helpers import make_adapter


def reference_delta(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                    rank: int, bounds: list[int]) -> torch.Tensor:
    """out + each row's own adapter delta, row by row and sub-module by sub-module, in fp32."""
    want = out.float().clone()
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        s = x[t].float() @ a[slot].float().t()
        for k in range(len(bounds) - 1):
            cols = slice(bounds[k], bounds[k + 1])
            want[t, cols] += s[k * rank:(k + 1) * rank] @ b[slot, k * rank:(k + 1) * rank, cols].float()
    return want


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "fan_in", "outs", "rank", "adapters"), [
    (1, 576, [576, 192, 192], 16, 1),  # fused q/k/v, one decode row
    (33, 1536, [576], 8, 4),  # down: more rows than a block, four adapters, some rows with none
    (9, 100, [70, 30], 5, 3),  # odd widths: the column tail
])
def test_lora_delta_matches_the_per_row_reference(isa: str, dtype: torch.dtype, rows: int, fan_in: int,
                                                  outs: list[int], rank: int, adapters: int) -> None:
    kernels = kernels_for(isa)
    torch.manual_seed(rows)
    bounds = [sum(outs[:k]) for k in range(len(outs) + 1)]
    x = torch.randn(rows, fan_in).to(dtype)
    a = (torch.randn(adapters, len(outs) * rank, fan_in) * 0.1).to(dtype)
    b = (torch.randn(adapters, len(outs) * rank, sum(outs)) * 0.1).to(dtype)
    wide = torch.randn(rows, sum(outs) + 8).to(dtype)
    out = wide[:, 4:4 + sum(outs)]  # a view with a row stride wider than its width
    slots = torch.randint(-1, adapters, (rows,))
    slots[0] = 0
    want = reference_delta(out, x, a, b, slots, rank, bounds)
    untouched = wide[:, :4].clone(), wide[:, 4 + sum(outs):].clone()
    kernels.lora_delta_(out, x, a, b, slots, rank, bounds)
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    else:  # one bf16 rounding of the sum
        torch.testing.assert_close(out.float(), want, rtol=2 ** -7, atol=2e-2)
    assert torch.equal(wide[:, :4], untouched[0]) and torch.equal(wide[:, 4 + sum(outs):], untouched[1])
    for t in (slots < 0).nonzero().flatten().tolist():
        assert torch.equal(out[t].float(), want[t])  # rows without an adapter are left as they were


@pytest.mark.parametrize("isa", ISAS)
def test_lora_delta_refuses_bad_arguments(isa: str) -> None:
    kernels = kernels_for(isa)
    x, a, b = torch.randn(2, 8), torch.randn(1, 4, 8), torch.randn(1, 4, 6)
    out = torch.zeros(2, 6)
    with pytest.raises(RuntimeError, match="slot 3"):
        kernels.lora_delta_(out, x, a, b, torch.tensor([0, 3]), 2, [0, 3, 6])
    with pytest.raises(RuntimeError, match="4 rank rows, not 3 x 2"):
        kernels.lora_delta_(out, x, a, b, torch.tensor([0, 0]), 2, [0, 2, 4, 6])
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernels.lora_delta_(out, x.bfloat16(), a, b, torch.tensor([0, 0]), 2, [0, 3, 6])


def test_the_engine_kernel_path_gives_the_mask_path_tokens(smollm_dir: Path, tmp_path: Path) -> None:
    adapters = {"one": make_adapter(smollm_dir, tmp_path / "one", seed=11, rank=8),
                "two": make_adapter(smollm_dir, tmp_path / "two", seed=12, rank=4,
                                    target_modules=["q_proj", "v_proj", "down_proj"])}
    config = EngineConfig(model=str(smollm_dir), dtype="float32", num_blocks=128, max_num_batched_tokens=64,
                          max_num_seqs=8, lora_adapters={n: str(p) for n, p in adapters.items()})
    with_kernel, with_mask = LLMEngine(config), LLMEngine(config)
    if with_kernel.loras.kernel is None:
        pytest.skip("no compiled kernels here (no C++ compiler): the mask path is the only one")
    with_mask.loras.kernel = None
    prompts = random_prompts(5, [12, 30], with_kernel.model_args.vocab_size, seed=8)
    params = [SamplingParams(max_new_tokens=8, ignore_eos=True, adapter=n) for n in ("one", "two", None, "two", "one")]
    got = [[o.token_id for o in r] for r in with_kernel.generate(prompts, params)]
    want = [[o.token_id for o in r] for r in with_mask.generate(prompts, params)]
    assert got == want
    with_kernel.add_request("probe", prompts[0], SamplingParams(max_new_tokens=2, adapter="two"))
    batch = with_kernel.scheduler.schedule()
    prepared = with_kernel.runner.prepare(batch)
    assert prepared.lora is not None and prepared.lora.kernel is not None  # the kernel serves such steps
    with_kernel.postprocess(batch, *with_kernel.runner.run(batch))
    while with_kernel.has_unfinished():
        with_kernel.step()
    assert with_kernel.block_manager.check_all_free() and with_mask.block_manager.check_all_free()
