"""Structured-output cost: llguidance token masks per step, and constrained serving on the demo pair.

Part 1, mask cost (the grammar engine alone): time to compute one next-token mask for a JSON schema, a
regex and a choice, over the demo's 512-token vocabulary and over byte-level BPE vocabularies of 32k and
128k tokens trained here on the CPython standard library (no download; a Llama-3-sized vocabulary is
128k). Baseline in the same run: one decode step of the demo target (what the mask is added to).

Part 2, serving (the demo pair, greedy, 3 draft tokens): tokens/s of one JSON-schema answer with plain
decoding and with speculative decoding, against the same prompt unconstrained; and acceptance, to show
the mask composes with speculation (same output, drafts still accepted).

    .venv/bin/python benchmarks/bench_grammar.py [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA = {"type": "object", "properties": {
    "status": {"enum": ["ok", "degraded", "down"]}, "line": {"type": "integer", "minimum": 1, "maximum": 12},
    "note": {"type": "string", "maxLength": 40}}, "required": ["status", "line", "note"],
    "additionalProperties": False}


def train_vocab(size: int, out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from bundler.demo.corpus import read_source, stdlib_files, stdlib_root

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=["<|end|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [t for t in (read_source(p) for p in stdlib_files(stdlib_root())) if t]
    tok.train_from_iterator(texts, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    return out


def mask_times(tokenizer_dir: Path, spec, steps: int, rng) -> tuple[float, int]:
    """Median ms per mask along random valid walks; and the vocabulary size."""
    from runtime.serve.grammar import GrammarCompiler
    from runtime.serve.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer_dir)
    compiler = GrammarCompiler.for_tokenizer(tok)
    times, done = [], 0
    while done < steps:
        c, out = compiler.compile(spec).constraint(), []
        for _ in range(200):
            t = time.perf_counter()
            allowed = c.allowed(out)
            times.append(time.perf_counter() - t)
            done += 1
            ids = [i for i in np.flatnonzero(allowed) if i not in tok.eos_token_ids]
            if not ids or done >= steps:
                break
            out.append(int(rng.choice(ids)))
    return statistics.median(times) * 1e3, tok.vocab_size


def serve_row(gen, tok, prompt, processor, max_tokens=96, eos=True):
    from runtime.serve.sampling import SamplingParams

    gen.reset()
    gen.stats.__init__()
    t = time.perf_counter()
    steps = list(gen.generate(prompt, SamplingParams(temperature=0), max_tokens=max_tokens,
                              eos_ids=tok.eos_token_ids if eos else (),
                              logits_processors=(processor,) if processor is not None else ()))
    dt = time.perf_counter() - t
    out = [x for s in steps for x in s.tokens]
    return out, len(out) / dt, gen.stats.acceptance_rate


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    from bundler.demo import DEMO_DRAFT_DIR, DEMO_TARGET_DIR
    from bundler.onnx.export import export_onnx
    from runtime.engines.onnxruntime import OnnxRuntimeEngine
    from runtime.serve.grammar import GrammarCompiler, GrammarSpec
    from runtime.serve.logits_process import LogitsProcessor
    from runtime.serve.generator import Generator
    from runtime.serve.tokenizer import Tokenizer

    rng = np.random.default_rng(0)
    specs = {"json schema": GrammarSpec("json_schema", SCHEMA), "regex": GrammarSpec("regex", r"(PASS|FAIL)-[0-9]{4}"),
             "choice": GrammarSpec("choice", ["stop", "continue", "escalate"])}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        vocabs = {"demo (512)": Path(DEMO_TARGET_DIR)}
        for size in (32000, 128000):
            vocabs[f"BPE {size // 1000}k"] = train_vocab(size, tmp / f"v{size}")
        target = export_onnx(DEMO_TARGET_DIR, tmp / "t").files[0]
        draft = export_onnx(DEMO_DRAFT_DIR, tmp / "d").files[0]
        t_engine = OnnxRuntimeEngine(target, max_context=512, threads=1)
        d_engine = OnnxRuntimeEngine(draft, max_context=512, threads=1)
        t_engine.forward(list(range(5, 69)))
        step = []
        for i in range(64):
            t = time.perf_counter()
            t_engine.forward([5 + i])
            step.append(time.perf_counter() - t)
        t_engine.reset()
        print("\nMask cost (median ms per next-token mask; baseline: one demo target decode step "
              f"= {statistics.median(step) * 1e3:.3f} ms)\n")
        print("| vocabulary | " + " | ".join(specs) + " |")
        print("|---|" + "---|" * len(specs))
        for name, d in vocabs.items():
            cells = [f"{mask_times(d, spec, args.steps, rng)[0]:.3f}" for spec in specs.values()]
            print(f"| {name} | " + " | ".join(cells) + " |")

        tok = Tokenizer(DEMO_TARGET_DIR)
        compiler = GrammarCompiler.for_tokenizer(tok, t_engine.vocab_size)
        prompt = tok.encode("<|user|>\nReport the state of line 3 as JSON.<|end|>\n<|assistant|>\n",
                            add_special_tokens=False)
        json_len = len(serve_row(Generator(t_engine), tok, prompt,
                                 LogitsProcessor(grammar=compiler.compile(specs["json schema"]).constraint()))[0])
        print(f"\nServing (demo pair, one thread per engine, greedy, {json_len} tokens each: the JSON answer's "
              "length; free text ignores the end token; median of 7)\n")
        print("| decoding | output | tok/s | acceptance |")
        print("|---|---|---|---|")
        outputs = {}
        for method, dr in (("none", None), ("draft_model", d_engine)):
            gen = Generator(t_engine, dr, method, 3)
            for label, make, eos in (("free text", lambda: None, False),
                                     ("JSON schema", lambda: LogitsProcessor(
                                         grammar=compiler.compile(specs["json schema"]).constraint()), True)):
                runs = [serve_row(gen, tok, prompt, make(), max_tokens=json_len, eos=eos) for _ in range(7)]
                out, _, acc = runs[0]
                outputs[(method, label)] = out
                rate = statistics.median(r[1] for r in runs)
                print(f"| {method} | {label} ({len(out)} tokens) | {rate:.0f} | "
                      f"{'' if method == 'none' else f'{acc:.0%}'} |")
        same = outputs[("none", "JSON schema")] == outputs[("draft_model", "JSON schema")]
        print(f"\nconstrained greedy output identical with and without speculation: {same}")
        print("JSON:", tok.decode(outputs[("draft_model", "JSON schema")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
