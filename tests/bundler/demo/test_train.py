"""The training script's tiny configuration runs end to end on a CPU and leaves loadable checkpoints."""

from __future__ import annotations

import json

import pytest

from bundler.demo import corpus, train


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("demo-train")
    assert train.main(["all", "--tiny", "--data", str(work / "data"), "--out", str(work / "out")]) == 0
    return work


def test_tiny_run_writes_a_checkpoint_transformers_loads(tiny_run):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    for name in ("target", "draft0"):
        path = tiny_run / "out" / name
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        assert type(model) is LlamaForCausalLM
        tok = AutoTokenizer.from_pretrained(path)
        ids = tok.apply_chat_template([{"role": "user", "content": "What does `len(obj, /)` do?"}],
                                      add_generation_prompt=True, tokenize=True, return_dict=False)
        logits = model(torch.tensor([ids])).logits
        assert logits.shape == (1, len(ids), model.config.vocab_size)
        assert torch.isfinite(logits).all()
        assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == tok.eos_token_id


def test_tiny_run_records_losses_and_acceptance(tiny_run):
    metrics = json.loads((tiny_run / "out" / "metrics.json").read_text())
    history = metrics["target_history"]
    # Training moved the target: its best held-out loss is below the untrained one.
    assert min(h["source"] for h in history[1:]) < history[0]["source"]
    acc = metrics["acceptance"][metrics["chosen_draft"]]
    assert acc["prompts"] > 0 and acc["drafted"] > 0 and 0 <= acc["accepted"] <= acc["drafted"]
    assert set(metrics["heldout_loss"]) == {"target", metrics["chosen_draft"]}


def test_corpus_pairs_signatures_with_first_docstring_paragraph():
    source = (
        'def dumps(obj, *, skipkeys=False, indent=None):\n'
        '    """Serialize ``obj`` to a JSON formatted str.\n\n    More detail here.\n    """\n'
        'class Encoder:\n'
        '    """Extensible JSON encoder."""\n'
        '    def encode(self, o):\n'
        '        """Return a JSON string\n        of o."""\n'
        '    def _helper(self):\n'
        '        pass\n')
    qas = list(corpus.extract_qa(source, "json/__init__.py"))
    assert [(q.question, q.answer) for q in qas] == [
        ("What does `json.dumps(obj, *, skipkeys=False, indent=None)` do?", "Serialize ``obj`` to a JSON formatted str."),
        ("What is the class `json.Encoder` for?", "Extensible JSON encoder."),
        ("What does `json.Encoder.encode(o)` do?", "Return a JSON string of o."),
    ]
    chat = corpus.qa_text(qas[0])
    assert chat == ("<|user|>\nWhat does `json.dumps(obj, *, skipkeys=False, indent=None)` do?<|end|>\n"
                    "<|assistant|>\nSerialize ``obj`` to a JSON formatted str.<|end|>\n")
    assert chat.startswith(corpus.qa_prompt(qas[0].question))


def test_heldout_split_is_by_file_and_stable():
    assert corpus.is_heldout("mailbox.py") and not corpus.is_heldout("json/__init__.py")
