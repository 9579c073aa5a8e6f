"""Decoder-layer blocks the in-place graph builder (bundler.onnx.inplace) composes beyond attention + MLP, one
module per block: routed experts (moe), Gated DeltaNet (gated_deltanet), Nemotron-H's Mamba-2, MLP and experts
(mamba2)."""
