"""How an engine's weights are quantized: the options `bundle create --quantization` takes, and the record
the signed engine record carries (`build["quantization"]`, also in the engine key).

No I/O and no onnx here: the device reads the record (inspect, the engine key), the build host writes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from manifests.errors import BadBundleError, UsageError

#: --quantization values: "none" keeps every weight in the graph's dtype; "int4" makes every linear layer
#: block-wise 4-bit: ONNX Runtime's MatMulNBits (com.microsoft) in the graphs ONNX Runtime runs, the standard
#: blocked INT4 DequantizeLinear before each MatMul (QDQ) in the graphs TensorRT builds (its weight-only INT4).
MODES = ("none", "int4")
#: the two forms of a 4-bit graph, by the engine that runs it (bundler.onnx.quantize)
MATMULNBITS, QDQ = "matmulnbits", "qdq"
FORMATS = (MATMULNBITS, QDQ)
OPERATORS = {MATMULNBITS: "com.microsoft.MatMulNBits", QDQ: "DequantizeLinear"}
#: ONNX Runtime's quantizer algorithms this tool runs (onnxruntime.quantization.matmul_nbits_quantizer):
#: "rtn" its DefaultWeightOnlyQuantConfig (C++ round to nearest per block, min/max scale and zero point),
#: "hqq" its HQQWeightOnlyQuantConfig (half-quadratic optimisation of scale and zero point, no data);
#: "gptq" and "awq": checkpoints that arrive already quantized so, packed as they are (bundler.onnx.gptq_pack).
METHODS = ("rtn", "hqq")
PACKED_METHODS = ("gptq", "awq")
BLOCK_SIZES = (16, 32, 64, 128, 256)
#: Chosen on benchmarks/bench_quant.py quality (README, "4-bit weights"): RTN at block 32, asymmetric: the lowest
#: increase of RTN (+1.55% on the demo target against +2.86% at 64, +3.97% at 128) for 11% more bytes than block
#: 128; HQQ at 64 measured +1.87% and quantizes about 50x slower.
DEFAULT_METHOD = "rtn"
DEFAULT_BLOCK_SIZE = 32
#: Relative perplexity increase (quantized / unquantized - 1) above which create refuses: 4-bit block-wise RTN
#: usually costs a few percent; 10% leaves room for models that quantize less well and still stops a broken
#: quantization (a wrong layout multiplies perplexity) and a model 4 bits visibly degrade.
DEFAULT_MAX_QUALITY_LOSS = 0.10
#: The lm_head is 4-bit too by default: on the demo pair it added 0.13 points to a 1.42% perplexity increase
#: (block 32, benchmarks/bench_quant.py quality), while Llama-3.2-1B's lm_head is a fifth of its parameters: kept in fp16 it would be about 40% of
#: the bytes a 4-bit decode step reads. `--quantization-keep-lm-head` keeps it in the graph's dtype.
LM_HEAD = "lm_head"


def weight_bytes_per_parameter(block_size: int, value_bytes: int) -> float:
    """Bytes a 4-bit MatMulNBits weight takes per parameter: 4 bits, plus per block one scale (the graph's
    dtype) and one 4-bit zero point."""
    return 0.5 + (value_bytes + 0.5) / block_size


#: the profile extra with_quantization sets: the quantization a create gives that target
APPLIED = "quantization_applied"


def with_quantization(profile, options: "QuantizeOptions | None"):
    """`profile` with the quantization it gets (extra "quantization", "quantization_block_size"), which the
    build host's memory pre-flight (bundler.resolve.checks.device_memory) counts weights by."""
    import dataclasses

    if options is None:
        return profile
    return dataclasses.replace(profile, extra={**profile.extra, APPLIED: options.mode_for(profile),
                                               "quantization_block_size": options.block_size})


def applied(profile) -> str:
    """The quantization with_quantization gave `profile` ("none" for a profile it did not touch)."""
    return profile.extra.get(APPLIED, "none")


def profile_default(profile) -> str:
    """The quantization a target profile names as its default (`"quantization"` in its JSON), else "none"."""
    mode = profile.extra.get("quantization", "none")
    if mode not in MODES:
        raise UsageError(f"target profile {profile.source} ({profile.id}): expected quantization one of "
                         f"{', '.join(MODES)}, found {mode!r}")
    return mode


@dataclass(frozen=True)
class QuantizeOptions:
    """What `bundle create --quantization ...` asks for (the build host's side)."""

    mode: str | None = None  # MODES; None: each target profile's default (profile_default)
    method: str = DEFAULT_METHOD  # METHODS
    block_size: int = DEFAULT_BLOCK_SIZE
    #: keep the lm_head in the graph's dtype (default: 4-bit like every other linear layer; see LM_HEAD)
    keep_lm_head: bool = False
    #: refuse the create when the quantized target's perplexity rises by more than this fraction
    max_quality_loss: float = DEFAULT_MAX_QUALITY_LOSS
    #: held-out text for the quality measurement (None: the demo pair's held-out split or a built-in text)
    calibration_text: str | None = None
    #: (target id, mode) pairs that win over `mode` (a rebuild from a lock file)
    targets: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        if self.mode is not None and self.mode not in MODES:
            raise UsageError(f"expected --quantization one of {', '.join(MODES)}, found {self.mode!r}")
        if self.method not in METHODS:
            raise UsageError(f"expected --quantization-method one of {', '.join(METHODS)}, found {self.method!r}")
        if self.block_size not in BLOCK_SIZES:
            raise UsageError(f"expected --quantization-block-size one of {', '.join(map(str, BLOCK_SIZES))}, "
                             f"found {self.block_size}")
        if not 0 <= self.max_quality_loss < 100:
            raise UsageError(f"expected --max-quality-loss a fraction >= 0 (0.1: 10%), found {self.max_quality_loss}")

    def mode_for(self, profile) -> str:
        """The quantization one target gets: the one asked for, else its profile's default."""
        per = dict(self.targets)
        if profile.id in per:
            return per[profile.id]
        return self.mode if self.mode is not None else profile_default(profile)


@dataclass(frozen=True)
class Quantization:
    """The record of one quantized graph: in the signed engine record and its key.

    `layers`: the graph's MatMul weights that became 4-bit (initializer names, sorted); `kept`: the
    linear layers left in the graph's dtype (the lm_head by default). `source`: "onnxruntime" (quantized
    here by ONNX Runtime's quantizer) or "checkpoint" (GPTQ/AWQ integers of the checkpoint, packed as they are).
    """

    method: str
    bits: int
    block_size: int
    symmetric: bool
    layers: tuple[str, ...]
    kept: tuple[str, ...] = ()
    source: str = "onnxruntime"
    accuracy_level: int = 0  # MatMulNBits' attribute: 4 = int8 compute on the CPU, 0 = the kernel's default
    operator: str = "com.microsoft.MatMulNBits"
    #: the quality measurement of the target (bundler.onnx.quality): perplexities, increase, greedy agreement
    quality: Mapping[str, Any] | None = None
    extra: dict = field(default_factory=dict, compare=False)

    def key(self) -> dict:
        """What goes into the engine key: everything but the quality figures (which describe, not identify)."""
        d = self.to_dict()
        d.pop("quality", None)
        return d

    @property
    def summary(self) -> str:
        """One line: "int4 rtn block 32 asym, 42 layers (lm_head kept)"."""
        kept = f" ({', '.join(self.kept)} kept)" if self.kept else ""
        experts = self.extra.get("experts")
        experts = f", {len(experts)} expert weights" if isinstance(experts, list) and experts else ""
        return (f"int{self.bits} {self.method} block {self.block_size} {'sym' if self.symmetric else 'asym'}, "
                f"{len(self.layers)} layers{experts}{kept}")

    def to_dict(self) -> dict:
        d = {"method": self.method, "bits": self.bits, "block_size": self.block_size, "symmetric": self.symmetric,
             "layers": list(self.layers), "kept": list(self.kept), "source": self.source,
             "accuracy_level": self.accuracy_level, "operator": self.operator}
        if self.quality is not None:
            d["quality"] = dict(self.quality)
        d.update(self.extra)
        return d

    @classmethod
    def from_dict(cls, d: Any, what: str = "engine quantization") -> "Quantization":
        """Parse a record (from a signed manifest): BadBundleError naming the field when malformed."""
        def bad(msg: str) -> BadBundleError:
            return BadBundleError(f"invalid manifest: {what}: {msg}")

        if not isinstance(d, Mapping):
            raise bad(f"expected an object, found {type(d).__name__}")
        known = {"method", "bits", "block_size", "symmetric", "layers", "kept", "source", "accuracy_level",
                 "operator", "quality"}
        for name, kind in (("method", str), ("bits", int), ("block_size", int), ("symmetric", bool),
                           ("source", str), ("accuracy_level", int), ("operator", str)):
            if name in d and (not isinstance(d[name], kind) or (kind is int and isinstance(d[name], bool))):
                raise bad(f"expected {name} to be {kind.__name__}, found {d[name]!r}"[:200])
        for name in ("method", "bits", "block_size", "layers"):
            if name not in d:
                raise bad(f"expected {name}, found none")
        for name in ("layers", "kept"):
            v = d.get(name, [])
            if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
                raise bad(f"expected {name} to be a list of names, found {v!r}"[:200])
        quality = d.get("quality")
        if quality is not None and not isinstance(quality, Mapping):
            raise bad(f"expected quality to be an object, found {quality!r}"[:200])
        return cls(d["method"], d["bits"], d["block_size"], bool(d.get("symmetric", False)), tuple(d["layers"]),
                   tuple(d.get("kept", ())), d.get("source", "onnxruntime"), d.get("accuracy_level", 0),
                   d.get("operator", "com.microsoft.MatMulNBits"), dict(quality) if quality is not None else None,
                   {k: v for k, v in d.items() if k not in known})


def quality_line(quality: Mapping[str, Any] | None) -> str:
    """`bundle inspect`'s line for a quality record."""
    if not quality:
        return "not measured"
    try:
        return (f"perplexity {float(quality['perplexity_reference']):.3f} -> {float(quality['perplexity']):.3f} "
                f"({100 * float(quality['relative_increase']):+.2f}%), greedy agreement "
                f"{100 * float(quality['greedy_agreement']):.1f}% over {quality.get('prompts', '?')} prompts, "
                f"{quality.get('tokens', '?')} tokens of {quality.get('text', '?')}")
    except (KeyError, TypeError, ValueError):
        return f"unreadable quality record {dict(quality)!r}"[:200]
