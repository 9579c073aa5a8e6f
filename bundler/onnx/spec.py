"""What graph to export, as one value: GraphSpec(layout, dtype, fusions, quantization, aux_layer_ids).

bundler.onnx.export.export_onnx's keyword arguments map onto it (export_graph takes it directly), and
bundler.pack.engines names each exported variant by it (a target's graph is a GraphSpec, its bundle folder
GraphSpec.folder): one place that says which combinations exist and where each is stored.
"""

from __future__ import annotations

from dataclasses import dataclass

from manifests.errors import UsageError

#: KV-cache graph layouts. "concat": present = Concat(past, new) in elementary ops, past grows each
#: step; runs anywhere (ONNX Runtime, TensorRT 10.13 and later). "shared": written by bundler.onnx.inplace with
#: GroupQueryAttention, past and present are one fixed [.., max_context, ..] buffer updated in
#: place (ONNX Runtime only: GQA is a contrib op).
#: "batched": written by bundler.onnx.inplace with the standard TensorScatter + Attention ops (opset
#: 24): one cache region per slot, [slots, kv_heads, capacity, head_dim], updated in place, and one
#: call advances many slots with different numbers of new tokens (what the scheduler batches).
KV_CACHE_LAYOUTS = ("concat", "shared", "batched")
#: Graph dtypes (weights, activations, KV cache). bfloat16 only for the in-place layouts (the cuda
#: target); float16 concat graphs are what fp16 TensorRT targets build from.
DTYPES = ("float32", "float16", "bfloat16")
#: (layout, dtype) -> the bundle folder of its graphs (engines/<folder>/<role>/); a quantized graph's folder
#: adds "-<quantization>". Frozen: signed bundles and their lock files name these paths.
FOLDERS = {("concat", "float32"): "engines/onnx", ("concat", "float16"): "engines/onnx-fp16",
           ("shared", "float32"): "engines/onnx-shared", ("batched", "float32"): "engines/onnx-batched",
           ("batched", "float16"): "engines/onnx-batched-fp16", ("batched", "bfloat16"): "engines/onnx-batched-bf16",
           ("shared", "float16"): "engines/onnx-shared-fp16", ("shared", "bfloat16"): "engines/onnx-shared-bf16"}


@dataclass(frozen=True)
class GraphSpec:
    layout: str = "concat"  # KV_CACHE_LAYOUTS
    dtype: str = "float32"  # DTYPES
    #: batched only: bundler.onnx.inplace.FUSIONS (None: its DEFAULT_FUSIONS)
    fusions: frozenset[str] | None = None
    #: the weights' form in the bundle ("none", or a bundler.pack.engines quantization name); applied by
    #: bundler.onnx.quantize after the export, so not an export option
    quantization: str = "none"
    #: EAGLE-3 targets: the decoder layers whose inputs the graph also returns (aux_hidden_states)
    aux_layer_ids: tuple[int, ...] = ()
    #: batched only: the cache's rows per slot fixed in the graph (max context + headroom), or None (a
    #: dynamic "capacity" axis). TensorRT takes TensorScatter as its KV-cache update layer, and Attention
    #: after it, only with a static capacity: the graph TensorRT targets build from fixes it.
    capacity: int | None = None

    def __post_init__(self):
        if self.layout not in KV_CACHE_LAYOUTS:
            raise UsageError(f"expected kv_cache to be one of {', '.join(KV_CACHE_LAYOUTS)}, found {self.layout!r}")
        if self.dtype not in DTYPES:
            raise UsageError(f"expected dtype to be one of {', '.join(DTYPES)}, found {self.dtype!r}")
        if self.layout == "concat" and self.dtype == "bfloat16":
            raise UsageError("the concat KV-cache graph is float32 or float16; found dtype 'bfloat16': export "
                             "bfloat16 with an in-place layout (kv_cache='batched')")
        if self.fusions is not None:
            object.__setattr__(self, "fusions", frozenset(self.fusions))
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        if self.capacity is not None and (self.layout != "batched" or int(self.capacity) < 2):
            raise UsageError(f"a static cache capacity applies to the batched KV-cache graph, at least 2 rows; "
                             f"found capacity {self.capacity!r} with kv_cache {self.layout!r}")

    def check_fusions(self) -> None:
        if self.fusions is not None and self.layout != "batched":
            raise UsageError(f"graph fusions apply to the batched KV-cache graph; found kv_cache {self.layout!r}")

    @classmethod
    def of_variant(cls, variant: tuple) -> GraphSpec:
        """From a (layout, dtype[, quantization[, capacity]]) tuple (bundler.pack.engines' variant names)."""
        return cls(variant[0], variant[1], quantization=variant[2] if len(variant) > 2 else "none",
                   capacity=variant[3] if len(variant) > 3 else None)

    @property
    def variant(self) -> tuple:
        """(layout, dtype, quantization[, capacity]): what tells a bundle's graphs apart (folder says where each goes)."""
        return (self.layout, self.dtype, self.quantization) + ((self.capacity,) if self.capacity is not None else ())

    @property
    def folder(self) -> str:
        """The bundle folder of this graph (FOLDERS; "-int4", "-int4-qdq" for 4-bit graphs, "-c<capacity>" for a
        static cache capacity)."""
        root = FOLDERS[self.layout, self.dtype]
        root = root if self.quantization == "none" else f"{root}-{self.quantization}"
        return root if self.capacity is None else f"{root}-c{self.capacity}"

    def export_options(self) -> dict:
        """The export_onnx keyword arguments of this spec, only those that differ from the defaults."""
        return {**({"kv_cache": self.layout} if self.layout != "concat" else {}),
                **({"dtype": self.dtype} if self.dtype != "float32" else {}),
                **({"fusions": self.fusions} if self.fusions is not None else {}),
                **({"aux_layer_ids": self.aux_layer_ids} if self.aux_layer_ids else {}),
                **({"capacity": self.capacity} if self.capacity is not None else {})}
