"""The committed demo pair: standard Llama checkpoints, one tokenizer, a plain-Jinja2 template, a real draft."""

from __future__ import annotations

import json

import pytest

from bundler.demo import DEMO_DRAFT_DIR, DEMO_TARGET_DIR, HELDOUT_PROMPTS, corpus
from bundler.demo import evaluate as ev

FILES = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"}


@pytest.fixture(scope="module")
def pair():
    return ev.load_pair(DEMO_TARGET_DIR, DEMO_DRAFT_DIR)


def test_checkpoints_are_complete_and_small_enough_to_commit():
    total = 0
    for d in (DEMO_TARGET_DIR, DEMO_DRAFT_DIR):
        assert FILES <= {p.name for p in d.iterdir()}, d
        total += sum(p.stat().st_size for p in d.iterdir())
    assert total < 25_000_000


def test_both_load_as_plain_llama_and_the_draft_is_several_times_smaller(pair):
    from transformers import LlamaForCausalLM

    target, draft, _ = pair
    assert type(target) is LlamaForCausalLM and type(draft) is LlamaForCausalLM
    for d in (DEMO_TARGET_DIR, DEMO_DRAFT_DIR):
        config = json.loads((d / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"] and "auto_map" not in config
    n_target = sum(p.numel() for p in target.parameters())
    n_draft = sum(p.numel() for p in draft.parameters())
    assert n_target > 3 * n_draft
    assert 2_000_000 < n_target < 6_000_000


def test_pair_shares_one_tokenizer_and_its_special_tokens(pair):
    target, draft, tok = pair
    assert (DEMO_TARGET_DIR / "tokenizer.json").read_bytes() == (DEMO_DRAFT_DIR / "tokenizer.json").read_bytes()
    assert (DEMO_TARGET_DIR / "tokenizer_config.json").read_bytes() == \
        (DEMO_DRAFT_DIR / "tokenizer_config.json").read_bytes()
    assert target.config.vocab_size == draft.config.vocab_size == tok.get_vocab_size()
    eos = tok.token_to_id("<|end|>")
    for d in (DEMO_TARGET_DIR, DEMO_DRAFT_DIR):
        assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == eos
    assert target.config.eos_token_id == draft.config.eos_token_id == eos
    for special in corpus.SPECIAL_TOKENS:
        assert tok.encode(special, add_special_tokens=False).ids == [tok.token_to_id(special)]


def test_chat_template_renders_with_plain_jinja2_as_transformers_does():
    import jinja2
    from transformers import AutoTokenizer

    config = json.loads((DEMO_TARGET_DIR / "tokenizer_config.json").read_text())
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What does `len` do?"}]
    plain = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(config["chat_template"])
    rendered = plain.render(messages=messages, add_generation_prompt=True)
    assert rendered == "<|system|>\nBe brief.<|end|>\n<|user|>\nWhat does `len` do?<|end|>\n<|assistant|>\n"
    hf = AutoTokenizer.from_pretrained(DEMO_TARGET_DIR)
    assert hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == rendered
    assert hf.eos_token == "<|end|>"


def test_target_models_heldout_answers_better_than_draft(pair):
    import torch
    import torch.nn.functional as F

    target, draft, tok = pair
    rows = json.loads(HELDOUT_PROMPTS.read_text())[:40]
    text = "".join(corpus.qa_text(corpus.QA(r["question"], r["reference"], "", "")) for r in rows)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False).ids[:512]])
    losses = {}
    with torch.inference_mode():
        for name, model in (("target", target), ("draft", draft)):
            logits = model(ids[:, :-1]).logits[0]
            losses[name] = float(F.cross_entropy(logits, ids[0, 1:]))
    assert losses["target"] < losses["draft"] - 0.1, losses


def test_greedy_acceptance_on_heldout_chat_prompts_is_above_a_floor(pair):
    target, draft, tok = pair
    rows = json.loads(HELDOUT_PROMPTS.read_text())[:10]
    prompts = [tok.encode(corpus.qa_prompt(r["question"]), add_special_tokens=False).ids for r in rows]
    acc = ev.greedy_acceptance(target, draft, prompts, k=3, max_new_tokens=32, eos_ids=ev.eos_ids_of(DEMO_TARGET_DIR))
    assert acc.drafted > 50
    assert acc.rate >= 0.4, acc.to_dict()
