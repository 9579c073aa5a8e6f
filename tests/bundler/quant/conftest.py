"""A tiny random checkpoint, its float32 batched graph, and 4-bit checkpoints (GPTQ, AWQ) made from it here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.models import make_tiny_checkpoint

GROUP = 32
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="session")
def tiny_float(tmp_path_factory) -> tuple[Path, object]:
    """(checkpoint, its float32 batched ExportResult)."""
    from bundler.onnx.export import export_onnx

    root = tmp_path_factory.mktemp("quant-float")
    ckpt = make_tiny_checkpoint(root / "ckpt", seed=3)
    return ckpt, export_onnx(ckpt, root / "onnx", kv_cache="batched")


def rtn_ints(w_kn: np.ndarray, group: int = GROUP) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric 4-bit round to nearest per group along K: (q [K, N], zeros [G, N], scales [G, N] fp16)."""
    k, n = w_kn.shape
    g = w_kn.reshape(k // group, group, n)
    lo, hi = np.minimum(g.min(1), 0), np.maximum(g.max(1), 0)
    scales = ((hi - lo) / 15).astype(np.float16)
    s = np.where(scales == 0, 1, scales).astype(np.float32)
    zeros = np.clip(np.round(-lo / s), 0, 15).astype(np.uint8)
    q = np.clip(np.round(g / s[:, None, :]) + zeros[:, None, :], 0, 15).astype(np.uint8).reshape(k, n)
    return q, zeros, scales


def _words(values: np.ndarray, axis: int, order=None) -> np.ndarray:
    """8 4-bit values -> one int32 along `axis` (0: rows, 1: columns), low bits first, in `order`."""
    v = np.moveaxis(values.astype(np.uint32), axis, 0)
    v = v.reshape(v.shape[0] // 8, 8, *v.shape[1:])
    if order is not None:
        v = v[:, order]
    word = np.zeros((v.shape[0], *v.shape[2:]), np.uint32)
    for i in range(8):
        word |= v[:, i] << np.uint32(4 * i)
    return np.ascontiguousarray(np.moveaxis(word.view(np.int32), 0, axis))


def make_packed_checkpoint(src: Path, out: Path, method: str) -> tuple[Path, dict]:
    """`src` with every decoder linear layer in GPTQ or AWQ int4 layout (lm_head and embeddings float, as
    those tools leave them): (folder, {layer prefix: (q, zeros, scales)}) so a test knows the integers."""
    from safetensors.numpy import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copyfile(f, out / f.name)
    tensors = load_file(str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    ints, new = {}, {}
    for name, value in tensors.items():
        prefix = name[:-len(".weight")]
        if not any(prefix.endswith(s) for s in LINEARS):
            new[name] = value.astype(np.float16)
            continue
        q, zeros, scales = rtn_ints(value.T.astype(np.float32))
        ints[prefix] = (q, zeros, scales)
        if method == "gptq":
            new[prefix + ".qweight"] = _words(q, 0)
            new[prefix + ".qzeros"] = _words((zeros.astype(np.int32) - 1) & 0xF, 1)  # stored minus one
            new[prefix + ".g_idx"] = (np.arange(q.shape[0]) // GROUP).astype(np.int32)
        else:
            order = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # AutoAWQ: nibble i of a word holds column order[i]
            new[prefix + ".qweight"] = _words(q, 1, order)
            new[prefix + ".qzeros"] = _words(zeros, 1, order)
        new[prefix + ".scales"] = scales
    save_file({k: np.ascontiguousarray(v) for k, v in new.items()}, str(out / "model.safetensors"))
    cfg["torch_dtype"] = "float16"
    cfg["quantization_config"] = ({"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
                                   "sym": False, "checkpoint_format": "gptq"} if method == "gptq" else
                                  {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                                   "version": "gemm"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out, ints
