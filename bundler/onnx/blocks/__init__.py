"""The blocks the graph builder (bundler.onnx.inplace, every layout) composes, one module per block, each writing
into a graph.GraphBuilder: RMSNorm (norm), rotary tables (rotary), self-attention over the in-place cache
(attention), the SwiGLU MLP (mlp), routed experts (moe), Gated DeltaNet (gated_deltanet), Nemotron-H's Mamba-2,
MLP and experts (mamba2)."""
