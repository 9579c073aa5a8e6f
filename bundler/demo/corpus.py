"""The demo pair's training data: the CPython standard library that every Python install carries.

Two kinds of text come out of it, so the models both write Python and answer questions in the chat template:
- every `.py` file's source, for plain language modelling;
- each documented module, class and function as one chat turn: the user asks what `json.dumps(obj, *, ...)`
  does and the assistant answers with the first paragraph of its docstring.
Files are split into train and held-out by a hash of their path, so held-out questions are about code the
models never saw. Nothing is downloaded: the text comes from `sysconfig.get_paths()["stdlib"]` (PSF License).
"""

from __future__ import annotations

import ast
import copy
import hashlib
import json
import re
import sys
import sysconfig
import tokenize
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator
from manifests.limits import LIMITS

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ENDOFTEXT, END = "<|endoftext|>", "<|end|>"
SPECIAL_TOKENS = [ENDOFTEXT, END, "<|system|>", "<|user|>", "<|assistant|>"]
HELDOUT_PER_MILLE = 40          # 4 % of files (and of built-in names), chosen by a hash of the name
MAX_SIGNATURE_CHARS = 120
MAX_ANSWER_CHARS = 400
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class QA:
    question: str
    answer: str
    name: str      # qualified name, e.g. "json.dumps"
    path: str      # file, relative to the standard library root


@dataclass(frozen=True)
class CorpusStats:
    python: str
    stdlib: str
    files: int
    heldout_files: int
    characters: int
    qa_train: int
    qa_heldout: int


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path, max_files: int | None = None) -> list[Path]:
    """Every `.py` file of the standard library (tests included where the install has them), sorted."""
    files = [p for p in sorted(root.rglob("*.py"))
             if not SKIP_DIRS & set(p.relative_to(root).parts) and p.stat().st_size <= LIMITS.corpus_file_bytes]
    return files[:max_files] if max_files else files


def is_heldout(key: str, per_mille: int = HELDOUT_PER_MILLE) -> bool:
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 1000 < per_mille


def module_name(rel_path: str) -> str:
    parts = list(Path(rel_path).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def read_source(path: Path) -> str | None:
    """The file's text in its declared encoding; None for files that are not text (a few test fixtures)."""
    try:
        with tokenize.open(path) as f:
            return f.read()
    except (SyntaxError, UnicodeDecodeError, LookupError):
        return None


def first_paragraph(doc: str) -> str | None:
    para = doc.strip().split("\n\n")[0]
    text = re.sub(r"\s+", " ", para).strip()
    if len(text) > MAX_ANSWER_CHARS:
        text = text[:MAX_ANSWER_CHARS].rsplit(" ", 1)[0] + " ..."
    return text if len(text.split()) >= 3 else None


def signature(node: ast.FunctionDef | ast.AsyncFunctionDef, *, is_method: bool) -> str:
    """The parameter list as written, without annotations, and without a method's `self`/`cls`."""
    args = copy.deepcopy(node.args)
    positional = args.posonlyargs or args.args
    if is_method and positional and positional[0].arg in ("self", "cls"):
        positional.pop(0)
        n_positional = len(args.posonlyargs) + len(args.args)
        if len(args.defaults) > n_positional:
            args.defaults = args.defaults[len(args.defaults) - n_positional:]
    for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg):
        if arg is not None:
            arg.annotation = None
    text = ast.unparse(args)
    if len(text) > MAX_SIGNATURE_CHARS:
        text = text[:MAX_SIGNATURE_CHARS].rsplit(",", 1)[0] + ", ..."
    return text


def extract_qa(source: str, rel_path: str) -> Iterator[QA]:
    """One question per documented module, class, function and method (not nested functions)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    module = module_name(rel_path)
    doc = ast.get_docstring(tree)
    if doc and (answer := first_paragraph(doc)):
        yield QA(f"What is the `{module}` module for?", answer, module, rel_path)

    def visit(body, prefix: str, in_class: bool):
        for node in body:
            if isinstance(node, ast.ClassDef):
                name = f"{prefix}.{node.name}"
                doc = ast.get_docstring(node)
                if doc and (answer := first_paragraph(doc)):
                    yield QA(f"What is the class `{name}` for?", answer, name, rel_path)
                yield from visit(node.body, name, True)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and (answer := first_paragraph(doc)):
                    name = f"{prefix}.{node.name}"
                    yield QA(f"What does `{name}({signature(node, is_method=in_class)})` do?", answer, name, rel_path)

    yield from visit(tree.body, module, False)


def extract_builtin_qa() -> Iterator[QA]:
    """Questions about the modules written in C (builtins, math, itertools, ...), read from the running interpreter.

    Their docstrings exist nowhere as `.py` text, so they are split into train and held-out by qualified name.
    """
    import importlib
    import inspect

    def sig_and_doc(name: str, obj) -> tuple[str, str] | None:
        doc = getattr(obj, "__doc__", None)
        if not isinstance(doc, str) or not doc.strip():
            return None
        doc = inspect.cleandoc(doc)
        text_sig = getattr(obj, "__text_signature__", None)
        if text_sig:
            sig = re.sub(r"^\(\$\w+(, /)?(, )?", "(", re.sub(r"\s+", " ", text_sig))
            return sig[1:-1], doc
        first, _, rest = doc.partition("\n")
        m = re.match(rf"^(?:\w+\.)?{re.escape(name)}\((.*)\)(\s*->.*)?$", first.strip())
        if m:
            return m.group(1), rest.lstrip("-\n ")
        return "...", doc

    def members(prefix: str, namespace, depth: int) -> Iterator[QA]:
        for attr in sorted(vars(namespace)):
            if attr.startswith("_"):
                continue
            obj = getattr(namespace, attr, None)
            name = f"{prefix}.{attr}" if prefix else attr
            own = getattr(obj, "__module__", None) in (namespace.__name__, "builtins")
            if inspect.isclass(obj) and depth == 0 and own:
                doc = inspect.cleandoc(obj.__doc__ or "")
                if (answer := first_paragraph(doc.partition("--\n")[2] or doc)):
                    yield QA(f"What is the class `{name}` for?", answer, name, "<built-in>")
                yield from members(name, obj, 1)
            elif inspect.isbuiltin(obj) or inspect.ismethoddescriptor(obj):
                found = sig_and_doc(attr, obj)
                if found and (answer := first_paragraph(found[1])):
                    yield QA(f"What does `{name}({found[0]})` do?", answer, name, "<built-in>")

    for mod_name in sorted(set(sys.builtin_module_names) | {"math", "itertools", "operator", "array", "select"}):
        if mod_name.startswith("_") and mod_name != "_io":
            continue
        try:
            module = importlib.import_module(mod_name)
        except ImportError:
            continue
        prefix = {"builtins": "", "_io": "io", "posix": "os"}.get(mod_name, mod_name)
        yield from members(prefix, module, 0)


def render_chat(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The chat template rendered exactly as the runtime and transformers render it (trim/lstrip blocks)."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    return env.from_string(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=add_generation_prompt)


def qa_text(qa: QA) -> str:
    return render_chat([{"role": "user", "content": qa.question}, {"role": "assistant", "content": qa.answer}])


def qa_prompt(question: str) -> str:
    return render_chat([{"role": "user", "content": question}], add_generation_prompt=True)


def build_corpus(out_dir: Path, root: Path | None = None, max_files: int | None = None,
                 heldout_per_mille: int = HELDOUT_PER_MILLE) -> CorpusStats:
    """Write source_{train,heldout}.jsonl ({"path","text"}) and qa_{train,heldout}.jsonl (QA fields)."""
    root = Path(root or stdlib_root())
    out_dir.mkdir(parents=True, exist_ok=True)
    outs = {name: (out_dir / f"{name}.jsonl").open("w") for name in
            ("source_train", "source_heldout", "qa_train", "qa_heldout")}
    files = heldout = chars = 0
    counts = {"train": 0, "heldout": 0}
    seen: set[str] = set()
    paths = stdlib_files(root, max_files)
    # A tiny corpus may have no file the hash holds out: then the last one is, so held-out text always exists.
    forced = None if any(is_heldout(p.relative_to(root).as_posix(), heldout_per_mille) for p in paths) else (
        paths[-1] if len(paths) > 1 else None)
    try:
        for path in paths:
            rel = path.relative_to(root).as_posix()
            text = read_source(path)
            if not text or not text.strip():
                continue
            split = "heldout" if path == forced or is_heldout(rel, heldout_per_mille) else "train"
            files += 1
            heldout += split == "heldout"
            chars += len(text)
            outs[f"source_{split}"].write(json.dumps({"path": rel, "text": text}) + "\n")
            for qa in extract_qa(text, rel):
                if qa.question in seen:
                    continue
                seen.add(qa.question)
                counts[split] += 1
                outs[f"qa_{split}"].write(json.dumps(asdict(qa)) + "\n")
        for qa in extract_builtin_qa():
            if qa.question in seen:
                continue
            seen.add(qa.question)
            split = "heldout" if is_heldout(qa.name, heldout_per_mille) else "train"
            counts[split] += 1
            outs[f"qa_{split}"].write(json.dumps(asdict(qa)) + "\n")
    finally:
        for f in outs.values():
            f.close()
    stats = CorpusStats(python=sys.version.split()[0], stdlib=str(root), files=files, heldout_files=heldout,
                        characters=chars, qa_train=counts["train"], qa_heldout=counts["heldout"])
    (out_dir / "corpus.json").write_text(json.dumps(asdict(stats), indent=2))
    return stats


def read_jsonl(path: Path) -> list[dict]:
    with path.open() as f:
        return [json.loads(line) for line in f]


def train_tokenizer(corpus_dir: Path, out_dir: Path, vocab_size: int, max_position: int) -> None:
    """Byte-level BPE on the training split; writes tokenizer.json and tokenizer_config.json (chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def texts():
        for row in read_jsonl(corpus_dir / "source_train.jsonl"):
            yield row["text"]
        for row in read_jsonl(corpus_dir / "qa_train.jsonl"):
            yield qa_text(QA(**row))

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(), trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None, "eos_token": END, "pad_token": ENDOFTEXT, "unk_token": None,
        "clean_up_tokenization_spaces": False, "model_max_length": max_position,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2) + "\n")


def tokenize_corpus(corpus_dir: Path, tokenizer_path: Path, out_dir: Path) -> dict[str, int]:
    """Token streams as uint16 .npy files: files joined by <|endoftext|>, chat turns back to back."""
    import numpy as np
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    eot = tok.token_to_id(ENDOFTEXT)
    assert tok.get_vocab_size() <= 65536
    sizes = {}
    for split in ("train", "heldout"):
        sources = [row["text"] for row in read_jsonl(corpus_dir / f"source_{split}.jsonl")]
        chats = [qa_text(QA(**row)) for row in read_jsonl(corpus_dir / f"qa_{split}.jsonl")]
        for kind, texts, sep in (("source", sources, [eot]), ("qa", chats, [])):
            ids: list[int] = []
            for enc in tok.encode_batch(texts, add_special_tokens=False):
                ids.extend(enc.ids)
                ids.extend(sep)
            np.save(out_dir / f"{kind}_{split}.npy", np.asarray(ids, dtype=np.uint16))
            sizes[f"{kind}_{split}"] = len(ids)
    return sizes
