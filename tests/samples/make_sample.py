"""Make a frozen sample bundle for the current format version (run by hand, once per format version).

    python -m tests.samples.make_sample        # writes tests/samples/format-v<N>/ and never overwrites

The sample is a tiny random Llama pair with cpu engines, signed by a key made here whose private half is
thrown away; `expected.json` records what serving it must produce. From format 2 on it also carries a
wheelhouse: one tiny real wheel (`sample-runtime`, listed for every Linux platform) and the bootstrap of
the day, which the test runs to install that wheel (the real runtime's wheels are far too big to commit). tests/samples/test_samples.py verifies,
installs and serves every committed sample on every run, so a change that breaks bundles already on
devices fails CI (as model-signing re-verifies signatures made by its old releases).
"""

from __future__ import annotations

import json
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from bundler.pack.create import CreateOptions, create_bundle, local_model
from bundler.pack.engines import target_files_hook
from bundler.pack.keys import generate_key, load_private_key
from manifests.schema import FORMAT_VERSION, Builder

HERE = Path(__file__).resolve().parent
PROMPT = [5, 17, 42, 99, 7]
MAX_TOKENS = 12
#: format 2's wheelhouse: (distribution, version, the value its module holds)
SAMPLE_RUNTIME = ("sample-runtime", "1.0", "installed from a format-2 wheelhouse")
SAMPLE_PLATFORMS = [f"linux_{arch}-cp3{minor}" for arch in ("x86_64", "aarch64") for minor in range(10, 15)]


def greedy_tokens(installed, prompt=PROMPT, max_tokens=MAX_TOKENS) -> dict:
    from runtime.serve.sampling import SamplingParams
    from runtime.server.loader import load_serving_model

    out = {}
    for method in ("none", "draft_model"):
        model = load_serving_model(installed, no_speculation=method == "none")
        from runtime.serve.generator import Generator

        steps = Generator.over(model.runner).generate(prompt, SamplingParams(temperature=0.0), max_tokens=max_tokens)
        out[method] = [t for s in steps for t in s.tokens]
    return out


def main() -> int:
    from runtime.store.store import Store
    from runtime.store.trust import load_public_key
    from tests.models import make_tiny_checkpoint

    dest = HERE / f"format-v{FORMAT_VERSION}"
    if dest.exists():
        print(f"{dest} exists: samples are frozen, never rewritten", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        target = make_tiny_checkpoint(work / "target", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                      intermediate_size=64, max_positions=64, seed=0)
        draft = make_tiny_checkpoint(work / "draft", hidden_size=16, num_layers=1, num_heads=1, num_kv_heads=1,
                                     intermediate_size=32, max_positions=64, seed=1, tokenizer_from=target)
        generate_key(work / "sample.key")
        wheelhouse = None
        if FORMAT_VERSION >= 2:
            from bundler.pack.wheelhouse import wheelhouse_from_files
            from tests.wheels import make_wheel

            wheel = make_wheel(work / "wheels", SAMPLE_RUNTIME[0], SAMPLE_RUNTIME[1],
                               module_source=f"VALUE = {SAMPLE_RUNTIME[2]!r}\n")
            wheelhouse = wheelhouse_from_files(SAMPLE_RUNTIME[0], SAMPLE_RUNTIME[1],
                                               {p: [wheel] for p in SAMPLE_PLATFORMS})
        create_bundle(dest / "bundle", CreateOptions(name="sample", version=1, model=local_model(target, "target"),
                      draft=local_model(draft, "draft"), targets=["cpu"],
                      sign_keys=[load_private_key(work / "sample.key")], progress=False,
                      now=datetime(2026, 11, 29, tzinfo=timezone.utc),
                      builder=Builder("bundle", "sample", "sample-host", "linux-x86_64"),
                      target_files=target_files_hook(), wheelhouse=wheelhouse))
        (dest / "sample.key.pub").write_bytes((work / "sample.key.pub").read_bytes())
        trusted = dict([load_public_key(dest / "sample.key.pub")])
        installed = Store(work / "store").install(dest / "bundle", target="cpu", trusted=trusted, progress=False)
        expected = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "greedy": greedy_tokens(installed)}
        if wheelhouse is not None:
            expected["runtime"] = {"package": SAMPLE_RUNTIME[0], "version": SAMPLE_RUNTIME[1],
                                   "module": SAMPLE_RUNTIME[0].replace("-", "_"), "value": SAMPLE_RUNTIME[2]}
    (dest / "expected.json").write_text(json.dumps(expected, indent=2) + "\n")
    print(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
