#!/bin/bash
# Speculation through `bundle serve` on an NVIDIA GPU host with no network: the demo pair's `cuda` bundles
# (draft model, EAGLE-3 head), then benchmarks/bench_serve_spec.py with the plain baseline in the same run.
#
# The host needs python3 with torch (the export), onnx, numpy, tokenizers, jinja2, click; the rest comes as
# files under .gpu/ at the repository root (ignored by git), made on a connected machine:
#   - onnxruntime-gpu as an xz tarball of its wheel's tree less what the engine never loads (the TensorRT
#     provider, libonnxruntime.so, the transformers/tools/quantization/datasets folders), split in parts:
#       pip download onnxruntime-gpu==1.31.1 --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
#         --python-version 3.12 --implementation cp -d W && mkdir x && cd x && unzip -q ../W/*.whl &&
#       rm -rf onnxruntime/capi/libonnxruntime_providers_tensorrt.so onnxruntime/capi/libonnxruntime.so.* \
#         onnxruntime/{transformers,tools,quantization,datasets} &&
#       tar cf - onnxruntime onnxruntime_gpu-1.31.1.dist-info | xz -9e -T2 > ../ort.tar.xz
#       sha256sum ort.tar.xz > .gpu/ort.sha256; split -b 33000000 -d ort.tar.xz .gpu/p
#   - the server's and the client's wheels in .gpu/whl/ (pip download --only-binary=:all: for cp312
#     manylinux x86_64 of: fastapi starlette pydantic pydantic_core uvicorn h11 prometheus_client zstandard
#     cryptography cffi openai llguidance opentelemetry-api annotated-doc, with their dependencies).
# A call of a remote-machine tool that carries at most ~64 MiB moves them in several calls, each run as
#   benchmarks/gpu_serve_spec.sh stash      copies what .gpu/ holds now to /tmp/gpu-stash (kept between calls)
# then one call that runs
#   benchmarks/gpu_serve_spec.sh prepare    installs onnxruntime-gpu and the wheels into /tmp/site, creates
#                                           and installs the demo (draft model) and demoe3 (EAGLE-3) bundles
#   benchmarks/gpu_serve_spec.sh prepare-cpu   the same, with the pair's cpu bundles democpu and democpue3 (the
#                                           host's CPU cores through the same bench)
#   benchmarks/gpu_serve_spec.sh bench ARGS...   bench_serve_spec.py ARGS with the store and --out set
#   benchmarks/gpu_serve_spec.sh after-draft NAME [ARGS...]   bench_plain_after_draft.py on an installed bundle (what
#                                           a plain step costs after drafted ones; seconds, not minutes)
#   benchmarks/gpu_serve_spec.sh step-times NAME --fixed CONFIG [ARGS...]   bench_step_times.py on an installed bundle
#                                           (its adaptive length against a fixed one, step by step; seconds)
#   benchmarks/gpu_serve_spec.sh tests [PYTEST ARGS...]   pytest over the installed onnxruntime-gpu (the host's pytest)
#   benchmarks/gpu_serve_spec.sh eagle3-slots [ARGS...]   bench_eagle3_slots.py --cuda (the demo head alone: a step's
#                                           chains per slot, over slots, with CUDA graphs, chained on the device)
# Writes under $OUT (default /tmp/out): prepare.log, bench.log, the results .md/.json, server-logs.tgz.
# Checked on a machine without a GPU: stash, the tarball's reassembly and checksum, create and install (the
# cp312 wheels need the host's Python 3.12). The whole script ran on one H100 (x86_64, Python 3.12, PyTorch with
# its nvidia-* CUDA 13 wheels), except after-draft, which has run only on CPU bundles without this script; none of it
# has run on an aarch64 host.
set -u -o pipefail
CODE=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/out}
stash=/tmp/gpu-stash
site=/tmp/site
store=/tmp/serve-spec-store
mkdir -p "$out" "$stash/whl"
mode=${1:-}
[ $# -gt 0 ] && shift

environment() {  # onnxruntime-gpu links the CUDA 13 libraries by name: those of the nvidia-* packages beside PyTorch
  NV=$(python3 -c "import nvidia, os; print(':'.join(sorted({r for p in nvidia.__path__ for r, _, fs in os.walk(p) if any(f.startswith('lib') and '.so' in f for f in fs)})))")
  export LD_LIBRARY_PATH=$NV:${LD_LIBRARY_PATH:-} PYTHONPATH=$site:$CODE PYTHONUNBUFFERED=1
}

in_code() {  # the environment above, in the repository root
  environment
  cd "$CODE" || exit 9
}

case "$mode" in
  stash)
    cp "$CODE"/.gpu/p[0-9]* "$CODE"/.gpu/ort.sha256 "$stash"/ 2>/dev/null
    cp "$CODE"/.gpu/whl/*.whl "$stash/whl/" 2>/dev/null
    ls "$stash" "$stash/whl" | tr '\n' ' '; echo ;;
  prepare|prepare-cpu)
    {
      if [ ! -f "$site/onnxruntime/__init__.py" ]; then
        cat "$stash"/p[0-9]* > /tmp/ort.tar.xz
        (cd /tmp && echo "$(cut -d' ' -f1 "$stash/ort.sha256")  ort.tar.xz" | sha256sum -c -) || exit 3
        mkdir -p "$site"
        python3 -c "import sys, tarfile; tarfile.open(sys.argv[1], 'r:xz').extractall(sys.argv[2], filter='data')" \
          /tmp/ort.tar.xz "$site" || exit 4
        rm -f /tmp/ort.tar.xz
        python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" "$stash"/whl/*.whl || exit 5
      fi
      environment
      python3 -c "import onnxruntime as o; print('onnxruntime', o.__version__, o.get_available_providers())"
      nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader
      cd "$CODE" || exit 9
      git log -1 --format='commit %H %s' 2>/dev/null || true
      create() {  # NAME TARGET [bundle create flags]: an unsigned bundle of the demo pair, installed in the store
        local name=$1 target=$2; shift 2
        [ -d "$store/bundles/$name" ] && return 0
        python3 -c "import sys; from bundler.cli.pack import create; create.main(sys.argv[1:])" --targets "$target" \
          --name "$name" --version 1 --unsigned --no-progress --no-runtime --out "/tmp/bundles/$name" "$@" || exit 6
        python3 -m runtime.cli.main install "/tmp/bundles/$name" --store "$store" --target "$target" --allow-unsigned \
          --force-target || exit 7
      }
      eagle3='{"method": "eagle3", "num_speculative_tokens": 3}'
      if [ "$mode" = prepare ]; then
        create demo cuda
        create demoe3 cuda --speculative-config "$eagle3"
      else  # the same pair's cpu bundles, to measure this host's CPU cores
        create democpu cpu
        create democpue3 cpu --speculative-config "$eagle3"
      fi
    } 2>&1 | tee -a "$out/prepare.log" | tail -40 ;;
  bench)
    in_code
    rm -rf /tmp/serve-logs && mkdir -p /tmp/serve-logs
    timeout "${BENCH_TIMEOUT:-560}" python3 benchmarks/bench_serve_spec.py "$@" --store "$store" --out "$out" \
      --log-dir /tmp/serve-logs 2>&1 | tee "$out/bench.log" | tail -60
    rc=$?
    tar czf "$out/server-logs.tgz" -C /tmp serve-logs  # (few files come back: the servers' logs in one)
    exit $rc ;;
  after-draft)
    in_code
    name=${1:?usage: $0 after-draft NAME [ARGS...]}; shift
    python3 benchmarks/bench_plain_after_draft.py "$name" --store "$store" --out "$out/bench_plain_after_draft_$name.md" \
      "$@" 2>&1 | tail -20 ;;
  step-times)
    in_code
    name=${1:?usage: $0 step-times NAME --fixed CONFIG [ARGS...]}; shift
    python3 benchmarks/bench_step_times.py "$name" --store "$store" --out "$out/bench_step_times_$name.md" "$@" 2>&1 \
      | grep -v "W:onnxruntime" | tail -40 ;;
  tests)
    in_code
    timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -rs -p no:cacheprovider "$@" 2>&1 | tee "$out/gpu_tests.log" \
      | tail -30 ;;
  eagle3-slots)
    in_code
    python3 benchmarks/bench_eagle3_slots.py --cuda "$@" 2>&1 | tee "$out/bench_eagle3_slots.md" | tail -20 ;;
  *) echo "usage: $0 stash | prepare | prepare-cpu | bench BENCH_SERVE_SPEC_ARGS... | after-draft NAME [ARGS...] |" \
       "step-times NAME --fixed CONFIG [ARGS...] | tests [PYTEST ARGS...] | eagle3-slots [ARGS...]" >&2; exit 2 ;;
esac
