"""`bundle serve` takes what a vLLM user pastes: every flag applied, noted or refused, never "No such option"."""

from __future__ import annotations

import json
import re
import shlex

import httpx
import pytest
from click.testing import CliRunner

from manifests.errors import UsageError
from runtime.cli.serve import serve as serve_cmd
from tests.runtime.serve.conftest import serve_process

#: The issue's list, each with a value a user would type.
LISTED = {
    "--served-model-name": "qwen38", "--max-model-len": "50000", "--max-num-seqs": "8",
    "--max-num-batched-tokens": "16384", "--gpu-memory-utilization": "0.85", "--kv-cache-dtype": "fp8",
    "--enable-prefix-caching": None, "--no-enable-prefix-caching": None, "--reasoning-parser": "qwen3",
    "--enable-auto-tool-choice": None, "--tool-call-parser": "qwen3_coder", "--chat-template": "t.jinja",
    "--generation-config": "auto", "--dtype": "bfloat16", "--trust-remote-code": None,
    "--tensor-parallel-size": "1", "--uvicorn-log-level": "warning", "--disable-log-requests": None,
    "--api-key": "k", "--host": "127.0.0.1", "--port": "8001",
}


@pytest.fixture()
def captured(monkeypatch):
    calls = []
    import runtime.server

    monkeypatch.setattr(runtime.server, "serve", lambda *a, **kw: calls.append((a, kw)))
    return calls


@pytest.mark.parametrize("flag", list(LISTED))
def test_every_listed_vllm_flag_is_taken(captured, flag):
    value = LISTED[flag]
    args = ["demo", flag] + ([value] if value is not None else [])
    if flag == "--enable-auto-tool-choice":
        args += ["--tool-call-parser", "hermes"]
    r = CliRunner().invoke(serve_cmd, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "No such option" not in r.output
    ((_, config), _), = captured
    dest = flag.lstrip("-").replace("no-", "", 1).replace("-", "_")
    assert dest in config.args, config.args


def test_the_issues_command_line_parses_whole(captured):
    line = ("--served-model-name qwen38 --reasoning-parser qwen3 --enable-auto-tool-choice "
            "--tool-call-parser qwen3_coder --max-model-len 50000 --max-num-seqs 8 --gpu-memory-utilization 0.85 "
            "--trust-remote-code --enable-prefix-caching --kv-cache-dtype fp8 --max-num-batched-tokens 16384 "
            "--speculative-config '{\"method\":\"draft_model\",\"model\":\"org/draft\",\"num_speculative_tokens\":3}'")
    r = CliRunner().invoke(serve_cmd, ["demo", *shlex.split(line)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    args = captured[0][0][1].args
    assert args["served_model_name"] == ["qwen38"] and args["max_model_len"] == 50000
    assert args["speculative_config"]["model"] == "org/draft" and args["enable_prefix_caching"] is True


def test_served_model_name_takes_several_values_as_in_vllm(captured):
    r = CliRunner().invoke(serve_cmd, ["demo", "--served-model-name", "qwen38", "qwen3-8b", "--port", "1"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert captured[0][0][0] == "demo"
    assert captured[0][0][1].args["served_model_name"] == ["qwen38", "qwen3-8b"]


@pytest.mark.parametrize("args, words", [
    (["--tensor-parallel-size", "2"], ["one device", "remove --tensor-parallel-size"]),
    (["--quantization", "awq"], ["quantiz"]),
    (["--tokenizer", "x"], ["own tokenizer"]),
    (["--model", "org/x"], ["bundle serve NAME|DIR"]),
    (["--guided-decoding-backend", "xgrammar"], ["torch", "guidance"]),
    (["--no-speculation", "--speculative-config", "{}"], ["contradict"]),
])
def test_refused_flags_say_what_to_do(captured, args, words):
    r = CliRunner().invoke(serve_cmd, ["demo", *args], standalone_mode=False)
    assert isinstance(r.exception, UsageError) and all(w in str(r.exception) for w in words), r.exception
    assert not captured


def test_help_lists_vllm_flags_with_what_they_do_here():
    out = CliRunner().invoke(serve_cmd, ["--help"], terminal_width=200).output
    for flag in ("--trust-remote-code", "--tool-call-parser", "--enable-prefix-caching / --no-enable-prefix-caching",
                 "--tensor-parallel-size", "--reasoning-parser"):
        assert flag in out
    assert "no model code" in out and "Refused here" in out


def test_speculative_config_must_name_the_bundles_draft(demo_installed):
    from runtime.server.options import ServeConfig, apply_serve_config

    installed, _ = demo_installed
    with pytest.raises(UsageError, match="asks for draft model 'org/other'.*carries draft 'draft@"):
        apply_serve_config(installed, ServeConfig(args={"speculative_config": {"method": "draft_model", "model": "org/other"}}))
    setup = apply_serve_config(installed, ServeConfig(args={"speculative_config": {"method": "draft_model", "model": "draft",
                                                                  "num_speculative_tokens": 2}}))
    assert setup.serving.model.runner.num_speculative_tokens == 2


def test_generation_config_and_overrides_set_default_sampling(demo_installed, tmp_path):
    from runtime.server.options import ServeConfig, apply_serve_config

    installed, _ = demo_installed
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                                                 "max_new_tokens": 64, "do_sample": True}))
    s = apply_serve_config(installed, ServeConfig(args={"generation_config": str(tmp_path),
                                       "override_generation_config": {"temperature": 0.2}}))
    assert s.serving.model.defaults == {"temperature": 0.2, "top_p": 0.9, "top_k": 20, "max_tokens": 64}
    assert apply_serve_config(installed, ServeConfig(args={"generation_config": "vllm"})).serving.model.defaults == {}
    with pytest.raises(UsageError, match="generation_config.json"):
        apply_serve_config(installed, ServeConfig(args={"generation_config": str(tmp_path / "none")}))


def test_bundle_serve_with_the_pasted_command_line(demo_installed, tmp_path):
    """The real command in a process: startup notes, then the OpenAI API under the served name."""
    installed, root = demo_installed
    args = ["demo", "--store", str(root / "store"), "--port", "0",
            "--served-model-name", "qwen38", "--reasoning-parser", "qwen3", "--enable-auto-tool-choice",
            "--tool-call-parser", "qwen3_coder", "--max-model-len", "384", "--max-num-seqs", "8",
            "--gpu-memory-utilization", "0.85", "--trust-remote-code", "--enable-prefix-caching",
            "--kv-cache-dtype", "fp8", "--max-num-batched-tokens", "16384", "--dtype", "auto",
            "--tensor-parallel-size", "1", "--uvicorn-log-level", "warning", "--generation-config", "auto",
            "--speculative-config", '{"method":"draft_model","model":"draft","num_speculative_tokens":3}']
    with serve_process(args, timeout=120) as (url, lines):
        banner = "".join(lines)
        assert "model:       qwen38" in banner and "max_model_len 384" in banner
        assert "tools:       auto tool choice, qwen3_coder parser" in banner
        for flag in ("--trust-remote-code", "--gpu-memory-utilization", "--kv-cache-dtype", "--tensor-parallel-size"):
            assert f"note:        {flag}:" in banner, flag
        assert re.search(r"batching:    \d+ slots .*max_num_batched_tokens 16384; prefix caching on", banner), banner
        assert "No such option" not in banner
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "qwen38", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200 and r.json()["model"] == "qwen38"


def test_enforce_eager_loads_every_engine_without_cuda_graphs(demo_installed, monkeypatch):
    """--enforce-eager reaches each engine's loader (target and draft) as cuda_graphs=False, and the CUDA engine
    factory then makes a CudaEngine without CUDA graphs; without the flag, loaders are called as before."""
    import runtime.engines as engines
    from runtime.server.options import ServeConfig, apply_serve_config

    installed, _ = demo_installed
    calls = []

    def spy(*args, **kw):
        calls.append((args[3], kw.get("cuda_graphs", True)))
        return engines.load_engine(*args, **kw)

    setup = apply_serve_config(installed, ServeConfig(args={"enforce_eager": True}), load_engine=spy)
    assert calls == [("target", False), ("draft", False)]
    assert setup.serving.model.runner.num_speculative_tokens > 0
    calls.clear()
    apply_serve_config(installed, ServeConfig(args={}), load_engine=spy)
    assert calls == [("target", True), ("draft", True)]

    made = []

    class FakeCudaEngine:
        def __init__(self, graph, **kw):
            made.append(kw["cuda_graphs"])

    import onnxruntime

    import runtime.engines.cuda
    import runtime.engines.cudalib

    monkeypatch.setattr(runtime.engines.cudalib, "onnxruntime_cuda", lambda: (onnxruntime, None))
    monkeypatch.setattr(runtime.engines.cuda, "CudaEngine", FakeCudaEngine)
    record = installed.manifest.target(installed.target).engines[0]
    engines.cuda_engine(installed.path, record, 64, cuda_graphs=False)
    engines.cuda_engine(installed.path, record, 64)
    assert made == [False, True]
