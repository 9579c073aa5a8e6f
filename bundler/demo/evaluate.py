"""Measure the demo pair: held-out loss, and greedy acceptance as a speculative decoder would see it.

The acceptance number is a simulation of exactly what the runtime does in greedy mode: the draft proposes
k tokens one at a time from the accepted text, the target scores the text plus all k in one pass, proposals
are accepted while they equal the target's argmax, and the target's own next token is appended. Every forward
pass re-reads the whole sequence (no KV cache), so nothing here depends on a cache implementation.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class Acceptance:
    prompts: int
    drafted: int
    accepted: int
    target_passes: int
    generated: int
    k: int

    @property
    def rate(self) -> float:
        """accepted / drafted: vLLM's acceptance rate."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.generated / self.target_passes if self.target_passes else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "rate": round(self.rate, 4), "tokens_per_pass": round(self.tokens_per_pass, 3)}


def _logits(model, ids: Sequence[int]):
    import torch

    device = next(model.parameters()).device
    return model(torch.tensor([list(ids)], device=device), use_cache=False).logits[0].float()


def speculate_one(target, draft, prompt: Sequence[int], *, k: int, max_new_tokens: int,
                  eos_ids: set[int]) -> tuple[list[int], int, int, int]:
    """Greedy speculative decoding of one prompt: (new tokens, drafted, accepted, target passes)."""
    import torch

    seq = list(prompt)
    out: list[int] = []
    drafted = accepted = passes = 0
    with torch.inference_mode():
        while len(out) < max_new_tokens:
            proposal: list[int] = []
            for _ in range(min(k, max_new_tokens - len(out) - 1)):
                t = int(_logits(draft, seq + proposal)[-1].argmax())
                proposal.append(t)
                if t in eos_ids:
                    break
            verified = _logits(target, seq + proposal)[len(seq) - 1:].argmax(-1).tolist()
            passes += 1
            n = 0
            while n < len(proposal) and proposal[n] == verified[n]:
                n += 1
            drafted += len(proposal)
            accepted += n
            new = proposal[:n] + [verified[n]]
            for t in new:
                out.append(t)
                seq.append(t)
                if t in eos_ids or len(out) >= max_new_tokens:
                    return out, drafted, accepted, passes
    return out, drafted, accepted, passes


def greedy_acceptance(target, draft, prompts: Sequence[Sequence[int]], *, k: int = 3, max_new_tokens: int = 64,
                      eos_ids: set[int]) -> Acceptance:
    drafted = accepted = passes = generated = 0
    for prompt in prompts:
        out, d, a, p = speculate_one(target, draft, prompt, k=k, max_new_tokens=max_new_tokens, eos_ids=eos_ids)
        drafted += d
        accepted += a
        passes += p
        generated += len(out)
    return Acceptance(len(prompts), drafted, accepted, passes, generated, k)


def greedy_generate(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, eos_ids: set[int],
                    batch_size: int = 256) -> list[list[int]]:
    """Plain greedy answers for many prompts. Prompts of equal length are batched, so no padding is needed."""
    import torch

    device = next(model.parameters()).device
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    answers: list[list[int]] = [[] for _ in prompts]
    with torch.inference_mode():
        for length in sorted(by_len):
            idx = by_len[length]
            for start in range(0, len(idx), batch_size):
                chunk = idx[start:start + batch_size]
                ids = torch.tensor([list(prompts[i]) for i in chunk], device=device)
                done = torch.zeros(len(chunk), dtype=torch.bool, device=device)
                for _ in range(max_new_tokens):
                    nxt = model(ids, use_cache=False).logits[:, -1].float().argmax(-1)
                    ids = torch.cat([ids, nxt[:, None]], dim=1)
                    done |= torch.isin(nxt, torch.tensor(sorted(eos_ids), device=device))
                    if bool(done.all()):
                        break
                for row, i in enumerate(chunk):
                    ans: list[int] = []
                    for t in ids[row, length:].tolist():
                        ans.append(t)
                        if t in eos_ids:
                            break
                    answers[i] = ans
    return answers


def heldout_loss(model, ids: np.ndarray, *, seq_len: int, max_blocks: int, batch_size: int = 32) -> float:
    """Mean next-token cross-entropy (nats) over consecutive non-overlapping blocks of a held-out stream."""
    import torch
    import torch.nn.functional as F

    device = next(model.parameters()).device
    if len(ids) < 2:
        raise ValueError(f"a held-out stream needs at least 2 tokens, found {len(ids)}")
    seq_len = min(seq_len, len(ids) - 1)
    n_blocks = min(max_blocks, (len(ids) - 1) // seq_len)
    total, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, n_blocks, batch_size):
            rows = [ids[b * seq_len:b * seq_len + seq_len + 1] for b in range(start, min(n_blocks, start + batch_size))]
            x = torch.from_numpy(np.stack(rows).astype(np.int64)).to(device)
            logits = model(x[:, :-1], use_cache=False).logits.float()
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
            total += float(loss)
            count += x[:, 1:].numel()
    return total / count


def load_pair(target_dir: Path, draft_dir: Path):
    """Both checkpoints in fp32 on the CPU, in eval mode, plus the shared tokenizer (tokenizers.Tokenizer)."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    models = [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in (target_dir, draft_dir)]
    return models[0], models[1], Tokenizer.from_file(str(Path(target_dir) / "tokenizer.json"))


def eos_ids_of(checkpoint: Path) -> set[int]:
    eos = json.loads((Path(checkpoint) / "generation_config.json").read_text())["eos_token_id"]
    return set(eos if isinstance(eos, list) else [eos])
