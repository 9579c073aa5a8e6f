"""Checkpoints to ONNX graphs: the exporters, the in-place and half-precision graphs, EAGLE-3 heads."""
