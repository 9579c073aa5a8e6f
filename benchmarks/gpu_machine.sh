#!/bin/bash
# The CUDA engine's GPU tests and benchmark on an NVIDIA GPU host where onnxruntime-gpu is already
# importable (an offline host: docs/offline-gpu-host.md says how to carry it and the other wheels there).
#   benchmarks/gpu_machine.sh            the GPU test files, then bench_cuda.py (its model export runs in the
#                                        background while the tests run); WITH_3B=1 adds the Llama-3.2-3B shape,
#                                        QUICK=1 the quick benchmark
#   benchmarks/gpu_machine.sh tests [pytest arguments]    the GPU test files only (or the files given)
# Writes to $OUT (default /tmp/out): gpu_tests.log, prepare.log, bench.log, cuda_bench.json/.md/.png.
set -u -o pipefail
CODE=$(cd "$(dirname "$0")/.." && pwd)
SUITE="tests/runtime/engines/test_cuda_engine.py tests/runtime/engines/test_cuda_device.py
  tests/runtime/engines/test_cuda_engine_host.py tests/runtime/engines/test_cuda_dual_host.py
  tests/runtime/engines/test_cuda_eagle3_host.py tests/runtime/engines/test_cuda_selection.py
  tests/runtime/engines/test_detect.py tests/runtime/engines/test_tensorrt.py
  tests/runtime/engines/test_cuda_families.py"
out=${OUT:-/tmp/out}
work=${WORK:-/tmp/bench}
mkdir -p "$out" "$work"
cd "$CODE"
export PYTHONUNBUFFERED=1
mode=${1:-all}
[ $# -gt 0 ] && shift
run_tests() {
  # shellcheck disable=SC2086  # SUITE: one word a file
  [ $# -gt 0 ] || set -- $SUITE
  python3 -c "import onnxruntime as o; print('onnxruntime', o.__version__, o.get_available_providers())"
  nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -rs -p no:cacheprovider "$@" 2>&1 | tee "$out/gpu_tests.log" | tail -30
}
case "$mode" in
  tests) run_tests "$@" ;;
  all)
    python3 benchmarks/bench_cuda.py prepare --work "$work" ${WITH_3B:+--with-3b} >"$work/prepare.log" 2>&1 </dev/null &
    prep=$!
    run_tests
    wait $prep
    cp "$work/prepare.log" "$out/"
    [ -f "$work/PREPARED" ] || { tail -20 "$work/prepare.log"; exit 5; }
    timeout "${BENCH_TIMEOUT:-400}" python3 benchmarks/bench_cuda.py run --work "$work" --out "$out" ${QUICK:+--quick} \
      2>&1 | tee "$out/bench.log" | tail -60 ;;
  *) echo "usage: $0 [all | tests [pytest arguments]]" >&2; exit 2 ;;
esac
