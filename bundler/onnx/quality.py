"""The quality of a quantized target, measured against the unquantized one on held-out text (build host).

Both graphs run on ONNX Runtime's CPU provider here, one after the other over the same tokens:

- perplexity of each over the text (teacher-forced, chunks of at most `max_context` tokens; the first
  token of a chunk is not scored), and the relative increase (quantized / reference - 1);
- top-1 agreement: the share of those positions where both graphs' argmax is the same token;
- greedy agreement over a fixed set of prompts (the text's segments' first tokens, or the demo's held-out
  questions): each prompt continued greedily for `new_tokens` tokens by both, scored by how much of the
  reference continuation the quantized one reproduces before it first differs, averaged over prompts.

The text is `--calibration-text FILE`, else the demo pair's held-out split (its held-out questions and
reference answers) for the demo pair, else BUILTIN_TEXT. The record names which and its sha256.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from manifests.errors import ModelError, UsageError
from manifests.limits import LIMITS

#: Tokens scored for perplexity, at most: enough for a figure stable to about a percent, small enough
#: that create measures an 8B model on a build host's CPU in minutes.
MAX_TOKENS = 2048
MAX_CHUNK = 256
PROMPTS = 8
PROMPT_TOKENS = 16
NEW_TOKENS = 24

#: Held-out text of this tool's own, for a model given no --calibration-text: plain English prose and a
#: little Python, the two kinds of text the bundles serve.
BUILTIN_TEXT = """\
The river ran high that spring, and the ferry stopped for nine days. The village on the far bank sent its \
letters across on a rope, tied in oilcloth, and the schoolteacher read them aloud in the square each evening.
A device on the factory floor has no network. It boots, checks the signature of the software it was given, \
and serves answers to the machines around it until the next update arrives on a stick.
Measure twice and cut once: a board that is too short cannot be made longer, but one that is too long can \
always be trimmed. The same holds for budgets, schedules and most promises.
def moving_average(values, window):
    \"\"\"The mean of each run of `window` consecutive values.\"\"\"
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    out = [total / window]
    for old, new in zip(values, values[window:]):
        total += new - old
        out.append(total / window)
    return out
When the first frost comes, the gardeners lift the dahlias, shake the soil from their tubers and store them \
in boxes of dry sand in a cool cellar, where they wait, unseen, until the ground warms again in May.
class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, key):
        self.counts[key] = self.counts.get(key, 0) + 1
        return self.counts[key]
The committee met on Thursday and agreed on three things: the bridge would be repaired before winter, the \
cost would be shared by the two towns it joins, and nobody would mention the matter of the missing survey.
"""


@dataclass(frozen=True)
class HeldOut:
    """What the measurement reads: texts (scored), prompts (continued greedily), and where they came from."""

    texts: tuple[str, ...]
    prompts: tuple[str, ...]
    name: str  # "built-in", "demo held-out split", or the file's name
    sha256: str


def held_out(calibration_text: str | None, demo: bool) -> HeldOut:
    """--calibration-text FILE, else the demo pair's held-out split (demo), else BUILTIN_TEXT."""
    if calibration_text is not None:
        path = Path(calibration_text)
        if not path.is_file():
            raise UsageError(f"expected --calibration-text {path} to be a text file, found "
                             f"{'nothing' if not path.exists() else 'something else'}")
        raw = path.open("rb").read(LIMITS.calibration_text_bytes)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UsageError(f"expected --calibration-text {path} in UTF-8, found a bad byte at {e.start}") from None
        texts = tuple(t for t in text.split("\n\n") if t.strip()) or (text,)
        if not text.strip():
            raise UsageError(f"expected held-out text in --calibration-text {path}, found an empty file")
        return HeldOut(texts, _prompts_from(texts), path.name, hashlib.sha256(raw).hexdigest())
    if demo:
        import json

        from bundler import demo as demo_pkg
        from bundler.demo.corpus import qa_prompt, render_chat

        items = json.loads(Path(demo_pkg.HELDOUT_PROMPTS).read_text(encoding="utf-8"))
        texts = tuple(render_chat([{"role": "user", "content": q["question"]},
                                   {"role": "assistant", "content": q["reference"]}]) for q in items)
        prompts = tuple(qa_prompt(q["question"]) for q in items[:PROMPTS])
        return HeldOut(texts, prompts, "demo held-out split",
                       hashlib.sha256("\0".join(texts).encode()).hexdigest())
    texts = tuple(t for t in BUILTIN_TEXT.split("\n") if t.strip())
    return HeldOut(texts, _prompts_from(texts), "built-in", hashlib.sha256(BUILTIN_TEXT.encode()).hexdigest())


def _prompts_from(texts: Sequence[str]) -> tuple[str, ...]:
    """The first PROMPTS segments as prompts (cut to their first tokens by `measure`)."""
    return tuple(texts[:PROMPTS])


def _engine(graph: Path, max_context: int):
    from runtime.engines.onnxruntime import OnnxRuntimeEngine

    return OnnxRuntimeEngine(graph, max_context=max_context, num_slots=1, allow_spinning=False)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _score(engine, chunks: Sequence[Sequence[int]]) -> tuple[float, int, list[np.ndarray]]:
    """(total negative log-likelihood, tokens scored, each chunk's argmax) of teacher-forced chunks."""
    from runtime.engines.base import Row

    nll, count, argmaxes = 0.0, 0, []
    for ids in chunks:
        engine.rollback(0, 0)
        logits = engine.forward([Row(0, list(ids))])[0]
        lp = _log_softmax(logits[:-1])
        nll -= float(lp[np.arange(len(ids) - 1), np.asarray(ids[1:])].sum())
        count += len(ids) - 1
        argmaxes.append(logits.argmax(-1))
    return nll, count, argmaxes


def _greedy(engine, prompt: Sequence[int], new: int) -> list[int]:
    from runtime.engines.base import Row

    engine.rollback(0, 0)
    out, logits = [], engine.forward([Row(0, list(prompt), "last")])[0]
    for _ in range(new):
        if engine.length(0) >= engine.max_context:
            break
        token = int(logits[-1].argmax())
        out.append(token)
        logits = engine.forward([Row(0, [token])])[0]
    return out


def _chunks(tokenizer, texts: Sequence[str], max_context: int) -> list[list[int]]:
    size = min(MAX_CHUNK, max_context)
    out, total = [], 0
    for text in texts:
        ids = tokenizer.encode(text)
        for i in range(0, len(ids), size):
            piece = ids[i:i + size]
            if len(piece) >= 2 and total < MAX_TOKENS:
                piece = piece[:MAX_TOKENS - total + 1]
                out.append(piece)
                total += len(piece) - 1
    if not out:
        raise UsageError("expected held-out text of at least 2 tokens, found less")
    return out


def measure(reference: Path, quantized: Path, tokenizer_dir: Path, held: HeldOut, *,
            max_context: int = 512) -> dict:
    """The quality record (JSON-ready, what the signed engine record carries) of `quantized` against
    `reference`, two graphs of the same model: perplexities, increase, top-1 and greedy agreement."""
    from runtime.serve.tokenizer import Tokenizer

    tokenizer = Tokenizer(Path(tokenizer_dir))
    chunks = _chunks(tokenizer, held.texts, max_context)
    prompts = [tokenizer.encode(p)[:PROMPT_TOKENS] if held.name != "demo held-out split" else tokenizer.encode(p)
               for p in held.prompts]
    prompts = [p for p in prompts if 0 < len(p) < max_context - 1]
    results = []
    for graph in (reference, quantized):
        engine = _engine(Path(graph), max_context)
        try:
            nll, count, argmax = _score(engine, chunks)
            continuations = [_greedy(engine, p, min(NEW_TOKENS, max_context - len(p))) for p in prompts]
        finally:
            engine.close()
        results.append((nll, count, argmax, continuations))
    (ref_nll, count, ref_argmax, ref_cont), (q_nll, _, q_argmax, q_cont) = results
    ppl_ref, ppl_q = math.exp(ref_nll / count), math.exp(q_nll / count)
    if not (math.isfinite(ppl_ref) and math.isfinite(ppl_q)):
        raise ModelError(f"the perplexity of {quantized} or {reference} is not finite ({ppl_q}, {ppl_ref})")
    top1 = float(np.mean(np.concatenate([a[:-1] == b[:-1] for a, b in zip(ref_argmax, q_argmax)])))
    agreement = [_prefix(a, b) / len(a) for a, b in zip(ref_cont, q_cont) if a]
    return {"perplexity_reference": round(ppl_ref, 4), "perplexity": round(ppl_q, 4),
            "relative_increase": round(ppl_q / ppl_ref - 1, 5), "top1_agreement": round(top1, 4),
            "greedy_agreement": round(float(np.mean(agreement)) if agreement else 1.0, 4),
            "greedy_identical": sum(1 for a, b in zip(ref_cont, q_cont) if a == b),
            "prompts": len(prompts), "new_tokens": NEW_TOKENS, "tokens": count,
            "text": held.name, "text_sha256": held.sha256}


def _prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def check_quality(quality: dict, max_loss: float, what: str) -> None:
    """ModelError when the perplexity rose by more than `max_loss` (a fraction), naming the figures."""
    if quality["relative_increase"] > max_loss:
        raise ModelError(f"{what}: 4-bit perplexity {quality['perplexity']:.3f} is "
                         f"{100 * quality['relative_increase']:.1f}% above the unquantized "
                         f"{quality['perplexity_reference']:.3f} on {quality['text']}; expected at most "
                         f"{100 * max_loss:.1f}% (--max-quality-loss), or use --quantization none")
