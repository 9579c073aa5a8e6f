"""Decoder-layer blocks beyond attention + MLP, written into the in-place graphs of bundler.onnx.inplace."""
