"""`bundle create`'s quantization flags, as one decorator that hands the command a QuantizeOptions."""

from __future__ import annotations

import functools
from pathlib import Path

import click

from manifests.quantization import (BLOCK_SIZES, DEFAULT_BLOCK_SIZE, DEFAULT_MAX_QUALITY_LOSS, DEFAULT_METHOD,
                                    METHODS, MODES, QuantizeOptions)

_NAMES = ("quantization", "quantization_method", "quantization_block_size", "quantization_keep_lm_head",
          "calibration_text", "max_quality_loss")


def quantization_options(command):
    """Add --quantization and its options to `command`, which receives them as `quantization=QuantizeOptions`
    (mode None: each target's profile default, or the lock file's when rebuilding from one)."""
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        values = {n: kwargs.pop(n) for n in _NAMES}
        kwargs["quantization"] = QuantizeOptions(
            mode=values["quantization"], method=values["quantization_method"],
            block_size=values["quantization_block_size"], keep_lm_head=values["quantization_keep_lm_head"],
            calibration_text=str(values["calibration_text"]) if values["calibration_text"] else None,
            max_quality_loss=values["max_quality_loss"])
        return command(*args, **kwargs)

    options = [
        click.option("--quantization", type=click.Choice(MODES), default=None,
                     help="Weights of every target and draft engine: int4 (block-wise 4-bit, ONNX Runtime "
                          "MatMulNBits) or none. Default: each target profile's (Thor, DGX Spark, Orin: int4; "
                          "cpu, cuda: none)."),
        click.option("--quantization-method", type=click.Choice(METHODS), default=DEFAULT_METHOD, show_default=True,
                     help="ONNX Runtime's quantizer algorithm: rtn (round to nearest per block) or hqq."),
        click.option("--quantization-block-size", type=click.Choice([str(b) for b in BLOCK_SIZES]),
                     default=str(DEFAULT_BLOCK_SIZE), show_default=True, callback=lambda c, p, v: int(v),
                     help="Weights per 4-bit block (one scale and zero point each)."),
        click.option("--quantization-keep-lm-head", is_flag=True,
                     help="Keep the lm_head in the graph's dtype (fp16 on GPUs, fp32 on cpu) instead of 4-bit."),
        click.option("--calibration-text", type=click.Path(dir_okay=False, exists=True, path_type=Path),
                     metavar="FILE", help="Held-out UTF-8 text the 4-bit target's quality is measured on "
                                          "(default: the demo pair's held-out split, else a built-in text)."),
        click.option("--max-quality-loss", type=click.FloatRange(min=0), default=DEFAULT_MAX_QUALITY_LOSS,
                     show_default=True, metavar="FRACTION",
                     help="Refuse (exit 8) when the 4-bit target's perplexity is more than this fraction above "
                          "the unquantized one's (0.1: 10%)."),
    ]
    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


def create_quantization(options: QuantizeOptions, targets, lock_path: Path | None):
    """(the options create runs with, the lock file's record of them). Without --quantization, a rebuild from
    a lock file takes the lock's quantization; else each target gets its profile's default."""
    import dataclasses

    from bundler.resolve.lockfile import quantization_from_lock
    from runtime.profiles import get_profile

    if options.mode is None and lock_path is not None:
        locked = quantization_from_lock(lock_path)
        if locked is not None:
            options = dataclasses.replace(options, method=locked["method"], block_size=locked["block_size"],
                                          keep_lm_head=locked["keep_lm_head"],
                                          targets=tuple(sorted(locked["targets"].items())))
    modes = {t: options.mode_for(get_profile(t)) for t in targets}
    record = {"targets": modes, "method": options.method, "block_size": options.block_size,
              "keep_lm_head": options.keep_lm_head}
    return options, record


def quality_lines(manifest) -> list[str]:
    """create's summary of each 4-bit engine (what `bundle inspect` shows too)."""
    from manifests.quantization import Quantization, quality_line

    out = []
    for t in manifest.targets:
        for e in t.engines:
            q = e.build.get("quantization")
            if isinstance(q, dict):
                rec = Quantization.from_dict(q)
                out.append(f"4-bit:    {t.id} {e.model}: {rec.summary}"
                           + (f"; {quality_line(rec.quality)}" if rec.quality else ""))
    return out
