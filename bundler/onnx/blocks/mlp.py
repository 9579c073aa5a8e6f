"""The SwiGLU MLP: down(silu(gate(x)) * up(x)), gate and up in one MatMul when packed."""

from __future__ import annotations

from bundler.onnx.blocks.graph import GraphBuilder


def swiglu(g: GraphBuilder, x: str, prefix: str, *, packed: bool) -> str:
    """The MLP of x under `prefix` (`model.layers.<i>.mlp`); packed: the "gate_up" fusion."""
    if packed:
        gate, up = g.packed(x, prefix, ("gate_proj", "up_proj"))
    else:
        gate, up = g.linear(x, f"{prefix}.gate_proj"), g.linear(x, f"{prefix}.up_proj")
    act = g.node("Mul", [g.node("Mul", [gate, g.node("Sigmoid", [gate])]), up])
    return g.linear(act, f"{prefix}.down_proj")
