#!/bin/bash
# The CUDA engine's GPU tests and benchmark on an H200 host (no network there).
# onnxruntime-gpu's wheel (255 MB) is larger than one run may carry, so it travels in parts. Here:
#   python3 -m pip download onnxruntime-gpu==1.31.1 --no-deps --only-binary=:all: \
#       --platform manylinux_2_28_x86_64 --python-version 3.12 --implementation cp -d W
#   (cd W && sha256sum onnxruntime_gpu-*.whl > parts.sha256 && mkdir -p parts && split -n 6 -d onnxruntime_gpu-*.whl parts/p)
# with this repository's code copied to W/code (an ignored folder that the runs carry). There, one run each:
#   W/code/benchmarks/gpu_machine.sh part       one per part (carrying W/parts/pNN), back to back
#   W/code/benchmarks/gpu_machine.sh prepare    starts the benchmark's model export in the background
#   W/code/benchmarks/gpu_machine.sh go         joins and installs the wheel, GPU tests, the benchmark
# Or, with onnxruntime-gpu already importable (the lead's .gpu/ort.sh: `. .gpu/ort.sh` first), one run:
#   CODE/benchmarks/gpu_machine.sh all          exports in the background while the GPU tests run, then the
#                                               benchmark; WITH_3B=1 adds the Llama-3.2-3B shape. Writes 6
#                                               files to $OUT: gpu_tests.log, prepare.log, bench.log,
#                                               cuda_bench.json, cuda_bench.md, cuda_bench.png
set -u
CODE=$(cd "$(dirname "$0")/.." && pwd)
W=$(dirname "$CODE")
TREE=$PWD
WHEEL=/tmp/whl/onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl
[ -d "$CODE/bundler/demo/models" ] || cp -r "$TREE/bundler/demo/models" "$CODE/bundler/demo/"
case "${1:-}" in
  part)
    mkdir -p /tmp/parts && cp "$W"/parts/p* /tmp/parts/ && ls -la /tmp/parts ;;
  prepare)
    mkdir -p /tmp/bench && cd "$CODE"
    setsid nohup python3 benchmarks/bench_cuda.py prepare --work /tmp/bench >/tmp/bench/prepare.log 2>&1 </dev/null &
    echo $! > /tmp/bench/PREPARING
    echo "prepare started" ;;
  go)
    out=${OUT:-/tmp/out}
    mkdir -p /tmp/whl "$out"
    cat /tmp/parts/p* > "$WHEEL"
    (cd /tmp/whl && sha256sum -c "$W/parts.sha256") || exit 3
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEEL" || exit 4
    cd "$CODE"
    export PYTHONPATH=/tmp/site:$CODE PYTHONUNBUFFERED=1
    python3 -c "import onnxruntime as o; print(o.__version__, o.__file__, o.get_available_providers())"
    nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader
    python3 -c "from runtime.engines.cudalib import gpu; from runtime.detect import detect_target; print(gpu()); print(detect_target())"
    timeout 300 python3 -m pytest -q -rs -p no:cacheprovider tests/runtime/engines/test_cuda_engine.py \
      tests/runtime/engines/test_cuda_engine_host.py tests/runtime/engines/test_cuda_device.py 2>&1 | tee "$out/gpu_tests.log" | tail -25
    while [ ! -f /tmp/bench/PREPARED ]; do
      sleep 2
      pgrep -f "bench_cuda.py prepare" >/dev/null || [ -f /tmp/bench/PREPARED ] || { cat /tmp/bench/prepare.log; exit 5; }
    done
    cp /tmp/bench/prepare.log "$out/"
    timeout "${BENCH_TIMEOUT:-400}" python3 benchmarks/bench_cuda.py run --work /tmp/bench --out "$out" ${QUICK:+--quick} 2>&1 | tee "$out/bench.log" | tail -40 ;;
  all)
    out=${OUT:-/tmp/out}
    mkdir -p /tmp/bench "$out"
    cd "$CODE"
    export PYTHONPATH=$CODE:${PYTHONPATH:-} PYTHONUNBUFFERED=1
    # a `prepare` started earlier (setsid, in the background) may still be exporting: two exports into one
    # folder delete each other's work, so wait for it rather than start a second one
    while [ -f /tmp/bench/PREPARING ] && kill -0 "$(cat /tmp/bench/PREPARING)" 2>/dev/null; do sleep 2; done
    python3 benchmarks/bench_cuda.py prepare --work /tmp/bench ${WITH_3B:+--with-3b} >>/tmp/bench/prepare.log 2>&1 </dev/null &
    prep=$!
    python3 -c "import onnxruntime as o; print(o.__version__, o.__file__, o.get_available_providers())"
    nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader
    timeout 300 python3 -m pytest -q -rs -p no:cacheprovider tests/runtime/engines/test_cuda_engine.py \
      tests/runtime/engines/test_cuda_engine_host.py tests/runtime/engines/test_cuda_device.py 2>&1 | tee "$out/gpu_tests.log" | tail -25
    wait $prep
    cp /tmp/bench/prepare.log "$out/"
    [ -f /tmp/bench/PREPARED ] || { tail -20 /tmp/bench/prepare.log; exit 5; }
    timeout "${BENCH_TIMEOUT:-330}" python3 benchmarks/bench_cuda.py run --work /tmp/bench --out "$out" ${QUICK:+--quick} 2>&1 | tee "$out/bench.log" | tail -60 ;;
  *) echo "usage: $0 part|prepare|go|all" >&2; exit 2 ;;
esac
