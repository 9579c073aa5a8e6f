"""EAGLE-3 draft heads in the public checkpoint layout (connected host, [build] extra).

An EAGLE-3 head drafts from the target's own features instead of from tokens alone. The layout is
the one the public checkpoints (and vLLM's `llama_eagle3.py`, SGLang, SpecForge) use:

    fc.weight                      [H, 3 * H_target]   fuses three target hidden states (no bias)
    midlayer.input_layernorm       [H]                 RMSNorm of the token embedding
    midlayer.hidden_norm           [H]                 RMSNorm of the fused hidden state
    midlayer.self_attn.{q,k,v}_proj [.., 2 * H]        attention over concat(embedding, hidden)
    midlayer.self_attn.o_proj, midlayer.post_attention_layernorm, midlayer.mlp.{gate,up,down}_proj
    norm.weight, lm_head.weight    [draft_vocab, H]    a reduced draft vocabulary
    d2t                            [draft_vocab] int64 target id = draft id + d2t[draft id]
    t2d                            [vocab] bool        which target ids the draft vocabulary holds

The token embedding is the target's (`embed_tokens` is not in the checkpoint, or is a copy).
config.json: `architectures: ["LlamaForCausalLMEagle3"]`, the Llama keys, `draft_vocab_size`, and
optionally `eagle_config.eagle_aux_hidden_state_layer_ids` (default [2, N // 2, N - 3] for an
N-layer target, as vLLM and TensorRT Edge-LLM choose). Layer id i is the input of decoder layer i,
i.e. transformers' `output_hidden_states[i]`.

One step: position t takes (embedding of token t + 1, feature f_t) and predicts token t + 2, where
f_t = fc(target aux states at t) for tokens the target has verified and f_t = the head's own
pre-norm output at t - 1 while chain drafting. `export_head_onnx` writes that as one graph.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from bundler.model_config import read_config
from manifests.errors import ModelError
from manifests.families import EAGLE3_ARCHITECTURES

ARCHITECTURES = EAGLE3_ARCHITECTURES
GRAPH_NAME = "eagle3.onnx"
WEIGHTS_NAME = "eagle3.onnx.data"


def default_layer_ids(num_layers: int) -> list[int]:
    """vLLM's and Edge-LLM's choice: an early, a middle and a late layer."""
    return [2, num_layers // 2, num_layers - 3]


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_positions: int
    layer_ids: tuple[int, ...] | None  # None: default_layer_ids of the target

    @classmethod
    def from_dict(cls, d: dict, where: str = "EAGLE-3 head") -> "HeadConfig":
        archs = d.get("architectures") or []
        if not archs or archs[0] not in ARCHITECTURES:
            raise ModelError(f"{where}: expected architecture {' or '.join(ARCHITECTURES)}, found "
                             f"{archs[0] if archs else 'none'!r}")
        try:
            h = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            eagle = d.get("eagle_config") or {}
            ids = eagle.get("eagle_aux_hidden_state_layer_ids")
            rope = d.get("rope_parameters") or {}
            return cls(hidden_size=h, target_hidden_size=int(d.get("target_hidden_size") or h),
                       intermediate_size=int(d["intermediate_size"]), num_heads=heads,
                       num_kv_heads=int(d.get("num_key_value_heads") or heads),
                       head_dim=int(d.get("head_dim") or h // heads), vocab_size=int(d["vocab_size"]),
                       draft_vocab_size=int(d.get("draft_vocab_size") or d["vocab_size"]),
                       rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                       rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
                       max_positions=int(d.get("max_position_embeddings", 2048)),
                       layer_ids=tuple(int(i) for i in ids) if ids is not None else None)
        except (KeyError, TypeError, ValueError) as e:
            raise ModelError(f"{where}: expected a Llama EAGLE-3 config.json, found a bad or missing key: {e}") \
                from None

    def to_dict(self) -> dict:
        d = {"architectures": [ARCHITECTURES[0]], "model_type": "llama", "hidden_size": self.hidden_size,
             "target_hidden_size": self.target_hidden_size, "intermediate_size": self.intermediate_size,
             "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
             "head_dim": self.head_dim, "num_hidden_layers": 1, "vocab_size": self.vocab_size,
             "draft_vocab_size": self.draft_vocab_size, "rms_norm_eps": self.rms_norm_eps,
             "rope_theta": self.rope_theta, "max_position_embeddings": self.max_positions,
             "hidden_act": "silu", "tie_word_embeddings": False}
        if self.layer_ids is not None:
            d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.layer_ids)}
        return d

    def resolved_layer_ids(self, target_layers: int) -> list[int]:
        return list(self.layer_ids) if self.layer_ids is not None else default_layer_ids(target_layers)


def read_head_config(head_dir: Path) -> HeadConfig:
    d = read_config(Path(head_dir), f"EAGLE-3 head {head_dir}", merge_text_config=False)
    return HeadConfig.from_dict(d, str(head_dir))


def check_against_target(cfg: HeadConfig, target_config: dict, where: str = "EAGLE-3 head") -> list[int]:
    """The head's layer ids for this target, or ModelError naming the mismatch (hidden size, vocabulary,
    layer ids)."""
    th, tv = int(target_config["hidden_size"]), int(target_config["vocab_size"])
    n = int(target_config["num_hidden_layers"])
    if cfg.target_hidden_size != th:
        raise ModelError(f"{where}: expected target hidden size {th} (fc takes 3 x {th}), "
                         f"found {cfg.target_hidden_size}")
    if cfg.hidden_size != th:
        raise ModelError(f"{where}: expected hidden size {th} (the head shares the target's embedding), "
                         f"found {cfg.hidden_size}")
    if cfg.vocab_size != tv:
        raise ModelError(f"{where}: expected vocabulary {tv} (the target's), found {cfg.vocab_size}")
    if not 1 <= cfg.draft_vocab_size <= tv:
        raise ModelError(f"{where}: expected draft_vocab_size from 1 to {tv}, found {cfg.draft_vocab_size}")
    ids = cfg.resolved_layer_ids(n)
    if len(ids) != 3 or any(not 0 <= i < n for i in ids):
        raise ModelError(f"{where}: expected three aux layer ids in 0..{n - 1} for a {n}-layer target, found {ids}")
    return ids


def check_vocab_map(d2t, t2d, cfg: HeadConfig, where: str = "EAGLE-3 head") -> None:
    """d2t must map draft ids one-to-one into the target vocabulary, and t2d must mark exactly those."""
    import numpy as np

    d2t, t2d = np.asarray(d2t), np.asarray(t2d)
    if d2t.shape != (cfg.draft_vocab_size,):
        raise ModelError(f"{where}: expected d2t of shape [{cfg.draft_vocab_size}], found {list(d2t.shape)}")
    target = np.arange(cfg.draft_vocab_size) + d2t.astype(np.int64)
    if target.min() < 0 or target.max() >= cfg.vocab_size or len(set(target.tolist())) != len(target):
        raise ModelError(f"{where}: expected d2t to map draft ids one-to-one into 0..{cfg.vocab_size - 1}, "
                         f"found targets {int(target.min())}..{int(target.max())} with repeats or gaps out of range")
    if t2d.shape != (cfg.vocab_size,) or int(t2d.astype(bool).sum()) != cfg.draft_vocab_size \
            or not t2d.astype(bool)[target].all():
        raise ModelError(f"{where}: expected t2d [{cfg.vocab_size}] marking exactly the d2t targets, "
                         f"found shape {list(t2d.shape)} with {int(t2d.astype(bool).sum())} marked")


def at_least_float32(t):
    """t in float32 when narrower (half-precision norms and softmax lose too much), else unchanged: a
    float64 head computes in float64 throughout, so a float64 check compares at float64's precision."""
    import torch

    return t.to(torch.promote_types(t.dtype, torch.float32))


def _torch_modules():
    import torch
    from torch import nn

    class RMSNorm(nn.Module):
        def __init__(self, n, eps):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(n))
            self.eps = eps

        def forward(self, x):
            dtype = x.dtype
            x = at_least_float32(x)
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
            return self.weight * x.to(dtype)

    def rotate_half(x):
        a, b = x.chunk(2, dim=-1)
        return torch.cat((-b, a), dim=-1)

    class Attention(nn.Module):
        def __init__(self, c: HeadConfig):
            super().__init__()
            self.c = c
            self.q_proj = nn.Linear(2 * c.hidden_size, c.num_heads * c.head_dim, bias=False)
            self.k_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
            self.v_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
            self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
            inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
            self.register_buffer("inv_freq", inv, persistent=False)

        def qkv(self, x, position_ids):
            """x [b, s, 2H] -> rotated q [b, heads, s, d], rotated k and v [b, kv_heads, s, d]."""
            c = self.c
            b, s, _ = x.shape
            q = self.q_proj(x).view(b, s, c.num_heads, c.head_dim).transpose(1, 2)
            k = self.k_proj(x).view(b, s, c.num_kv_heads, c.head_dim).transpose(1, 2)
            v = self.v_proj(x).view(b, s, c.num_kv_heads, c.head_dim).transpose(1, 2)
            freqs = position_ids.float()[..., None] * self.inv_freq  # [b, s, d/2]
            emb = torch.cat((freqs, freqs), dim=-1)[:, None]
            cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
            return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

        def forward(self, x, position_ids, past_k, past_v, mask):
            """x [b, s, 2H]; past_k/v [b, kv, p, d]; mask [s, p + s] additive or None (causal)."""
            c = self.c
            b, s, _ = x.shape
            q, k, v = self.qkv(x, position_ids)
            k = torch.cat([past_k, k], dim=2)
            v = torch.cat([past_v, v], dim=2)
            rep = c.num_heads // c.num_kv_heads
            kk = k.repeat_interleave(rep, dim=1) if rep > 1 else k
            vv = v.repeat_interleave(rep, dim=1) if rep > 1 else v
            scores = torch.matmul(q, kk.transpose(-1, -2)) / math.sqrt(c.head_dim)
            if mask is None:  # causal over past + new
                total = kk.shape[2]
                qpos = torch.arange(s, device=x.device)[:, None] + (total - s)
                kpos = torch.arange(total, device=x.device)[None, :]
                scores = scores.masked_fill(kpos > qpos, float("-inf"))
            else:
                scores = scores + mask
            attn = torch.softmax(at_least_float32(scores), dim=-1).to(q.dtype)
            out = torch.matmul(attn, vv).transpose(1, 2).reshape(b, s, c.num_heads * c.head_dim)
            return self.o_proj(out), k, v

    class MLP(nn.Module):
        def __init__(self, c: HeadConfig):
            super().__init__()
            self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
            self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
            self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

        def forward(self, x):
            return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    class MidLayer(nn.Module):
        def __init__(self, c: HeadConfig):
            super().__init__()
            self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.self_attn = Attention(c)
            self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.mlp = MLP(c)

        def forward(self, embeds, hidden, position_ids, past_k, past_v, mask=None):
            residual = hidden
            x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
            a, k, v = self.self_attn(x, position_ids, past_k, past_v, mask)
            h = residual + a
            return h + self.mlp(self.post_attention_layernorm(h)), k, v

    class Eagle3Head(nn.Module):
        """fc + one decoder layer + norm + reduced lm_head; forward returns (draft logits, pre-norm
        hidden for the next step, new K, new V)."""

        def __init__(self, c: HeadConfig):
            super().__init__()
            self.config = c
            self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
            self.midlayer = MidLayer(c)
            self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
            self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool) if c.draft_vocab_size ==
                                 c.vocab_size else torch.zeros(c.vocab_size, dtype=torch.bool))

        def empty_cache(self, batch=1, dtype=torch.float32):
            c = self.config
            z = torch.zeros((batch, c.num_kv_heads, 0, c.head_dim), dtype=dtype)
            return z, z.clone()

        def forward(self, embeds, hidden, position_ids, past_k, past_v, mask=None):
            h, k, v = self.midlayer(embeds, hidden, position_ids, past_k, past_v, mask)
            return self.lm_head(self.norm(h)).float(), h, k, v

        def target_ids(self):
            return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    return Eagle3Head


def new_head(cfg: HeadConfig):
    return _torch_modules()(cfg)


def load_head(head_dir: Path):
    """(torch head, config) from a checkpoint folder in the public layout (model.safetensors)."""
    from safetensors.torch import load_file

    head_dir = Path(head_dir)
    cfg = read_head_config(head_dir)
    files = sorted(head_dir.glob("*.safetensors"))
    if not files:
        raise ModelError(f"EAGLE-3 head {head_dir}: expected model.safetensors, found none")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    state.pop("embed_tokens.weight", None)  # the target's embedding is used
    state = {k.replace("layers.0.", "midlayer.") if k.startswith("layers.0.") else k: v for k, v in state.items()}
    head = new_head(cfg)
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [m for m in missing if m not in ("t2d",)]
    if missing or unexpected:
        raise ModelError(f"EAGLE-3 head {head_dir}: expected the public layout, found missing "
                         f"{missing[:4]} and unexpected {unexpected[:4]} tensors")
    if "t2d" not in state:
        t2d = head.t2d.clone().zero_()
        t2d[head.target_ids()] = True
        head.t2d.copy_(t2d)
    check_vocab_map(head.d2t.numpy(), head.t2d.numpy(), cfg, str(head_dir))
    return head.eval(), cfg


def save_head(head, out_dir: Path) -> None:
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(head.config.to_dict(), indent=2) + "\n")


def target_aux_hidden(model, input_ids, layer_ids):
    """[b, s, 3H]: the target's aux hidden states, from transformers' output_hidden_states."""
    import torch

    out = model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
    return torch.cat([out.hidden_states[i] for i in layer_ids], dim=-1), out.logits


#: The head graph's KV-cache layouts: "batched" (bundler.onnx.eagle3_graph: in place, what bundles ship)
#: or "concat" (present = Concat(past, new), a copy of the cache each step: older bundles' head, benchmarks).
HEAD_LAYOUTS = ("batched", "concat")
#: bundle.head_batch of a batched head whose batch axis carries slots (heads made before it fix batch 1)
HEAD_BATCH = "slots"


def export_head_onnx(head_dir: Path, target_dir: Path, out_dir: Path, *, kv_cache: str = "batched") -> dict:
    """Write out_dir/eagle3.onnx(+.data): one step of the head with its own KV cache.

    kv_cache="batched": the in-place graph of bundler.onnx.eagle3_graph (a fixed [slots, kv, capacity, hd]
    buffer bound as past and present, plus write_indices and a boolean attention_mask, every batch row a
    slot: metadata bundle.head_batch "slots"); "concat"
    (the same module's other layout, elementary ops) one whose cache grows by a copy each step:

        inputs   input_ids [1, s] int64            tokens t + 1 for each row
                 target_hidden_states [1, st, 3H]  rows whose feature is fc(target aux), first
                 draft_hidden_states [1, sd, H]    rows whose feature is the head's own output (s = st + sd)
                 position_ids [1, s] int64
                 past_key_values.0.key / .value [1, kv_heads, past, head_dim]
        outputs  logits [1, s, vocab] float32      the draft vocabulary scattered to target ids (d2t);
                                                  ids outside it get -inf, i.e. q = 0
                 hidden_states [1, s, H]           the pre-norm output that feeds the next step
                 present.0.key / .value            past + new
    The embedding is the target's, copied in (the graph is self-contained). Returns the metadata written.
    """
    import torch
    from safetensors.torch import load_file

    if kv_cache not in HEAD_LAYOUTS:
        raise ModelError(f"expected an EAGLE-3 head layout in {', '.join(HEAD_LAYOUTS)}, found {kv_cache!r}")
    head, cfg = load_head(head_dir)
    target_cfg = read_config(Path(target_dir))
    layer_ids = check_against_target(cfg, target_cfg, str(head_dir))
    embed = None
    for f in sorted(Path(target_dir).glob("*.safetensors")):
        t = load_file(str(f))
        for name in ("model.embed_tokens.weight", "embed_tokens.weight"):
            if name in t:
                embed = t[name].float()
    if embed is None:
        raise ModelError(f"target {target_dir}: expected model.embed_tokens.weight, found none")

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"bundle.format": "eagle3-head-v1", "bundle.kv_cache": kv_cache, "bundle.num_layers": "1",
            "bundle.num_kv_heads": str(cfg.num_kv_heads), "bundle.head_dim": str(cfg.head_dim),
            "bundle.hidden_size": str(cfg.hidden_size), "bundle.target_hidden_size": str(cfg.target_hidden_size),
            "bundle.vocab_size": str(cfg.vocab_size), "bundle.draft_vocab_size": str(cfg.draft_vocab_size),
            "bundle.max_positions": str(cfg.max_positions),
            "bundle.aux_hidden_state_layer_ids": ",".join(map(str, layer_ids))}
    if kv_cache == "batched":  # rows are slots: one head run drafts for all (runtime.serve.eagle3_slots)
        from bundler.onnx.inplace import BATCHED_HEADROOM

        meta.update({"bundle.head_batch": HEAD_BATCH, "bundle.kv_headroom": str(BATCHED_HEADROOM)})
    from bundler.onnx.eagle3_graph import build_head_graph

    graph, weights = out_dir / GRAPH_NAME, out_dir / WEIGHTS_NAME
    try:
        with torch.no_grad():
            build_head_graph(head, embed.numpy(), graph, weights, meta, kv_cache)
    except BaseException:  # no half-written graph that looks complete
        graph.unlink(missing_ok=True)
        weights.unlink(missing_ok=True)
        raise
    return meta


def export_head(head_dir: Path, target_dir: Path, out_dir: Path):
    """export_head_onnx as a bundler.onnx.export.ExportResult, so the engines code packs it like any graph."""
    from bundler.onnx.export import ExportResult

    meta = export_head_onnx(head_dir, target_dir, out_dir)
    out_dir = Path(out_dir)
    return ExportResult(out_dir / GRAPH_NAME, out_dir / WEIGHTS_NAME, "eagle3", ARCHITECTURES[0], 1,
                        int(meta["bundle.num_kv_heads"]), int(meta["bundle.head_dim"]), int(meta["bundle.vocab_size"]),
                        int(meta["bundle.max_positions"]), 24, meta["bundle.kv_cache"], "float32")
