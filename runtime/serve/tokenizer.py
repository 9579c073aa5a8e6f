"""The model's own tokenizer (tokenizer.json via the `tokenizers` library) and streaming text output.

Streaming must never cut a multi-byte UTF-8 character in half (a byte-level BPE splits "é" or an
emoji over several tokens): `IncrementalDecoder` uses tokenizers' DecodeStream, which holds bytes
back until they form whole characters. `TextStream` adds stop strings on top: text that could be
the start of a stop string is held back until it is known not to be, so a stop string spanning
token boundaries is found and never leaks to the client.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from manifests.errors import ModelError
from manifests.strict_json import parse as parse_json
from manifests.limits import LIMITS

GIL_FREE_ABOVE = 4096  # characters


def _read_json(path: Path, limit: int) -> dict:
    if not path.is_file():
        return {}
    with open(path, "rb") as f:
        data = parse_json(f.read(limit + 1), what=str(path), max_bytes=limit, error=ModelError)
    if not isinstance(data, dict):
        raise ModelError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


def _token_text(value) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """Encode/decode plus the special tokens and chat template a model directory declares."""

    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer as HFTokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelError(f"expected a tokenizer.json in {model_dir}, found none")
        if path.stat().st_size > LIMITS.tokenizer_bytes:
            raise ModelError(f"{path} is larger than {LIMITS.tokenizer_bytes} bytes")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust parser raises a bare Exception
            raise ModelError(f"cannot load {path}: {e}") from None
        self.config = _read_json(model_dir / "tokenizer_config.json", LIMITS.tokenizer_config_bytes)
        gen = _read_json(model_dir / "generation_config.json", LIMITS.tokenizer_config_bytes)
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.pad_token = _token_text(self.config.get("pad_token"))
        self.unk_token = _token_text(self.config.get("unk_token"))
        template = self.config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if template is None and (model_dir / "chat_template.jinja").is_file():
            template = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
        if template is None:  # transformers' other file for it: {"chat_template": "..."}
            template = _read_json(model_dir / "chat_template.json", LIMITS.tokenizer_config_bytes).get("chat_template")
        self.chat_template: str | None = template if isinstance(template, str) else None
        eos: set[int] = set()
        raw = gen.get("eos_token_id")
        for v in raw if isinstance(raw, list) else [raw]:
            if isinstance(v, int):
                eos.add(v)
        if self.eos_token is not None and self._tok.token_to_id(self.eos_token) is not None:
            eos.add(self._tok.token_to_id(self.eos_token))
        self.eos_token_ids = frozenset(eos)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while Rust tokenizes (encode holds it): a megabyte prompt
        # tokenized in a worker thread must not stop the event loop's thread.
        if len(text) > GIL_FREE_ABOVE:
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary's own string for an id ("Ġis" in a byte-level BPE), as convert_ids_to_tokens gives it."""
        return self._tok.id_to_token(int(token_id))

    def decoder(self, skip_special_tokens: bool = True) -> "IncrementalDecoder":
        return IncrementalDecoder(self, skip_special_tokens)


class IncrementalDecoder:
    """Token ids in, text out, never splitting a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        self._tok = tokenizer._tok
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._tok, int(token_id)) or ""


@dataclass
class TextStream:
    """Decode tokens one by one, stop at the first stop string, hold back possible stop-string starts.

    `push` returns the text that is safe to send now; `stopped` turns True once a stop string was
    seen (the text before it has been returned, the stop string and anything after are dropped).
    `flush` returns what was held back when generation ends for another reason.
    """

    tokenizer: Tokenizer
    stop: tuple[str, ...] = ()
    stopped: bool = False
    stop_hit: str | None = None  # the stop string that ended the text, once stopped
    text: str = ""  # everything returned so far
    tokens: int = 0  # tokens pushed before the stop (usage counts these)
    skip_special_tokens: bool = True  # False where a parser reads special tokens ([TOOL_CALLS])
    _held: str = ""
    _decoder: IncrementalDecoder | None = field(default=None, repr=False)

    def __post_init__(self):
        self.stop = tuple(s for s in self.stop if s)
        self._decoder = self.tokenizer.decoder(self.skip_special_tokens)

    def push(self, token_ids: Sequence[int]) -> str:
        out = []
        for t in token_ids:
            if self.stopped:
                break
            self.tokens += 1
            out.append(self._push_text(self._decoder.step(t)))
        piece = "".join(out)
        self.text += piece
        return piece

    def _push_text(self, new: str) -> str:
        buf = self._held + new
        if not self.stop:
            self._held = ""
            return buf
        hits = [(i, s) for s, i in ((s, buf.find(s)) for s in self.stop) if i >= 0]
        if hits:
            at, self.stop_hit = min(hits)
            self.stopped = True
            self._held = ""
            return buf[:at]
        keep = 0  # longest suffix of buf that is a proper prefix of some stop string
        for s in self.stop:
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:n]):
                    keep = n
                    break
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        piece, self._held = self._held, ""
        self.text += piece
        return piece
