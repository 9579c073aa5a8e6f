"""4-bit weights: a pass over an exported ONNX graph that turns its MatMuls into MatMulNBits (build host).

The exporter writes the graph; this rewrites it with ONNX Runtime's maintained quantizer
(`onnxruntime.quantization.matmul_nbits_quantizer`, which needs `onnx-ir`: the [build] extra): every MatMul
whose weight is an initializer (q/k/v, o, gate/up, down, and the EAGLE-3 head's fc and layer) becomes
`com.microsoft.MatMulNBits` with block-wise 4-bit weights, fp16 or fp32 scales (the graph's dtype) and
uint8 zero points; activations stay in the graph's dtype. The lm_head (the MatMul that makes the logits) is
4-bit too unless `keep_lm_head` (manifests.quantization.LM_HEAD says why). Routed experts (com.microsoft MoE)
become com.microsoft QMoE with the same kind of blocks, asymmetric round-to-nearest whatever the method
(bundler.onnx.blocks.moe.quantize_experts; recorded as the record's "experts"); their routers are Gemms
and stay in the graph's dtype.

TensorRT has no MatMulNBits: the graphs it builds (the concat layout) get the standard form instead (`fmt` "qdq"):
each weight an INT4 initializer with per-block fp16/fp32 scales (symmetric, no zero point: TensorRT's weight-only
INT4 takes none) into a blocked `DequantizeLinear` (opset 21) before its MatMul, which TensorRT builds as
weight-only INT4 GEMMs and ONNX Runtime's CPU provider also runs (create's quality measurement).

The quantizer is deterministic: the same weights give the same bytes, so the `cuda` target's two graphs
(bundler.onnx.dual), quantized one after the other, still share one weights file.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from bundler.onnx.writer import save_model
from manifests.errors import EnvironmentProblem, ModelError, UsageError
from bundler.onnx.inplace import BATCHED_HEADROOM
from manifests.quantization import MATMULNBITS, OPERATORS, QDQ, QuantizeOptions, Quantization

log = logging.getLogger(__name__)

BITS = 4
#: INT4 tensors and DequantizeLinear's block_size: ONNX opset 21 (the concat graph is exported at 17)
QDQ_OPSET = 21
#: MatMulNBits accuracy_level per graph dtype: 0 (compute in the activations' type) everywhere. Level 4 (int8
#: activations) is faster on the CPU at one row, but ONNX Runtime 1.32's CPU kernel then gives a token's logits
#: 1e-2 apart whether it runs in a 12-token row or alone (1e-5 at level 0): verification rows and decode rows
#: would disagree, and greedy output with speculation would no longer equal greedy output without it
#: (tests/bundler/quant/test_quantize.py::test_logits_do_not_depend_on_how_tokens_are_batched).
ACCURACY_LEVEL = {"float32": 0, "float16": 0, "bfloat16": 0}


def _quantizer_module():
    """onnxruntime.quantization.matmul_nbits_quantizer, without the root logging setup it does at import."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        from onnxruntime.quantization import matmul_nbits_quantizer as q
    except ImportError as e:
        raise EnvironmentProblem(f"4-bit quantization needs onnxruntime's quantizer and onnx-ir (the [build] "
                                 f"extra: pip install 'onnx-ir>=1.1,<2'); found {e}") from None
    finally:
        for h in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(h)
        root.setLevel(level)
    logging.getLogger(q.__name__).setLevel(logging.WARNING)  # it logs every node at INFO
    return q


def lm_head_weight(model) -> str | None:
    """The initializer of the MatMul that makes the graph's logits (through Casts), or None."""
    producers = {o: n for n in model.graph.node for o in n.output}
    inits = {t.name for t in model.graph.initializer}
    outputs = [o.name for o in model.graph.output if o.name in ("logits", "draft_logits")]
    for name in outputs:
        node = producers.get(name)
        while node is not None and node.op_type in ("Cast", "Identity", "Reshape"):
            node = producers.get(node.input[0])
        if node is not None and node.op_type == "MatMul" and node.input[1] in inits:
            return node.input[1]
    return None


def quantize_graph(graph: Path, out: Path, options: QuantizeOptions, dtype: str = "float32",
                   accuracy_level: int | None = None, fmt: str = MATMULNBITS) -> Quantization:
    """Write `out` (a graph path) and its `out.name + '.data'`: `graph` with its MatMul weights in 4 bits.

    `fmt`: MATMULNBITS (ONNX Runtime) or QDQ (TensorRT: RTN, symmetric, blocked DequantizeLinear).
    `accuracy_level`: MatMulNBits' attribute (default ACCURACY_LEVEL of `dtype`). Returns the record of
    what was quantized. ModelError when the graph has no MatMul weight to quantize."""
    import onnx

    from bundler.onnx.blocks.moe import QMOE_OPERATOR, quantize_experts

    q = _quantizer_module()
    graph, out = Path(graph), Path(out)
    model = _at_opset(graph, QDQ_OPSET) if fmt == QDQ else onnx.load(str(graph), load_external_data=True)
    inits = {t.name: t for t in model.graph.initializer}
    matmuls = [n for n in model.graph.node if n.op_type == "MatMul" and len(n.input) == 2 and n.input[1] in inits
               and len(inits[n.input[1]].dims) == 2]
    if not matmuls:
        raise ModelError(f"{graph}: expected MatMul nodes with weights to quantize, found none")
    for i, n in enumerate(matmuls):
        if not n.name:
            n.name = f"/MatMul_w{i}"
    head = lm_head_weight(model) if options.keep_lm_head else None
    exclude = [n.name for n in matmuls if n.input[1] == head]
    level = ACCURACY_LEVEL.get(dtype, 0) if accuracy_level is None else accuracy_level
    symmetric = False
    if fmt == QDQ:
        if options.method != "rtn":
            raise UsageError(f"expected --quantization-method rtn for a TensorRT target's 4-bit graph (TensorRT "
                             f"builds blocked INT4 DequantizeLinear, which ONNX Runtime's quantizer writes by RTN "
                             f"only), found {options.method}")
        from onnxruntime.quantization.quant_utils import QuantFormat

        config = q.DefaultWeightOnlyQuantConfig(block_size=options.block_size, is_symmetric=True,
                                                quant_format=QuantFormat.QDQ, bits=BITS)
        level, symmetric = 0, True
    elif options.method == "hqq":
        config = q.HQQWeightOnlyQuantConfig(block_size=options.block_size, bits=BITS)
        level = 0  # HQQ's nodes carry no accuracy_level
    else:
        config = q.DefaultWeightOnlyQuantConfig(block_size=options.block_size, is_symmetric=False,
                                                accuracy_level=level or None, bits=BITS)
    quantizer = q.MatMulNBitsQuantizer(model, algo_config=config, nodes_to_exclude=exclude)
    quantizer.process()
    result = quantizer.model.model
    experts = quantize_experts(result, options.block_size)  # routed experts: MoE -> QMoE
    done = sorted(n.input[1] for n in matmuls if n.name not in exclude)
    left = [n for n in result.graph.node if n.op_type == "MatMul" and n.input[1] in done]
    if fmt == QDQ:
        blocked = sum(1 for n in result.graph.node if n.op_type == "DequantizeLinear")
        if blocked != len(done):
            raise ModelError(f"{graph}: ONNX Runtime's quantizer wrote {blocked} DequantizeLinear node(s) for "
                             f"{len(done)} weights; expected one per linear layer")
    if left:
        raise ModelError(f"{graph}: ONNX Runtime's quantizer left {len(left)} MatMul(s) unquantized "
                         f"({left[0].input[1]}); expected every linear layer in {BITS} bits")
    meta = {p.key: p.value for p in result.metadata_props}
    meta["bundle.quantization"] = f"int{BITS}-{options.method}-b{options.block_size}" + ("-qdq" if fmt == QDQ else "")
    del result.metadata_props[:]
    for k, v in meta.items():
        result.metadata_props.add(key=k, value=v)
    save_model(result, out)
    extra = {"experts": list(experts), "experts_operator": QMOE_OPERATOR, "experts_method": "rtn"} if experts else {}
    return Quantization(method=options.method, bits=BITS, block_size=options.block_size, symmetric=symmetric,
                        layers=tuple(done), kept=tuple(sorted({head} if head else set())), accuracy_level=level,
                        operator=OPERATORS[fmt], extra=extra)


def _at_opset(graph: Path, opset: int):
    """`graph` converted to at least `opset` by ONNX's version converter (ReduceMean's axes become an input at
    18, ...), then its external weights loaded: converted before the weights are in, so no 2 GiB protobuf."""
    import onnx
    from onnx import external_data_helper, version_converter

    model = onnx.load(str(graph), load_external_data=False)
    current = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), opset)
    if current < opset:
        model = version_converter.convert_version(model, opset)
    external_data_helper.load_external_data_for_model(model, str(graph.parent))
    return model


def quantizing_export(export, options: QuantizeOptions, *, measure_dir: Path | None = None, held=None,
                      form: str = MATMULNBITS):
    """`export` (bundler.onnx.export.export_onnx's signature) followed by quantize_graph: the graph it writes in
    `out` is the 4-bit one, its ExportResult's `quantization` the record. For the graphs of `measure_dir`'s
    model (the target) that are not a fusion variant (the dual engine's decode graph has the same weights),
    the quality record (bundler.onnx.quality.measure against the unquantized export on `held`) is added."""
    import dataclasses

    def run(checkpoint, out, **kw):
        from bundler.onnx.gptq_pack import checkpoint_format, dequantized_checkpoint, pack_graph

        out = Path(out)
        plain = out / ".unquantized"
        shutil.rmtree(plain, ignore_errors=True)
        config = Path(checkpoint) / "config.json"
        fmt = checkpoint_format(_config(config), str(checkpoint)) if config.is_file() else None
        try:
            source = dequantized_checkpoint(checkpoint, plain / "checkpoint", fmt) if fmt else checkpoint
            result = export(source, plain, **kw)
            dtype = getattr(result, "dtype", "float32")
            graph = out / result.graph.name
            if fmt is not None and form == QDQ:
                raise UsageError(f"{checkpoint} is a 4-bit {fmt.method} checkpoint, which packs into ONNX Runtime's "
                                 f"MatMulNBits as it is; expected ONNX Runtime targets for it (TensorRT targets take "
                                 f"blocked INT4 DequantizeLinear: give them the float checkpoint)")
            if fmt is not None:  # already 4-bit: its own integers, not quantized again
                record = pack_graph(result.graph, graph, checkpoint, fmt, dtype)
            else:
                record = quantize_graph(result.graph, graph, options, dtype, fmt=form)
            if measure_dir is not None and Path(checkpoint) == Path(measure_dir) and kw.get("fusions") is None:
                from bundler.onnx.quality import measure

                log.info("measuring the 4-bit %s graph of %s against the unquantized one", dtype, checkpoint)
                capacity = getattr(result, "capacity", None)  # a static batched graph holds only so many rows
                limit = min(512, int(getattr(result, "max_positions", 512)),
                            *((capacity - BATCHED_HEADROOM,) if capacity else ()))
                quality = measure(result.graph, graph, Path(source), held, max_context=limit)
                record = dataclasses.replace(record, quality={**quality, "dtype": dtype})
            return dataclasses.replace(result, graph=graph, weights=graph.with_name(graph.name + ".data"),
                                       quantization=record)
        finally:
            shutil.rmtree(plain, ignore_errors=True)
    return run


def _config(path: Path) -> dict:
    from bundler.onnx.export import read_config

    return read_config(path.parent)
