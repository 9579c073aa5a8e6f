"""Train the embedded demo pair: a small Llama target and a several-times-smaller Llama draft.

Stages (each a subcommand; `all` runs them in order):
  prepare   corpus from the running Python's standard library -> byte-level BPE -> uint16 token streams
  fit       train the target on text + chat turns (best held-out checkpoint kept), then distil each draft
            candidate from the target: KL(target || draft) plus cross-entropy on the target's argmax, on the
            target's own greedy answers to the training questions and on text; keep the draft checkpoint that
            agrees most with the target on held-out answers
  evaluate  held-out losses and simulated greedy speculative decoding (3 draft tokens) on held-out chat prompts

    python -m bundler.demo.train prepare --data .demo-data              # CPU, one to two minutes
    python -m bundler.demo.train fit --data .demo-data --out .demo-out  # GPU, about 6.5 minutes on one H200
    python -m bundler.demo.train evaluate --target bundler/demo/models/target --draft bundler/demo/models/draft
    python -m bundler.demo.train all --tiny --data /tmp/d --out /tmp/o   # seconds on a CPU: the test suite's run

Seeds are fixed; on a GPU, kernels are not bit-deterministic, so a rerun reproduces the numbers closely,
not exactly. Hyper-parameters live in FULL and TINY below and are written into the output's metrics.json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from bundler.demo import corpus
from bundler.demo import evaluate as ev


@dataclass(frozen=True)
class Shape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int


@dataclass(frozen=True)
class Config:
    vocab_size: int = 4096
    seq_len: int = 512
    target: Shape = Shape(256, 4, 8, 4, 576)
    drafts: tuple[Shape, ...] = (Shape(96, 2, 3, 3, 256), Shape(128, 1, 4, 4, 384))
    batch_size: int = 64
    target_steps: int = 3000
    target_lr: float = 2e-3
    draft_steps: int = 3000
    draft_lr: float = 3e-3
    warmup: int = 200
    weight_decay: float = 0.1
    eval_every: int = 250
    eval_blocks: int = 256          # held-out blocks per stream for losses during training
    qa_fraction: float = 0.2        # share of target training rows taken from chat turns
    distill_mix: tuple[float, float, float] = (0.5, 0.1, 0.4)   # target answers, chat turns, source
    hard_weight: float = 0.0        # + this x cross-entropy on the target's argmax (what greedy acceptance checks)
    answer_tokens: int = 64         # max new tokens for answers and for the acceptance simulation
    max_prompt_tokens: int = 96
    eval_prompts: int = 200
    distill_prompts: int | None = None   # training questions the target answers for the draft (None: all)
    select_prompts: int = 120       # held-out questions (not eval ones) that pick the draft checkpoint
    k: int = 3
    max_files: int | None = None
    heldout_per_mille: int = corpus.HELDOUT_PER_MILLE
    target_seconds: float = 140.0   # safety stops per training stage (one device call is limited to 10 minutes)
    draft_seconds: float = 95.0
    budget_seconds: float = 430.0   # no more optional evaluation after this much of `fit`
    seed: int = 0


# Candidates compared on the GPU (README.md has their numbers). FULL, the committed pair, is v512: a small
# vocabulary makes each token more predictable, which is what greedy acceptance measures.
_SMALL_VOCAB = dict(target=Shape(256, 6, 8, 4, 640), drafts=(Shape(160, 2, 5, 5, 480),), target_steps=2500,
                    draft_steps=4000, distill_mix=(0.6, 0.1, 0.3), hard_weight=0.5, target_seconds=140.0,
                    draft_seconds=170.0)
CONFIGS = {
    "v4096": Config(),
    "v1024": Config(vocab_size=1024, **_SMALL_VOCAB),
    "v512": Config(vocab_size=512, **_SMALL_VOCAB),
}
FULL = CONFIGS["v512"]
TINY = Config(vocab_size=320, seq_len=64, target=Shape(32, 1, 2, 1, 64), drafts=(Shape(16, 1, 1, 1, 32),),
              batch_size=8, target_steps=30, draft_steps=20, warmup=5, eval_every=10, eval_blocks=8,
              answer_tokens=8, eval_prompts=4, distill_prompts=48, select_prompts=6, max_files=12,
              heldout_per_mille=300, target_seconds=60.0, draft_seconds=60.0, target_lr=3e-3)
CONFIGS["tiny"] = TINY


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------- prepare

def select_prompts(rows: list[dict], n: int) -> list[dict]:
    """Round-robin over files so no single large module dominates the held-out questions."""
    by_path: dict[str, list[dict]] = {}
    for row in rows:
        by_path.setdefault(row["path"], []).append(row)
    queues = [by_path[p] for p in sorted(by_path)]
    out: list[dict] = []
    while len(out) < n and any(queues):
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop(0))
    return out


def prepare(data: Path, cfg: Config, stdlib: Path | None = None, tokens: Path | None = None,
            reuse_corpus: bool = False) -> dict:
    """Corpus (DATA/corpus, large), tokenizer and token streams (DATA/tokens or `tokens`: what `fit` reads).

    `reuse_corpus` keeps an existing DATA/corpus, e.g. one extracted from another Python's standard library.
    """
    t0 = time.time()
    if reuse_corpus and (data / "corpus" / "corpus.json").exists():
        stats = corpus.CorpusStats(**json.loads((data / "corpus" / "corpus.json").read_text()))
    else:
        stats = corpus.build_corpus(data / "corpus", stdlib, cfg.max_files, cfg.heldout_per_mille)
    tokens = tokens or data / "tokens"
    tokens.mkdir(parents=True, exist_ok=True)
    corpus.train_tokenizer(data / "corpus", tokens, cfg.vocab_size, cfg.seq_len)
    sizes = corpus.tokenize_corpus(data / "corpus", tokens / "tokenizer.json", tokens)
    heldout = corpus.read_jsonl(data / "corpus" / "qa_heldout.jsonl")
    evaluation = select_prompts(heldout, cfg.eval_prompts)
    chosen = {r["question"] for r in evaluation}
    (tokens / "prompts_heldout.json").write_text(json.dumps(
        [{"question": r["question"], "reference": r["answer"], "path": r["path"]} for r in evaluation], indent=1))
    (tokens / "prompts_select.json").write_text(json.dumps(
        [{"question": r["question"]} for r in heldout if r["question"] not in chosen]))
    (tokens / "prompts_train.json").write_text(json.dumps(
        [{"question": r["question"]} for r in corpus.read_jsonl(data / "corpus" / "qa_train.jsonl")]))
    info = {"corpus": asdict(stats), "tokens": sizes, "seconds": round(time.time() - t0, 1)}
    (tokens / "data.json").write_text(json.dumps(info, indent=2))
    log(f"prepared {info}")
    return info


# ---------------------------------------------------------------- fit

@dataclass
class Data:
    streams: dict[str, np.ndarray]
    tokenizer_dir: Path
    eos: int
    pad: int
    newline: list[int]
    prompts: dict[str, list[list[int]]] = field(default_factory=dict)


def load_data(tokens: Path, cfg: Config) -> Data:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokens / "tokenizer.json"))
    streams = {name: np.load(tokens / f"{name}.npy") for name in
               ("source_train", "qa_train", "source_heldout", "qa_heldout")}
    prompts = {}
    for split in ("train", "select", "heldout"):
        rows = json.loads((tokens / f"prompts_{split}.json").read_text())
        encoded = [tok.encode(corpus.qa_prompt(r["question"]), add_special_tokens=False).ids for r in rows]
        if split == "heldout":   # measured as given, like `evaluate` does with the committed copy
            prompts[split] = encoded
            continue
        limit = {"train": cfg.distill_prompts, "select": cfg.select_prompts}[split]
        prompts[split] = [p for p in encoded if len(p) <= cfg.max_prompt_tokens][:limit]
    return Data(streams, tokens, tok.token_to_id(corpus.END), tok.token_to_id(corpus.ENDOFTEXT),
                tok.encode("\n", add_special_tokens=False).ids, prompts)


def make_model(shape: Shape, cfg: Config, data: Data):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, max_position_embeddings=cfg.seq_len, rope_theta=10000.0,
        bos_token_id=None, eos_token_id=data.eos, pad_token_id=data.pad, tie_word_embeddings=False)
    torch.manual_seed(cfg.seed)
    return LlamaForCausalLM(config)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def sample_rows(rng: np.random.Generator, streams: list[np.ndarray], mix, batch: int, seq_len: int) -> np.ndarray:
    which = rng.choice(len(streams), size=batch, p=np.asarray(mix) / sum(mix))
    rows = []
    for w in which:
        s = streams[w]
        start = int(rng.integers(0, len(s) - seq_len - 1))
        rows.append(s[start:start + seq_len + 1])
    return np.stack(rows).astype(np.int64)


def lr_at(step: int, total: int, warmup: int, peak: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _optimizer(model, cfg: Config, lr: float):
    import torch

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95), eps=1e-8)


def _autocast(device: str):
    import contextlib

    import torch

    return torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else contextlib.nullcontext()


def heldout(model, data: Data, cfg: Config) -> dict[str, float]:
    model.eval()
    out = {kind: round(ev.heldout_loss(model, data.streams[f"{kind}_heldout"], seq_len=cfg.seq_len,
                                       max_blocks=cfg.eval_blocks), 4) for kind in ("source", "qa")}
    model.train()
    return out


def train_target(data: Data, cfg: Config, device: str) -> tuple[object, list[dict]]:
    import torch
    import torch.nn.functional as F

    model = make_model(cfg.target, cfg, data).to(device).train()
    log(f"target: {n_params(model):,} parameters {cfg.target}")
    opt = _optimizer(model, cfg, cfg.target_lr)
    rng = np.random.default_rng(cfg.seed)
    streams = [data.streams["qa_train"], data.streams["source_train"]]
    mix = (cfg.qa_fraction, 1 - cfg.qa_fraction)
    best, best_state, history, t0 = math.inf, None, [], time.time()
    for step in range(cfg.target_steps + 1):
        if step % cfg.eval_every == 0 or step == cfg.target_steps:
            losses = heldout(model, data, cfg)
            score = (losses["source"] + losses["qa"]) / 2
            history.append({"step": step, **losses, "seconds": round(time.time() - t0, 1)})
            log(f"target step {step}: held-out {losses}")
            if score < best:
                best, best_state = score, {k: v.detach().clone() for k, v in model.state_dict().items()}
            if step == cfg.target_steps or time.time() - t0 > cfg.target_seconds:
                break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg.target_steps, cfg.warmup, cfg.target_lr)
        x = torch.from_numpy(sample_rows(rng, streams, mix, cfg.batch_size, cfg.seq_len)).to(device)
        with _autocast(device):
            logits = model(x[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    model.load_state_dict(best_state)
    return model.eval(), history


def answer_stream(target, prompts: list[list[int]], data: Data, cfg: Config) -> tuple[np.ndarray, list[list[int]]]:
    """The target's own greedy answers, as chat turns back to back (the draft learns what the target says)."""
    answers = ev.greedy_generate(target, prompts, max_new_tokens=cfg.answer_tokens, eos_ids={data.eos})
    ids: list[int] = []
    for p, a in zip(prompts, answers):
        ids.extend(p + a + ([] if a and a[-1] == data.eos else [data.eos]) + data.newline)
    return np.asarray(ids, dtype=np.int64), answers


def agreement(draft, target, prompts: list[list[int]], answers: list[list[int]], device: str) -> float:
    """Share of answer positions where the draft's argmax equals the target's (teacher-forced on its answers)."""
    import torch

    same = total = 0
    with torch.inference_mode():
        for p, a in zip(prompts, answers):
            x = torch.tensor([p + a], device=device)
            lo = len(p) - 1
            t = target(x, use_cache=False).logits[0, lo:-1].argmax(-1)
            d = draft(x, use_cache=False).logits[0, lo:-1].argmax(-1)
            same += int((t == d).sum())
            total += len(a)
    return same / max(1, total)


def distill_draft(shape: Shape, target, data: Data, gen_stream: np.ndarray, select, cfg: Config,
                  device: str) -> tuple[object, list[dict]]:
    import torch
    import torch.nn.functional as F

    draft = make_model(shape, cfg, data).to(device).train()
    log(f"draft: {n_params(draft):,} parameters {shape}")
    opt = _optimizer(draft, cfg, cfg.draft_lr)
    rng = np.random.default_rng(cfg.seed + 1)
    streams = [gen_stream, data.streams["qa_train"], data.streams["source_train"]]
    best, best_state, history, t0 = -1.0, None, [], time.time()
    for step in range(cfg.draft_steps + 1):
        if step % cfg.eval_every == 0 or step == cfg.draft_steps:
            draft.eval()
            agree = agreement(draft, target, *select, device)
            draft.train()
            history.append({"step": step, "agreement": round(agree, 4), "seconds": round(time.time() - t0, 1)})
            log(f"draft step {step}: argmax agreement on held-out answers {agree:.4f}")
            if agree > best:
                best, best_state = agree, {k: v.detach().clone() for k, v in draft.state_dict().items()}
            if step == cfg.draft_steps or time.time() - t0 > cfg.draft_seconds:
                break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg.draft_steps, cfg.warmup, cfg.draft_lr)
        x = torch.from_numpy(sample_rows(rng, streams, cfg.distill_mix, cfg.batch_size, cfg.seq_len)).to(device)
        with torch.no_grad(), _autocast(device):
            teacher = target(x[:, :-1], use_cache=False).logits
        with _autocast(device):
            student = draft(x[:, :-1], use_cache=False).logits
        v = student.shape[-1]
        student = student.float().reshape(-1, v)
        teacher = teacher.float().reshape(-1, v)
        loss = F.kl_div(F.log_softmax(student, -1), F.log_softmax(teacher, -1), log_target=True, reduction="batchmean")
        if cfg.hard_weight:
            loss = loss + cfg.hard_weight * F.cross_entropy(student, teacher.argmax(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
    draft.load_state_dict(best_state)
    return draft.eval(), history


def save_checkpoint(model, data: Data, out: Path) -> Path:
    """Hugging Face layout, fp32 weights: config, generation config, tokenizer files, model.safetensors."""
    import torch

    if out.exists():
        shutil.rmtree(out)
    model.to("cpu", dtype=torch.float32).save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(data.tokenizer_dir / name, out / name)
    generation = {"bos_token_id": None, "eos_token_id": data.eos, "pad_token_id": data.pad, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out


def fit(tokens: Path, out: Path, cfg: Config, device: str | None = None) -> dict:
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    t_start = time.time()
    data = load_data(tokens, cfg)
    out.mkdir(parents=True, exist_ok=True)
    metrics: dict = {"config": asdict(cfg), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                     "torch": torch.__version__, "python": sys.version.split()[0]}
    target, metrics["target_history"] = train_target(data, cfg, device)
    save_checkpoint(target, data, out / "target")
    target.to(device)
    metrics["target_seconds"] = round(time.time() - t_start, 1)
    t = time.time()
    gen_stream, _ = answer_stream(target, data.prompts["train"], data, cfg)
    select_answers = ev.greedy_generate(target, data.prompts["select"], max_new_tokens=cfg.answer_tokens,
                                        eos_ids={data.eos})
    metrics["answer_seconds"] = round(time.time() - t, 1)
    log(f"target answered {len(data.prompts['train'])} training questions ({len(gen_stream):,} tokens)")
    select = (data.prompts["select"], select_answers)
    metrics["drafts"] = []
    best = None
    for i, shape in enumerate(cfg.drafts):
        t = time.time()
        draft, history = distill_draft(shape, target, data, gen_stream, select, cfg, device)
        score = max(h["agreement"] for h in history)
        name = f"draft{i}"
        save_checkpoint(draft, data, out / name)
        draft.to(device)
        entry = {"name": name, "shape": asdict(shape), "parameters": n_params(draft), "agreement": score,
                 "history": history, "seconds": round(time.time() - t, 1)}
        metrics["drafts"].append(entry)
        if best is None or score > best[0]:
            best = (score, name)
    metrics["chosen_draft"] = best[1]
    metrics["train_seconds"] = round(time.time() - t_start, 1)
    log(f"trained in {metrics['train_seconds']} s; chosen {best[1]}")
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    prompts = data.prompts["heldout"]
    metrics["heldout_loss"] = {"target": measure_losses(target, data, cfg)}
    order = [best[1]] + [d["name"] for d in metrics["drafts"] if d["name"] != best[1]]
    metrics["acceptance"] = {}
    for name in order:
        if name != best[1] and time.time() - t_start > cfg.budget_seconds:
            log(f"skipping the evaluation of {name}: over the time budget")
            continue
        t = time.time()
        draft = load_checkpoint(out / name, device)
        metrics["heldout_loss"][name] = measure_losses(draft, data, cfg)
        acc = ev.greedy_acceptance(target, draft, prompts, k=cfg.k, max_new_tokens=cfg.answer_tokens,
                                   eos_ids={data.eos})
        metrics["acceptance"][name] = {**acc.to_dict(), "seconds": round(time.time() - t, 1)}
        log(f"{name}: held-out {metrics['heldout_loss'][name]}; acceptance {metrics['acceptance'][name]}")
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    metrics["total_seconds"] = round(time.time() - t_start, 1)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    log(f"target held-out {metrics['heldout_loss']['target']}; done in {metrics['total_seconds']} s")
    return metrics


def measure_losses(model, data: Data, cfg: Config) -> dict[str, float]:
    """Held-out cross-entropy over every full block of each held-out stream."""
    return {kind: round(ev.heldout_loss(model, data.streams[f"{kind}_heldout"], seq_len=cfg.seq_len,
                                        max_blocks=10**9), 4) for kind in ("source", "qa")}


def load_checkpoint(path: Path, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()


# ---------------------------------------------------------------- evaluate

def evaluate_pair(target_dir: Path, draft_dir: Path, prompts: list[str], *, tokens: Path | None = None,
                  cfg: Config = FULL) -> dict:
    """Held-out losses (if token streams are given) and greedy acceptance at cfg.k draft tokens."""
    t0 = time.time()
    target, draft, tok = ev.load_pair(target_dir, draft_dir)
    eos = ev.eos_ids_of(target_dir)
    encoded = [tok.encode(corpus.qa_prompt(q), add_special_tokens=False).ids for q in prompts]
    result: dict = {"target_parameters": n_params(target), "draft_parameters": n_params(draft)}
    if tokens is not None:
        for role, model in (("target", target), ("draft", draft)):
            result[f"{role}_heldout_loss"] = {
                kind: round(ev.heldout_loss(model, np.load(tokens / f"{kind}_heldout.npy"), seq_len=cfg.seq_len,
                                            max_blocks=10**9), 4) for kind in ("source", "qa")}
    acc = ev.greedy_acceptance(target, draft, encoded, k=cfg.k, max_new_tokens=cfg.answer_tokens, eos_ids=eos)
    result["acceptance"] = acc.to_dict()
    result["seconds"] = round(time.time() - t0, 1)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bundler.demo.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["prepare", "fit", "evaluate", "all"])
    ap.add_argument("--tiny", action="store_true", help="a seconds-long CPU configuration (tests)")
    ap.add_argument("--config", choices=sorted(CONFIGS), default=None, help="a named configuration (default: FULL)")
    ap.add_argument("--tokens", type=Path, default=None, help="token streams folder (default: DATA/tokens)")
    ap.add_argument("--reuse-corpus", action="store_true", help="prepare: keep an existing DATA/corpus")
    ap.add_argument("--data", type=Path, default=Path(".demo-data"), help="prepare's output; fit reads DATA/tokens")
    ap.add_argument("--out", type=Path, default=Path(".demo-out"), help="fit's checkpoints and metrics.json")
    ap.add_argument("--stdlib", type=Path, default=None, help="standard library folder (default: this Python's)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--target", type=Path, help="evaluate: target checkpoint")
    ap.add_argument("--draft", type=Path, help="evaluate: draft checkpoint")
    ap.add_argument("--prompts", type=Path, help="evaluate: JSON list of {question} (default: the committed ones)")
    ap.add_argument("--limit", type=int, default=None, help="evaluate: only the first N prompts")
    args = ap.parse_args(argv)
    cfg = TINY if args.tiny else CONFIGS[args.config] if args.config else FULL
    tokens = args.tokens or args.data / "tokens"
    if args.stage in ("prepare", "all"):
        prepare(args.data, cfg, args.stdlib, tokens, args.reuse_corpus)
    if args.stage in ("fit", "all"):
        fit(tokens, args.out, cfg, args.device)
    if args.stage == "evaluate":
        from bundler.demo import HELDOUT_PROMPTS

        rows = json.loads((args.prompts or HELDOUT_PROMPTS).read_text())[:args.limit]
        print(json.dumps(evaluate_pair(args.target, args.draft, [r["question"] for r in rows],
                                       tokens=tokens if (tokens / "source_heldout.npy").exists() else None,
                                       cfg=cfg), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
