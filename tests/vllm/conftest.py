"""The server these adapted vLLM tests talk to: one real `bundle serve` server (uvicorn on a loopback port,
configured as the CLI configures it) over the tiny test bundle (random weights, a real byte-level BPE
tokenizer and chat template, a draft model for speculative decoding), started once for the whole directory
and driven through the official `openai` client, as vLLM's RemoteOpenAIServer is."""

from __future__ import annotations

import openai
import pytest

# the session fixtures that build and install the tiny bundle (shared with tests/runtime/serve/)
from tests.runtime.serve.conftest import RunningServer, demo_installed, installed_bundle, tiny_models  # noqa: F401

#: the name the tiny bundle is served under; stands in for vLLM's MODEL_NAME
MODEL_NAME = "tiny"


@pytest.fixture(scope="module")  # per file, so its log lines never reach another file's captured stderr
def vllm_server(installed_bundle):  # noqa: F811
    from runtime.server.app import OpenAIServer
    from runtime.server.loader import load_serving_model
    from runtime.server.serving_engine import ServeOptions
    from runtime.store.store import Store

    serving_model = load_serving_model(Store(installed_bundle.store).current("tiny"))  # its own engine

    s = RunningServer(OpenAIServer(serving_model, ServeOptions(max_queued_requests=8, max_num_seqs=4,
                                                               log_interval_s=60.0)))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def demo_server(demo_installed):  # noqa: F811
    """The trained demo pair (4.4 M target + draft, 512 tokens that all decode to text), served with the serve
    defaults its bundle carries: for tests whose assertions need a model whose tokens are words."""
    from runtime.server.options import ServeConfig, apply_serve_config

    installed, _ = demo_installed
    s = RunningServer(apply_serve_config(installed, ServeConfig()).serving)
    yield s
    s.stop()


@pytest.fixture()
def server(vllm_server):
    """vLLM's RemoteOpenAIServer, as far as its tests use it: url_for()."""
    return vllm_server


@pytest.fixture()
def client(vllm_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=vllm_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def url_for(server, *parts: str) -> str:
    return server.url + "/" + "/".join(str(p).strip("/") for p in parts)


# vLLM's tests/entrypoints/conftest.py fixtures, smaller where a tiny random model must finish them
@pytest.fixture
def sample_structured_outputs_choices():
    return ["Python", "Java", "JavaScript", "C++", "C#", "PHP", "TypeScript", "Ruby", "Swift", "Kotlin"]


@pytest.fixture
def sample_regex():
    return (r"((25[0-5]|(2[0-4]|1\d|[1-9]|)\d)\.){3}"
            r"(25[0-5]|(2[0-4]|1\d|[1-9]|)\d)")


@pytest.fixture
def sample_json_schema():
    # vLLM's employee-profile schema, cut to what a random 64-wide model finishes within max_model_len
    return {"type": "object",
            "properties": {"name": {"type": "string", "maxLength": 8},
                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["name", "age"], "additionalProperties": False}
