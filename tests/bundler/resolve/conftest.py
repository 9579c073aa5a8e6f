"""Session fixtures: tiny real checkpoints, and one olah mirror (behind a Range/fault proxy) serving them."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.bundler.resolve.hub_server import HubProxy, HubRepos, Olah, copy_checkpoint
from tests.conftest import once_per_run
from tests.eagle3_models import make_tiny_head
from tests.models import make_tiny_checkpoint

#: A config.json shaped like an 8B Llama: 32 layers, 8 KV heads of 128, bf16, 128k context.
BIG_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
              "torch_dtype": "bfloat16", "tie_word_embeddings": False}

LARGE_SIZE = 24 * 1024 * 1024 + 12345


@dataclass
class Checkpoints:
    target: Path
    draft: Path  # same tokenizer as target
    other_draft: Path  # a different tokenizer
    eagle3_head: Path  # a random EAGLE-3 head for target (layers 0, 1, 1)
    other_eagle3_head: Path  # one for other_draft (hidden size 32)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> Checkpoints:
    def build(root: Path) -> Checkpoints:
        target = make_tiny_checkpoint(root / "target", hidden_size=64, num_layers=2, seed=0)
        draft = make_tiny_checkpoint(root / "draft", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                     intermediate_size=64, seed=1, tokenizer_from=target)
        other = make_tiny_checkpoint(root / "other", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                     intermediate_size=64, vocab_size=300, seed=2)
        head = make_tiny_head(root / "eagle3", target, layer_ids=[0, 1, 1], seed=4)
        other_head = make_tiny_head(root / "eagle3-other", other, draft_vocab=200, layer_ids=[0, 0, 0], seed=5)
        return Checkpoints(target, draft, other, head, other_head)

    return once_per_run(tmp_path_factory, "checkpoints", build)  # read-only: the hub serves copies


@dataclass
class Hub:
    repos: HubRepos
    proxy: HubProxy
    url: str
    shas: dict  # name -> commit sha of interest

    def gets(self, suffix: str) -> list:
        """Logged GETs of /resolve/ URLs ending in `suffix` (file downloads)."""
        return [e for e in self.proxy.log if e.method == "GET" and "/resolve/" in e.path and e.path.endswith(suffix)]


@pytest.fixture(scope="session")
def hub_session(tmp_path_factory, checkpoints) -> Hub:
    work = tmp_path_factory.mktemp("hub")
    repos = HubRepos(work / "mirrors")
    shas = {}
    files = copy_checkpoint(checkpoints.target)
    # What a real repo carries besides what serving needs: a second copy of the weights in PyTorch format,
    # Meta's original/ checkpoint, a GGUF export, docs, an image, a license.
    extras = {"pytorch_model.bin": b"\x80\x02" + b"pickled-weights" * 500,
              "original/consolidated.00.pth": b"original-weights" * 300,
              "model-q4.gguf": b"GGUF" + b"\x00" * 4000,
              "README.md": b"---\nlicense: apache-2.0\n---\n# tiny\n",
              "images/logo.png": b"\x89PNG\r\n\x1a\n" + b"\x00" * 100,
              "LICENSE": b"Apache License 2.0\n"}
    shas["v1"] = repos.commit("acme/tiny-llama", {**files, **extras}, message="first", tag="v1")
    cfg = json.loads((checkpoints.target / "config.json").read_text())
    cfg["note"] = "second commit on main"
    shas["main"] = repos.commit("acme/tiny-llama", {"config.json": json.dumps(cfg, indent=2).encode()},
                                message="second")
    shas["draft"] = repos.commit("acme/tiny-draft", copy_checkpoint(checkpoints.draft))
    shas["other-draft"] = repos.commit("acme/other-draft", copy_checkpoint(checkpoints.other_draft))
    shas["eagle3"] = repos.commit("acme/tiny-eagle3", copy_checkpoint(checkpoints.eagle3_head))
    shas["eagle3-other"] = repos.commit("acme/eagle3-for-another", copy_checkpoint(checkpoints.other_eagle3_head))
    big = {**copy_checkpoint(checkpoints.target), "config.json": json.dumps(BIG_CONFIG).encode()}
    shas["big"] = repos.commit("acme/big-config", big)
    # Larger than huggingface_hub's 10 MB download chunk, so an interrupted transfer has bytes to resume from.
    large = {**copy_checkpoint(checkpoints.target), "model.safetensors": os.urandom(LARGE_SIZE)}
    shas["large"] = repos.commit("acme/large", large)
    shas["gated"] = repos.commit("acme/gated", copy_checkpoint(checkpoints.target))
    shas["corrupt"] = repos.commit("acme/corrupt", copy_checkpoint(checkpoints.target))
    # The mirror's stored bytes rot after the commit: same size, different content.
    obj = repos.lfs_object("acme/corrupt", "model.safetensors")
    data = bytearray(obj.read_bytes())
    data[-1] ^= 0xFF
    obj.write_bytes(bytes(data))
    olah = Olah(work, repos.mirrors).start()
    proxy = HubProxy(olah.port).start()
    try:
        yield Hub(repos, proxy, proxy.url, shas)
    finally:
        proxy.stop()
        olah.stop()


@pytest.fixture
def hub(hub_session) -> Hub:
    hub_session.proxy.reset()
    yield hub_session
    hub_session.proxy.reset()


@pytest.fixture
def hf_cache(tmp_path) -> Path:
    return tmp_path / "hf-cache"


@pytest.fixture
def local_copy(tmp_path, checkpoints):
    """A private copy of a checkpoint folder that a test may edit."""
    def make(src: Path) -> Path:
        dst = tmp_path / f"local-{src.name}"
        shutil.copytree(src, dst)
        return dst
    return make
