"""Checkpoints already in 4 bits (GPTQ or AWQ int4, `quantization_config` in config.json, as hub repos ship
them) packed into ONNX Runtime's MatMulNBits as they are: the checkpoint's integers, zero points and scales
become the graph's, never dequantized and quantized again (which would add a second rounding).

The exporter needs float weights to write the graph's structure (and the layers the checkpoint keeps in
float: embeddings, norms, usually the lm_head), so it runs over a dequantized copy (`dequantized_checkpoint`);
`pack_graph` then replaces each 4-bit layer's MatMul weight with the checkpoint's own blocks. That copy is
also the reference the quality measurement compares the packed graph with.

Layouts (4 bits, group size g, K inputs, N outputs; W[k, n] = scale[k // g, n] * (q[k, n] - zero[k // g, n])):
- GPTQ (AutoGPTQ / transformers, checkpoint_format "gptq"): qweight int32 [K/8, N], element k in bits
  4*(k%8) of row k//8; qzeros int32 [G, N/8], element n in bits 4*(n%8), stored minus one; scales [G, N];
  g_idx [K] must be k // g (desc_act reorders rows: refused).
- AWQ (AutoAWQ GEMM, version "gemm"): qweight int32 [K, N/8] and qzeros int32 [G, N/8], the 8 columns of a
  word in the order 0, 2, 4, 6, 1, 3, 5, 7; zeros stored as they are; scales [G, N].
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

from manifests.errors import ModelError
from manifests.quantization import BLOCK_SIZES, Quantization

#: quant_method values this tool refuses, and what a user can do instead
OTHER_FORMATS = {
    "fp8": "FP8 weights",
    "compressed-tensors": "compressed-tensors (llm-compressor) weights",
    "modelopt": "NVIDIA ModelOpt (FP8/NVFP4) weights",
    "nvfp4": "NVFP4 weights",
    "bitsandbytes": "bitsandbytes weights",
    "hqq": "HQQ weights",
    "eetq": "EETQ weights",
    "exl2": "ExLlamaV2 weights",
    "aqlm": "AQLM weights",
    "quanto": "optimum-quanto weights",
    "torchao": "torchao weights",
    "mxfp4": "MXFP4 weights",
}
_AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])
#: the batched graph's packed MatMuls (bundler.onnx.inplace `packed`): joined name -> its projections
_JOINED = {"q_proj_k_proj_v_proj": ("q_proj", "k_proj", "v_proj"), "gate_proj_up_proj": ("gate_proj", "up_proj")}


@dataclass(frozen=True)
class PackedFormat:
    """A checkpoint's 4-bit format, from its quantization_config."""

    method: str  # "gptq" | "awq"
    bits: int
    group_size: int
    symmetric: bool


def _instead() -> str:
    return ("this version packs GPTQ or AWQ int4 checkpoints as they are, and quantizes float checkpoints itself: "
            "use the model's float (fp16/bf16) checkpoint with --quantization int4, or a GPTQ/AWQ int4 export of it")


def checkpoint_format(config: Mapping, where: str = "model") -> PackedFormat | None:
    """The 4-bit format of a checkpoint (None: float weights); ModelError naming any other format."""
    q = config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, Mapping):
        raise ModelError(f"{where}: expected quantization_config to be an object, found {q!r}"[:200])
    method = str(q.get("quant_method", "")).lower()
    if method in OTHER_FORMATS or method not in ("gptq", "awq"):
        what = OTHER_FORMATS.get(method, f"quant_method {method!r}")
        raise ModelError(f"{where}: the checkpoint holds {what} (quantization_config); {_instead()}")
    bits = q.get("bits", q.get("w_bit"))
    group = q.get("group_size", q.get("q_group_size"))
    if bits != 4:
        raise ModelError(f"{where}: expected a 4-bit {method.upper()} checkpoint, found bits {bits!r}; {_instead()}")
    if group not in BLOCK_SIZES:
        raise ModelError(f"{where}: expected a {method.upper()} group_size in {', '.join(map(str, BLOCK_SIZES))} "
                         f"(MatMulNBits blocks), found {group!r}; {_instead()}")
    if method == "gptq":
        if q.get("desc_act"):
            raise ModelError(f"{where}: GPTQ with desc_act (act-order) reorders each layer's rows, which MatMulNBits "
                             f"blocks cannot hold as they are; expected desc_act false; {_instead()}")
        if str(q.get("checkpoint_format", "gptq")).lower() != "gptq":
            raise ModelError(f"{where}: expected GPTQ checkpoint_format 'gptq', found "
                             f"{q.get('checkpoint_format')!r}; {_instead()}")
        return PackedFormat("gptq", 4, int(group), bool(q.get("sym", True)))
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        raise ModelError(f"{where}: expected an AWQ 'gemm' checkpoint, found version {version!r}; {_instead()}")
    return PackedFormat("awq", 4, int(group), not q.get("zero_point", True))


def _nibbles(words: np.ndarray, axis: int) -> np.ndarray:
    """int32 words -> their 8 4-bit values (low bits first), the new values along `axis` (0 or 1)."""
    u = words.astype(np.uint32)
    parts = np.stack([(u >> np.uint32(4 * i)) & np.uint32(0xF) for i in range(8)], axis=axis + 1)
    shape = list(words.shape)
    shape[axis] *= 8
    return parts.reshape(shape).astype(np.uint8)


def read_linear(get, prefix: str, fmt: PackedFormat) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q [K, N] uint8, zeros [G, N] uint8, scales [G, N] float32) of one 4-bit linear layer `prefix`."""
    qweight, qzeros = get(prefix + ".qweight"), get(prefix + ".qzeros")
    scales = get(prefix + ".scales").astype(np.float32)
    if fmt.method == "gptq":
        q = _nibbles(qweight, 0)
        zeros = (_nibbles(qzeros, 1).astype(np.int32) + 1) & 0xF
        g_idx = get(prefix + ".g_idx", None)
        if g_idx is not None and not np.array_equal(g_idx, np.arange(q.shape[0]) // fmt.group_size):
            raise ModelError(f"{prefix}: expected g_idx k // {fmt.group_size} (no act-order), found a reordering")
    else:
        def awq(words):
            v = _nibbles(words, 1)
            n = v.shape[1]
            cols = (np.arange(n) // 8) * 8 + _AWQ_ORDER[np.arange(n) % 8]
            out = np.empty_like(v)
            out[:, cols] = v
            return out
        q, zeros = awq(qweight), awq(qzeros)
    zeros = zeros.astype(np.uint8)
    k, n = q.shape
    if scales.shape != (k // fmt.group_size, n) or zeros.shape != scales.shape:
        raise ModelError(f"{prefix}: expected scales and zeros [{k // fmt.group_size}, {n}] for {k}x{n} weights in "
                         f"groups of {fmt.group_size}, found {list(scales.shape)} and {list(zeros.shape)}")
    return q, zeros, scales


def dequantize(q: np.ndarray, zeros: np.ndarray, scales: np.ndarray, group: int) -> np.ndarray:
    """W [K, N] float32 = scale * (q - zero), group by group along K."""
    g = np.arange(q.shape[0]) // group
    return (q.astype(np.float32) - zeros[g].astype(np.float32)) * scales[g]


class _Reader:
    def __init__(self, checkpoint: Path):
        from safetensors import safe_open

        self._files = [safe_open(str(p), framework="np") for p in sorted(Path(checkpoint).glob("*.safetensors"))]
        if not self._files:
            raise ModelError(f"{checkpoint}: expected model weights in *.safetensors, found none")
        self.where = {k: f for f in self._files for k in f.keys()}

    def get(self, name: str, default=...):
        if name not in self.where:
            if default is not ...:
                return default
            raise ModelError(f"checkpoint has no tensor {name!r}; expected the {name.rsplit('.', 1)[-1]} of a "
                             f"4-bit layer")
        return self.where[name].get_tensor(name)


def dequantized_checkpoint(checkpoint: Path, out: Path, fmt: PackedFormat) -> Path:
    """A float32 copy of a 4-bit checkpoint in `out` (config without quantization_config, each 4-bit layer's
    `.weight` dequantized, every other tensor and file as it was): what the exporter and the reference read."""
    from safetensors.numpy import save_file

    checkpoint, out = Path(checkpoint), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in checkpoint.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in ("config.json",
                                                                                  "model.safetensors.index.json"):
            shutil.copyfile(f, out / f.name)
    cfg = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    reader = _Reader(checkpoint)
    tensors = {}
    for name in reader.where:
        if name.endswith(".qweight"):
            prefix = name[:-len(".qweight")]
            q, zeros, scales = read_linear(reader.get, prefix, fmt)
            tensors[prefix + ".weight"] = np.ascontiguousarray(dequantize(q, zeros, scales, fmt.group_size).T)
        elif not name.endswith((".qzeros", ".scales", ".g_idx")):
            value = reader.get(name)
            tensors[name] = value.astype(np.float32) if value.dtype.kind == "f" else value
    save_file(tensors, str(out / "model.safetensors"))
    return out


def _blocks(q: np.ndarray, zeros: np.ndarray, scales: np.ndarray, block: int, dtype) -> tuple:
    """MatMulNBits' B [N, K/block, block/2], scales [N, K/block] and zero points [N, ceil(K/block / 2)]."""
    k, n = q.shape
    blocks = k // block
    qt = q.T.reshape(n, blocks, block // 2, 2)
    packed = (qt[..., 0] | (qt[..., 1] << 4)).astype(np.uint8)
    zt = zeros.T  # [N, blocks]
    if blocks % 2:
        zt = np.concatenate([zt, np.zeros((n, 1), np.uint8)], axis=1)
    zp = (zt[:, 0::2] | (zt[:, 1::2] << 4)).astype(np.uint8)
    return packed, np.ascontiguousarray(scales.T).astype(dtype), zp


def pack_graph(graph: Path, out: Path, checkpoint: Path, fmt: PackedFormat, dtype: str = "float32") -> Quantization:
    """Write `out` (+ `.data`): `graph` (exported from the dequantized copy) with every MatMul whose weight is a
    4-bit layer of `checkpoint` turned into MatMulNBits over the checkpoint's own integers and scales."""
    import onnx
    from onnx import helper, numpy_helper

    from bundler.onnx.quantize import lm_head_weight
    from bundler.onnx.writer import save_model

    np_dtype = {"float32": np.float32, "float16": np.float16}.get(dtype)
    if np_dtype is None:
        raise ModelError(f"a {fmt.method.upper()} checkpoint packs into float32 or float16 graphs, found {dtype}")
    reader = _Reader(Path(checkpoint))
    model = onnx.load(str(graph), load_external_data=True)
    inits = {t.name: t for t in model.graph.initializer}
    nodes, done = [], []
    for node in model.graph.node:
        prefixes = _prefixes(node.input[1], reader.where) if node.op_type == "MatMul" and len(node.input) == 2 \
            and node.input[1] in inits else None
        if not prefixes:
            nodes.append(node)
            continue
        parts = [_blocks(*read_linear(reader.get, p, fmt), fmt.group_size, np_dtype) for p in prefixes]
        packed, scales, zp = (np.concatenate([p[i] for p in parts], axis=0) for i in range(3))
        k = packed.shape[1] * fmt.group_size
        name = node.input[1]
        if list(inits[name].dims) != [k, packed.shape[0]]:
            raise ModelError(f"{graph}: {name} is {list(inits[name].dims)}, the checkpoint's 4-bit layers "
                             f"{prefixes} are {[k, packed.shape[0]]}")
        tensors = [numpy_helper.from_array(a, f"{name}_{suffix}")
                   for a, suffix in ((packed, "Q4"), (scales, "scales"), (zp, "zero_points"))]
        model.graph.initializer.extend(tensors)
        nodes.append(helper.make_node("MatMulNBits", [node.input[0], *(t.name for t in tensors)], list(node.output),
                                      name=(node.name or name) + "_Q4", domain="com.microsoft", K=k,
                                      N=int(packed.shape[0]), bits=4, block_size=fmt.group_size))
        done.append(name)
    if not done:
        raise ModelError(f"{checkpoint}: expected 4-bit layers (.qweight) matching the graph's MatMuls, found none")
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    keep = [t for t in model.graph.initializer if t.name not in set(done)]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    model.metadata_props.add(key="bundle.quantization", value=f"int4-{fmt.method}-b{fmt.group_size}-checkpoint")
    head = lm_head_weight(model)
    save_model(model, Path(out))
    return Quantization(method=fmt.method, bits=4, block_size=fmt.group_size, symmetric=fmt.symmetric,
                        layers=tuple(sorted(done)), kept=(head,) if head else (), source="checkpoint")


def _prefixes(initializer: str, tensors: Mapping) -> list[str] | None:
    """The checkpoint's 4-bit layers behind a graph MatMul weight ("X.weight", or a packed "X.q_proj_k_proj_v_proj.weight")."""
    if not initializer.endswith(".weight"):
        return None
    base = initializer[:-len(".weight")]
    if base + ".qweight" in tensors:
        return [base]
    head, _, joined = base.rpartition(".")
    names = _JOINED.get(joined)
    if names and all(f"{head}.{n}.qweight" in tensors for n in names):
        return [f"{head}.{n}" for n in names]
    return None
