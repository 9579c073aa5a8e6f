"""manifests.serve_config: the one parser of vLLM serve flags (create --serve-arg, the manifest, bundle serve)."""

import json

import pytest

from manifests import serve_config as sc
from manifests.errors import UsageError

#: The command from the issue, as a vLLM user pastes it (the draft is the bundle's own).
PASTED = ("--served-model-name qwen38 --reasoning-parser qwen3 --enable-auto-tool-choice "
          "--tool-call-parser qwen3_coder --max-model-len 50000 --max-num-seqs 8 --gpu-memory-utilization 0.85 "
          "--trust-remote-code --enable-prefix-caching --kv-cache-dtype fp8 --max-num-batched-tokens 16384 "
          "--speculative-config '{\"method\":\"draft_model\",\"num_speculative_tokens\":3}'")


def test_the_pasted_vllm_command_parses_to_typed_values():
    config = sc.parse_args([PASTED])
    assert config == {
        "served_model_name": ["qwen38"], "reasoning_parser": "qwen3", "enable_auto_tool_choice": True,
        "tool_call_parser": "qwen3_coder", "max_model_len": 50000, "max_num_seqs": 8,
        "gpu_memory_utilization": 0.85, "trust_remote_code": True, "enable_prefix_caching": True,
        "kv_cache_dtype": "fp8", "max_num_batched_tokens": 16384,
        "speculative_config": {"method": "draft_model", "num_speculative_tokens": 3}}
    notes = sc.check(config)
    # Flags without effect say so, one line each, naming the flag.
    assert any(n.startswith("--trust-remote-code:") and "no model code" in n for n in notes)
    assert any(n.startswith("--gpu-memory-utilization:") for n in notes)
    assert any(n.startswith("--kv-cache-dtype: fp8") for n in notes)
    assert not any(n.startswith("--max-model-len") for n in notes)  # applied, no note


def test_every_listed_flag_is_in_the_table():
    listed = ["--served-model-name", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
              "--gpu-memory-utilization", "--kv-cache-dtype", "--enable-prefix-caching", "--reasoning-parser",
              "--enable-auto-tool-choice", "--tool-call-parser", "--chat-template", "--generation-config",
              "--dtype", "--trust-remote-code", "--tensor-parallel-size", "--uvicorn-log-level",
              "--disable-log-requests", "--api-key", "--host", "--port"]
    assert [f for f in listed if f not in sc.BY_NAME] == []


def test_forms_equals_underscores_negation_and_human_ints():
    config = sc.parse_args(["--max_model_len=32k", "--no-enable-prefix-caching", "--port", "9000",
                            "--served-model-name a --served-model-name b"])
    assert config == {"max_model_len": 32000, "enable_prefix_caching": False, "port": 9000,
                      "served_model_name": ["a", "b"]}
    assert sc.parse_args(["--max-model-len 4K"])["max_model_len"] == 4096
    assert sc.parse_args(["--served-model-name a b --port 1"])["served_model_name"] == ["a", "b"]


@pytest.mark.parametrize("args, words", [
    (["--tensor-parallel-size 2"], ["one device", "remove --tensor-parallel-size"]),
    (["--quantization awq"], ["quantiz", "remove --quantization"]),
    (["--tokenizer org/tok"], ["own tokenizer", "remove --tokenizer"]),
    (["--tool-parser-plugin x.py"], ["no extra", "hermes"]),
    (["--guided-decoding-backend xgrammar"], ["torch", "guidance"]),
    (["--structured-outputs-config", '{"backend": "xgrammar"}'], ["torch", "guidance"]),
    (["--enable-auto-tool-choice"], ["--tool-call-parser"]),
    (["--tool-call-parser nope"], ["expected one of", "hermes", "'nope'"]),
    (["--max-model-len lots"], ["--max-model-len", "32k", "'lots'"]),
    (["--max-num-seqs 0"], ["at least 1", "found 0"]),
    (["--gpu-memory-utilization 1.5"], ["(0, 1]"]),
    (["--max-modle-len 5"], ["did you mean --max-model-len"]),
    (["--port"], ["expected a value"]),
    (["--ssl-keyfile k.pem"], ["--ssl-certfile"]),
])
def test_refusals_name_what_to_do(args, words):
    with pytest.raises(UsageError) as e:
        sc.check(sc.parse_args(args))  # flags alone refuse in parse_args; flags that go together in check
    assert all(w in str(e.value) for w in words), str(e.value)
    assert "No such option" not in str(e.value)


def test_tensor_parallel_one_is_only_a_note():
    assert sc.check(sc.parse_args(["--tensor-parallel-size 1"])) == [
        "--tensor-parallel-size: one device serves the bundle; 1 is the only size"]


def test_manifest_config_round_trips_and_keeps_unknown_keys():
    config = sc.parse_args([PASTED])
    stored = json.loads(json.dumps({**config, "temperature": 0.6, "from_a_newer_tool": {"x": 1}}))
    known, unknown = sc.parse_config(stored)
    assert known == {**config, "temperature": 0.6}
    assert unknown == {"from_a_newer_tool": {"x": 1}}
    with pytest.raises(UsageError, match="--max-num-seqs: expected an integer"):
        sc.parse_config({"max_num_seqs": True})
    # to_args gives a command line that parses back to the same config
    assert sc.parse_args([" ".join(map(_quote, sc.to_args(config)))]) == config


def _quote(s):
    import shlex
    return shlex.quote(s)


def test_merge_lays_the_command_line_over_the_bundle():
    assert sc.merge({"max_model_len": 4096, "tool_call_parser": "hermes"},
                    {"max_model_len": 2048, "reasoning_parser": None}) == {
        "max_model_len": 2048, "tool_call_parser": "hermes"}


@pytest.mark.parametrize("args, why", [
    (["--limit-mm-per-prompt", '{"image": 0, "video": 0}'], "text only"),
    (["--mamba-ssm-cache-dtype", "bfloat16"], "states are float32"), (["--mamba-cache-dtype", "float16"], "float32"),
    (["--mamba-block-size", "64"], "own recurrent-state region"), (["--mamba-cache-mode", "align"], "prefix caching"),
    (["--mamba-backend", "triton"], "ONNX Runtime operators"),
    (["--enable-mamba-fine-grained-prefix-cache"], "prefix caching is off"),
    (["--no-enable-mamba-fine-grained-prefix-cache"], "prefix caching is off"),
])
def test_multimodal_and_mamba_flags_are_noted_never_unknown(args, why):
    notes = sc.check(sc.parse_args(args))
    flag = args[0].replace("--no-", "--")
    assert len(notes) == 1 and notes[0].startswith(flag + ":")
    assert why in notes[0]


@pytest.mark.parametrize("flag", ["--mamba-ssm-cache-dtype", "--mamba-cache-dtype"])
@pytest.mark.parametrize("value", ["float32", "auto"])
def test_a_float32_mamba_state_is_what_runs(flag, value):
    """Mamba-2 states are float32: vLLM's float32 (or auto) asks for what the engine does, no note."""
    assert sc.check(sc.parse_args([flag, value])) == []


def test_mamba_dtype_outside_vllms_choices_is_refused():
    with pytest.raises(UsageError, match="--mamba-ssm-cache-dtype: expected one of auto, float32"):
        sc.parse_args(["--mamba-ssm-cache-dtype", "fp8"])
