"""A GGUF's quantized tensors kept in their own formats: decoded once, at conversion, into the engine's codes +
scales layout (`engine_core/models/layers/quant.py`), next to the dequantized checkpoint the conversion writes.

Formats with a kernel: Q8_0, Q4_0, Q4_1, Q5_0 (groups of 32), Q4_K (super-blocks of 256 with a 6-bit scale and
min per 32) and Q6_K (a scale per 16). Each maps exactly: the codes are the file's, the scales and mins are the
fp32 products the format defines (Q4_0's q with min -8d, Q4_K's d*sc and -dmin*m). Every kept tensor is checked
against transformers' own dequantization of the same tensor (the checkpoint beside it, after its row
permutations): a tensor that does not match is dequantized, never served wrong. Others (F16, BF16, Q5_K, ...)
are served from the dequantized checkpoint in the dtype, and `gguf/report.json` says which and why (the start
log prints it).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine_core.models.layers.quant import QuantizedTensor, pack_int4

log = logging.getLogger(__name__)

# in a folder of their own: vLLM and transformers load every top-level *.safetensors of a model directory
BLOCKS_FILE = "gguf/blocks.safetensors"
REPORT_FILE = "gguf/report.json"


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _groups(scales: np.ndarray, mins: np.ndarray | None, codes: np.ndarray, bits: int, group: int,
            fmt: str) -> QuantizedTensor:
    rows = codes.shape[0]
    packed = pack_int4(torch.from_numpy(codes.reshape(rows, -1))) if bits == 4 else \
        torch.from_numpy(codes.reshape(rows, -1).astype(np.int8))
    return QuantizedTensor(packed.contiguous(), torch.from_numpy(scales.reshape(rows, -1).astype(np.float32)),
                           None if mins is None else torch.from_numpy(mins.reshape(rows, -1).astype(np.float32)),
                           bits, group, fmt)


def _q8_0(b: np.ndarray) -> QuantizedTensor:
    return _groups(_f16(b, 0), None, b[..., 2:34].view(np.int8), 8, 32, "Q8_0")


def _q4_0(b: np.ndarray) -> QuantizedTensor:
    d = _f16(b, 0)
    return _groups(d, -8 * d, _nibbles(b[..., 2:18]), 4, 32, "Q4_0")


def _q4_1(b: np.ndarray) -> QuantizedTensor:
    return _groups(_f16(b, 0), _f16(b, 2), _nibbles(b[..., 4:20]), 4, 32, "Q4_1")


def _q5_0(b: np.ndarray) -> QuantizedTensor:
    qh = b[..., 2:6].copy().view(np.uint32)  # bit j: the fifth bit of code j
    fifth = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    q = _nibbles(b[..., 6:22]) | (fifth << 4)
    return _groups(_f16(b, 0), None, q.astype(np.int16) - 16, 8, 32, "Q5_0")


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes → [..., 32] codes: byte j holds code j (low) and code j + 16 (high)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _q4_k(b: np.ndarray) -> QuantizedTensor:
    d, dmin = _f16(b, 0), _f16(b, 2)
    s = b[..., 4:16].astype(np.uint8)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    qs = b[..., 16:144].reshape(*b.shape[:-1], 4, 32)  # 4 chunks of 64 values: low nibbles, then high
    q = np.stack([qs & 15, qs >> 4], axis=-2).reshape(*b.shape[:-1], 8, 32)  # the 8 sub-blocks of 32, in order
    return _groups(d[..., None] * sc, -(dmin[..., None] * m), q, 4, 32, "Q4_K")


def _q6_k(b: np.ndarray) -> QuantizedTensor:
    ql, qh = b[..., 0:128].astype(np.int16), b[..., 128:192].astype(np.int16)
    sc = b[..., 192:208].view(np.int8).astype(np.float32)
    d = _f16(b, 208)
    halves = []
    for n in range(2):
        low, high = ql[..., 64 * n:64 * n + 64], qh[..., 32 * n:32 * n + 32]
        halves += [(low[..., :32] & 15) | ((high & 3) << 4), (low[..., 32:] & 15) | (((high >> 2) & 3) << 4),
                   (low[..., :32] >> 4) | (((high >> 4) & 3) << 4), (low[..., 32:] >> 4) | (((high >> 6) & 3) << 4)]
    q = np.concatenate(halves, axis=-1) - 32
    return _groups(d[..., None] * sc, None, q, 8, 16, "Q6_K")


DECODERS = {"Q8_0": (_q8_0, 34), "Q4_0": (_q4_0, 18), "Q4_1": (_q4_1, 20), "Q5_0": (_q5_0, 22),
            "Q4_K": (_q4_k, 144), "Q6_K": (_q6_k, 210)}


def decode(raw: np.ndarray, type_name: str) -> QuantizedTensor:
    """A GGUF tensor's raw bytes, [rows, bytes per row], in the engine's layout."""
    decoder, block_bytes = DECODERS[type_name]
    return decoder(raw.reshape(raw.shape[0], -1, block_bytes))


def write_blocks(gguf: Path, model: Any, dest: Path) -> dict[str, str]:
    """Decode the kept tensors of `gguf` for the transformers `model` converted from it into `dest`; returns
    (and writes) the report: each matmul weight's format, or why it is dequantized."""
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    reader = GGUFReader(gguf)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)
    reference = model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, dict[str, Any]] = {}
    report: dict[str, str] = {}
    for tensor in reader.tensors:
        hf_name = names.get(tensor.name)
        if hf_name is None or len(tensor.shape) != 2:
            continue
        kind = tensor.tensor_type.name
        if kind not in DECODERS:
            report[hf_name] = f"{kind}: dequantized (no kernel for this format)"
            continue
        rows = int(tensor.data.shape[0])
        order = processor.process(weights=np.arange(rows).reshape(rows, 1), name=tensor.name,
                                  tensor_key_mapping=names, parsed_parameters={"config": {}}).weights
        order = torch.from_numpy(np.ascontiguousarray(order[:, 0]))
        quantized = decode(np.asarray(tensor.data), kind).select_rows(order)
        expected = reference[hf_name].float()
        got = quantized.dequantize()
        if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-6, atol=1e-7):
            report[hf_name] = f"{kind}: dequantized (its decoding did not match transformers' values)"
            continue
        report[hf_name] = kind
        tensors[hf_name + ".codes"] = quantized.codes
        tensors[hf_name + ".scales"] = quantized.scales
        if quantized.mins is not None:
            tensors[hf_name + ".mins"] = quantized.mins
        meta[hf_name] = {"bits": quantized.bits, "group": quantized.group, "format": kind}
    (dest / BLOCKS_FILE).parent.mkdir(exist_ok=True)
    save_file(tensors, str(dest / BLOCKS_FILE), metadata={"tensors": json.dumps(meta)})
    (dest / REPORT_FILE).write_text(json.dumps(report, indent=1, sort_keys=True))
    return report


def load_blocks(model_dir: Path) -> dict[str, QuantizedTensor]:
    """The kept tensors by their checkpoint names ({} for a model converted without them)."""
    path = model_dir / BLOCKS_FILE
    if not path.is_file():
        return {}
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as file:
        meta = json.loads(file.metadata()["tensors"])
        keys = set(file.keys())
        return {name: QuantizedTensor(file.get_tensor(name + ".codes"), file.get_tensor(name + ".scales"),
                                      file.get_tensor(name + ".mins") if name + ".mins" in keys else None,
                                      m["bits"], m["group"], m["format"]) for name, m in meta.items()}


def describe(model_dir: Path) -> str:
    """For the start log: how many tensors are kept in which format, and each dequantized one with why."""
    path = model_dir / REPORT_FILE
    if not path.is_file():
        return ""
    report: dict[str, str] = json.loads(path.read_text())
    kept: dict[str, int] = {}
    for fmt in report.values():
        if ":" not in fmt:
            kept[fmt] = kept.get(fmt, 0) + 1
    dequantized = [f"{name} ({why})" for name, why in sorted(report.items()) if ":" in why]
    text = "kept quantized: " + (", ".join(f"{n} {fmt}" for fmt, n in sorted(kept.items())) or "none")
    return text + (f"; dequantized: {'; '.join(dequantized)}" if dequantized else "")
