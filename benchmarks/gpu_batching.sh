#!/bin/bash
# benchmarks/bench_batching.py on an H200 host's 16 CPU cores (no network there).
# Run from the repository root:  bash benchmarks/gpu_batching.sh
# That machine has Python 3.12, numpy, onnx, onnxruntime (CPU), torch, transformers, tokenizers, jinja2,
# click, but not the server's packages: they come as wheels in .whl/ at the repository root, made here with
#   python3 -m pip download --only-binary=:all: --no-deps --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
#     typing-inspection==0.4.5 annotated-doc==0.0.7 opentelemetry-api==1.45.2 anyio==4.16.0 sniffio==1.3.1 \
#     h11==0.16.0 uvicorn==0.54.0 httpx==0.28.1 httpcore==1.0.9 certifi==2026.10.19.post1 idna==3.20 \
#     prometheus_client==0.26.0 zstandard==0.25.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 \
#     typing_extensions==4.16.0
# (22 wheels, 14.4 MB; the versions of this repository's .venv. zstandard and cryptography are imported by
# bundler.pack.pack, which bundler.pack.engines imports to export the demo graphs.)
# Writes under $OUT (default /tmp/out), 4 files: bench.log (the printed table and targets), results.json,
# tokens_per_s.png (when matplotlib is there) and env.txt (versions, cores, load).
set -u
out=${OUT:-/tmp/out}
mkdir -p "$out"
ls .whl/*.whl >/dev/null 2>&1 || { echo "expected the server's wheels in .whl/ (see the header of $0)" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{
  python3 -c "import sys, onnxruntime, numpy, fastapi, uvicorn; print(sys.version.split()[0], 'onnxruntime', onnxruntime.__version__, 'numpy', numpy.__version__, 'fastapi', fastapi.__version__, 'uvicorn', uvicorn.__version__)"
  echo "cores: $(nproc)"; uptime
  git log -1 --format='commit %H %s' 2>/dev/null || true
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
# 4 stream counts x 5 servers x 3 interleaved runs, prefix caching, no guidellm (not installed there)
timeout "${BENCH_TIMEOUT:-540}" python3 benchmarks/bench_batching.py --out "$out" --streams "${STREAMS:-1,4,8,16}" \
  --repeats "${REPEATS:-3}" --no-guidellm 2>&1 | tee "$out/bench.log" | tail -45
exit "${PIPESTATUS[0]}"
