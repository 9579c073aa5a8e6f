#!/bin/bash
# The GPU test suite on the project's GPU machine (device tool; no network there), each run one pytest
# process over every file (what shows state that one engine leaves to the next), its log in $OUT/NAME.log.
#
# onnxruntime-gpu (255 MB wheel) travels as parts of an xz tarball of the wheel less what the engine never
# loads (TensorRT's provider, libonnxruntime.so: the C API, which the Python module does not link, and the
# transformers/tools/quantization/datasets folders): 185 MiB in 6 parts, each beside the ~28 MiB tree under
# one call's 64 MiB. The suite also needs zstandard and cryptography (with cffi, pycparser), which the
# machine's image lacks: wheels, in the first two calls beside smaller parts. Prepare here (all ignored):
#   pip download onnxruntime-gpu==1.31.1 --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
#       --python-version 3.12 --implementation cp -d W && mkdir x && (cd x && unzip -q ../W/*.whl &&
#     rm -rf onnxruntime/capi/libonnxruntime_providers_tensorrt.so onnxruntime/capi/libonnxruntime.so.* \
#            onnxruntime/{transformers,tools,quantization,datasets} &&
#     tar cf - onnxruntime onnxruntime_gpu-1.31.1.dist-info | xz -9e -T2 > ../ort.tar.xz)
#   mkdir -p .gpu && sha256sum ort.tar.xz > .gpu/ort.sha256 && (cd .gpu && head -c 60000000 ../ort.tar.xz |
#     split -b 30000000 -d - p && tail -c +60000001 ../ort.tar.xz | split -b 34000000 -d --numeric-suffixes=2 - p)
#   pip download --no-deps --only-binary=:all: (README of the device tool: --python-version 3.12 and the
#     manylinux platforms) -d .whl zstandard cryptography cffi pycparser
# There, back to back (the machine goes back 30 s after a call and with it /tmp; each call replaces the
# working tree): one call per part but the last, carrying .gpu/pNN (the first two also the wheels):
#   mkdir -p /tmp/p /tmp/whl && cp .gpu/p* /tmp/p/ && { cp .whl/*.whl /tmp/whl/ 2>/dev/null; true; }
# then one call carrying the last part, .gpu/ort.sha256 and the code:
#   CODE/benchmarks/gpu_tests.sh NAME [pytest arguments]     (default: the GPU suite, SUITE below)
# Installs the parts and the wheels into /tmp/site once (a later call in the same lease skips it).
set -u -o pipefail
CODE=$(cd "$(dirname "$0")/.." && pwd)
TREE=$PWD
name=${1:?usage: $0 NAME [pytest arguments]}
shift
SUITE="tests/runtime/engines/test_cuda_engine.py tests/runtime/engines/test_cuda_device.py
  tests/runtime/engines/test_cuda_engine_host.py tests/runtime/engines/test_cuda_dual_host.py
  tests/runtime/engines/test_cuda_eagle3_host.py tests/runtime/engines/test_cuda_selection.py
  tests/runtime/engines/test_detect.py tests/runtime/engines/test_tensorrt.py"
# shellcheck disable=SC2086  # SUITE: one word a file
[ $# -gt 0 ] || set -- $SUITE
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/p
if [ ! -f /tmp/site/onnxruntime/__init__.py ]; then
  cp "$TREE"/.gpu/p[0-9]* /tmp/p/ 2>/dev/null
  ls /tmp/p | tr '\n' ' '; echo
  cat /tmp/p/p[0-9]* > /tmp/ort.tar.xz
  (cd /tmp && echo "$(cut -d' ' -f1 "$TREE/.gpu/ort.sha256")  ort.tar.xz" | sha256sum -c -) || exit 3
  mkdir -p /tmp/site
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1], 'r:xz').extractall(sys.argv[2], filter='data')" \
    /tmp/ort.tar.xz /tmp/site || exit 4
  rm -f /tmp/ort.tar.xz
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site /tmp/whl/*.whl || exit 5
fi
# onnxruntime-gpu links the CUDA 13 libraries by name: those of the nvidia-* packages beside PyTorch
NV=$(python3 -c "import nvidia, os; print(':'.join(sorted({r for p in nvidia.__path__ for r, _, fs in os.walk(p) if any(f.startswith('lib') and '.so' in f for f in fs)})))")
export LD_LIBRARY_PATH=$NV:${LD_LIBRARY_PATH:-} PYTHONPATH=/tmp/site:$CODE PYTHONUNBUFFERED=1
cd "$CODE"
{
  python3 -c "import onnxruntime as o; print('onnxruntime', o.__version__, o.get_available_providers())"
  nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader
  echo "== pytest $*"
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -rs -p no:cacheprovider "$@"
} 2>&1 | tee "$out/$name.log" | tail -30
