"""What users type (--model, --speculative-config), the file filter, and local checkpoint folders."""

from __future__ import annotations

import hashlib
import json

import pytest

from bundler.resolve.checkpoint import parse_ref, resolve_model
from bundler.resolve.select_files import select_files
from manifests.errors import ResolveError, UsageError
from manifests.speculative import parse_speculative_config


@pytest.mark.parametrize("text, repo, rev", [
    ("nvidia/Some-Model_1.5", "nvidia/Some-Model_1.5", None),
    ("org/name@v1.0", "org/name", "v1.0"),
    ("org/name@refs/pr/4", "org/name", "refs/pr/4"),
    ("org/name@" + "a" * 40, "org/name", "a" * 40),
])
def test_hub_refs(text, repo, rev):
    ref = parse_ref(text)
    assert (ref.kind, ref.repo, ref.revision) == ("huggingface", repo, rev)


@pytest.mark.parametrize("text, expected", [
    ("", r"found nothing"),
    ("just-a-name", r"expected a model reference like org/name\[@REVISION\] or an existing folder, "
                    r"found 'just-a-name'"),
    ("org/name@", r"found 'org/name@'"),
    ("a/b/c", r"found 'a/b/c'"),
    ("./no/such/dir", r"expected a checkpoint folder at ./no/such/dir, found nothing"),
])
def test_bad_refs(text, expected):
    with pytest.raises(UsageError, match=expected):
        parse_ref(text)


HUB_LISTING = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja", "model-00001-of-00002.safetensors",
               "model-00002-of-00002.safetensors", "model.safetensors.index.json", "pytorch_model-00001-of-00002.bin",
               "pytorch_model-00002-of-00002.bin", "pytorch_model.bin.index.json", "original/consolidated.00.pth",
               "original/params.json", "original/tokenizer.model", "model.Q4_K_M.gguf", "README.md", "LICENSE",
               "USE_POLICY.md", "images/arch.png", "figure.jpg", ".gitattributes"]


def test_default_selection_of_a_typical_repo():
    assert select_files(HUB_LISTING) == [
        "LICENSE", "USE_POLICY.md", "chat_template.jinja", "config.json", "generation_config.json",
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]


def test_bin_only_repo_gets_its_bin_weights():
    listing = [p for p in HUB_LISTING if "safetensors" not in p]
    chosen = select_files(listing)
    assert "pytorch_model-00001-of-00002.bin" in chosen and "pytorch_model.bin.index.json" in chosen


def test_repo_without_weights_or_config_is_refused():
    with pytest.raises(ResolveError, match=r"expected weights \(\*\.safetensors or pytorch_model\*\.bin\) after "
                                           r"filtering, found"):
        select_files(["config.json", "tokenizer.json", "model.gguf"])
    with pytest.raises(ResolveError, match=r"expected config\.json at the top of the repository"):
        select_files(["model.safetensors"])
    with pytest.raises(ResolveError, match=r"expected weights"):
        select_files(HUB_LISTING, exclude=["*.safetensors"])


def test_spec_config_with_vllm_keys():
    c = parse_speculative_config('{"method": "draft_model", "model": "org/draft", "num_speculative_tokens": 3, '
                                 '"revision": "v2", "draft_tensor_parallel_size": 1}')
    assert (c.method, c.model, c.num_speculative_tokens, c.draft_ref) == ("draft_model", "org/draft", 3,
                                                                          "org/draft@v2")
    assert c.extra == {"draft_tensor_parallel_size": 1}
    # vLLM infers draft_model when only a model is given.
    assert parse_speculative_config('{"model": "./d", "num_speculative_tokens": 2}').method == "draft_model"


@pytest.mark.parametrize("text, expected", [
    ("{method: draft_model}", r"expected JSON like"),
    ('["draft_model"]', r"expected a JSON object, found list"),
    ('{"model": "o/d", "num_speculative_tokens": 3, "num_spec_tokens": 3}', r"found unknown 'num_spec_tokens'"),
    ('{"method": "eagle", "model": "o/d", "num_speculative_tokens": 3}',
     r"expected method draft_model, eagle3, ngram, none, found 'eagle': this version does not run it \(it would "
     r"need an EAGLE-1 head"),
    ('{"method": "ngram", "num_speculative_tokens": 3}', r"expected method draft_model or eagle3 \(a model to bundle\)"),
    ('{"method": "draft_model", "num_speculative_tokens": 3}', r"expects \"model\""),
    ('{"model": "o/d", "num_speculative_tokens": 0}',
     r"expected num_speculative_tokens an integer from 1 to 16, found 0"),
    ('{"model": "o/d", "num_speculative_tokens": "3"}', r"found '3'"),
])
def test_bad_spec_config(text, expected):
    with pytest.raises(UsageError, match=expected):
        parse_speculative_config(text).bundled_draft()  # what bundle create asks of it


def test_local_folder_model(checkpoints, local_copy):
    folder = local_copy(checkpoints.target)
    (folder / "pytorch_model.bin").write_bytes(b"a second copy")
    (folder / ".cache").mkdir()
    (folder / ".cache" / "junk").write_text("x")
    m = resolve_model(str(folder), role="target")
    assert m.repo is None and m.local_dir == folder and m.name == folder.name
    assert [f.path for f in m.files] == ["config.json", "generation_config.json", "model.safetensors",
                                         "tokenizer.json", "tokenizer_config.json"]
    f = {f.path: f for f in m.files}["model.safetensors"]
    assert f.sha256 == hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    assert m.source.type == "local" and m.source.path is None
    assert m.revision.startswith("sha256:") and m.source.revision == m.revision
    # The revision is a digest of the contents: same bytes elsewhere, same revision; one byte changed, another.
    assert resolve_model(str(checkpoints.target), role="target").revision == m.revision
    cfg = json.loads((folder / "config.json").read_text()) | {"note": "fine-tuned"}
    (folder / "config.json").write_text(json.dumps(cfg))
    assert resolve_model(str(folder), role="target").revision != m.revision
