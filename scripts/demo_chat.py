"""Send one streamed chat request to a running `bundle serve`, print tokens as they arrive, then the speed."""

from __future__ import annotations

import argparse
import re
import sys
import time
import urllib.request

from openai import OpenAI


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for name in ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "spec_decode_num_drafts"):
        m = re.search(rf"^\S*{name}(?:_total)?(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--prompt", default="What does `shutil.copyfile(src, dst, *, follow_symlinks=True)` do?")
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    client = OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="unused")
    model = client.models.list().data[0].id
    print(f"user> {args.prompt}\nassistant> ", end="", flush=True)
    start = time.perf_counter()
    first = None
    usage = None
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": args.prompt}], max_tokens=args.max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                first = first or time.perf_counter()
                print(choice.delta.content, end="", flush=True)
    elapsed = time.perf_counter() - start
    m = scrape(args.port)
    n = usage.completion_tokens if usage else 0
    acc = m["spec_decode_num_accepted_tokens"] / m["spec_decode_num_draft_tokens"] if m["spec_decode_num_draft_tokens"] else 0.0
    print(f"\n\n{n} tokens in {elapsed:.2f} s = {n / elapsed:.1f} tok/s; "
          f"time to first token {((first or time.perf_counter()) - start) * 1000:.0f} ms; "
          f"draft acceptance {acc:.2f} ({m['spec_decode_num_accepted_tokens']:.0f}/{m['spec_decode_num_draft_tokens']:.0f})")
    return 0 if n > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
