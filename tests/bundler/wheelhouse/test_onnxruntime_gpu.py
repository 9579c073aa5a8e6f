"""Which aarch64 targets may carry PyPI's onnxruntime-gpu as the CUDA provider fallback: the SMs it has
kernels for (DGX Spark's sm_121), never a Thor or an Orin; create says why in one line per target."""

from __future__ import annotations

import pytest

from bundler.pack.wheelhouse import onnxruntime_gpu_lines
from manifests.errors import UsageError

AARCH64 = ["linux_aarch64-cp312"]
GPU_WHEEL = "onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_27_aarch64.manylinux_2_28_aarch64.whl"


def test_without_the_wheel_each_target_says_whether_it_could_carry_it():
    spark, thor, orin = onnxruntime_gpu_lines(["dgx-spark", "jetson-thor", "jetson-agx-orin", "cpu"], AARCH64, None)
    assert spark.startswith("fallback: dgx-spark: onnxruntime-gpu 1.31.1 (PyPI, aarch64) has sm_121 kernels")
    assert thor == ("fallback: jetson-thor: no onnxruntime-gpu: PyPI's aarch64 build has kernels for sm_89, sm_90, "
                    "sm_120, sm_121 only, no PTX, not sm_110: without TensorRT it serves on the CPU")
    assert "not sm_87" in orin
    assert onnxruntime_gpu_lines(["jetson-thor"], ["linux_x86_64-cp311"], None) == []  # no aarch64 runtime


def test_a_spark_carries_it_and_a_thor_beside_it_is_refused(tmp_path):
    (tmp_path / GPU_WHEEL).write_bytes(b"")
    (line,) = onnxruntime_gpu_lines(["dgx-spark"], AARCH64, tmp_path)
    assert line == "fallback: dgx-spark: carries onnxruntime-gpu 1.31.1, whose CUDA provider has sm_121 kernels"
    with pytest.raises(UsageError, match=r"would reach jetson-thor \(sm_110\), igx-thor \(sm_110\), where its CUDA "
                                         r"provider fails: expected a bundle of its own"):
        onnxruntime_gpu_lines(["dgx-spark", "jetson-thor", "igx-thor"], AARCH64, tmp_path)
