"""Decoder-layer blocks the in-place graph builder (bundler.onnx.inplace) composes, one module per block."""
