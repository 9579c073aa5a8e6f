#!/bin/bash
# Train the demo target's EAGLE-3 head with the improved recipe (train_eagle3 --recipe v2) on the GPU
# machine, and measure it in the same run against the demo draft and the committed head.
#
# Needs only what the GPU machine has (python3 with torch+CUDA, transformers, tokenizers, safetensors,
# numpy; onnx + onnxruntime for the optional bench): no wheels to carry. Run from the repository root
# (the device tool's working directory). Data are made there from its Python's standard library with the
# COMMITTED tokenizer; the held-out prompts are the committed 200 (bundler/demo/heldout_prompts.json).
#
#   benchmarks/gpu_eagle3.sh start     starts everything in the background (setsid) and returns at once
#   benchmarks/gpu_eagle3.sh collect   waits (up to WAIT seconds, default 560) for it, copies results to $OUT
#   benchmarks/gpu_eagle3.sh run       both in the foreground (about 9-11 minutes: more than one 10-minute call)
#   benchmarks/gpu_eagle3.sh status    the log's tail
#
# Results under $OUT (at most 7 files, the largest ~3.5 MB): config.json + model.safetensors (the head, public
# layout: commit to bundler/demo/models/eagle3/ if better), training_metrics.json (recipe, curves and
# acceptance_k3 of eagle3 / eagle3_baseline (the committed head) / draft_model, with mean_acceptance_length
# and parameters), train.log, bench.log (bench_eagle3 on the CPU cores with the new head, when BENCH=1,
# the default), bench_cuda.log (the same with --cuda, only when onnxruntime-gpu loads: set EXTRA_SITE=/tmp/site
# after gpu_machine.sh's `go` installed it there), summary.txt.
# Knobs: SECONDS_BUDGET (training time limit, default 240), RECIPE (v2), BENCH (1/0), WORK (/tmp/eagle3),
# TINY=1 (a seconds-long smoke run of the same path on any CPU: tiny sizes, 12 standard-library files).
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=${WORK:-/tmp/eagle3}
SECONDS_BUDGET=${SECONDS_BUDGET:-240}
RECIPE=${RECIPE:-v2}

job() {  # the whole run; writes $WORK/DONE (exit status) last
  cd "$REPO" || exit 9
  export PYTHONPATH=${EXTRA_SITE:+$EXTRA_SITE:}$REPO PYTHONUNBUFFERED=1
  rc=0
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"
  python3 -m bundler.demo.train_eagle3 --recipe "$RECIPE" --seconds "$SECONDS_BUDGET" ${TINY:+--tiny --max-files 12} \
      --prepare "$WORK/data" --tokens "$WORK/tokens" \
      --target bundler/demo/models/target --draft bundler/demo/models/draft \
      --baseline-head bundler/demo/models/eagle3 --out "$WORK/head" || rc=$?
  if [ "$rc" = 0 ] && [ "${BENCH:-1}" = 1 ]; then
    # the ONNX graphs on the CPU cores (onnxruntime CPU), same run: plain / draft_model / ngram / eagle3
    timeout 400 python3 benchmarks/bench_eagle3.py --threads "${BENCH_THREADS:-8}" --repeats 3 ${TINY:+--tokens 8 --ks 3} \
        --head "$WORK/head" > "$WORK/bench.log" 2>&1 || echo "bench_eagle3 exited $?" >> "$WORK/bench.log"
    if python3 -c "import sys; from runtime.cuda import onnxruntime_cuda; sys.exit(onnxruntime_cuda()[0] is None)"; then
      timeout 400 python3 benchmarks/bench_eagle3.py --cuda --threads "${BENCH_THREADS:-8}" --repeats 3 \
          --head "$WORK/head" > "$WORK/bench_cuda.log" 2>&1 || echo "bench_eagle3 --cuda exited $?" >> "$WORK/bench_cuda.log"
    fi
  fi
  python3 - "$WORK" <<'EOF' > "$WORK/summary.txt" 2>&1
import json, sys
m = json.load(open(sys.argv[1] + "/head/training_metrics.json"))
print(f"recipe {m['config']}\nsteps {m['steps_done']} in {m['train_seconds']} s, total {m['total_seconds']} s")
for name, r in m["acceptance_k3"].items():
    print(f"{name:16s} parameters {r.get('parameters', 0):>9,}  acceptance {r['rate']:.3f}  "
          f"mean acceptance length {r['mean_acceptance_length']:.3f}  ({r['accepted']}/{r['drafted']})")
a = m["acceptance_k3"]
print("BETTER than the draft" if a["eagle3"]["mean_acceptance_length"] > a["draft_model"]["mean_acceptance_length"]
      else "NOT better than the draft")
print("BETTER than the committed head" if a["eagle3"]["mean_acceptance_length"] >
      a["eagle3_baseline"]["mean_acceptance_length"] else "NOT better than the committed head")
EOF
  echo "$rc" > "$WORK/DONE"
}

collect() {
  out=${OUT:-/tmp/out}
  mkdir -p "$out"
  end=$(( $(date +%s) + ${WAIT:-560} ))
  while [ ! -f "$WORK/DONE" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
  for f in head/config.json head/model.safetensors head/training_metrics.json train.log bench.log bench_cuda.log \
      summary.txt; do
    [ -f "$WORK/$f" ] && cp "$WORK/$f" "$out/"
  done
  [ -f "$out/summary.txt" ] && cat "$out/summary.txt"
  if [ ! -f "$WORK/DONE" ]; then echo "still running (collect again):"; tail -5 "$WORK/train.log"; exit 75; fi
  exit "$(cat "$WORK/DONE")"
}

case "${1:-}" in
  start)
    rm -rf "$WORK" && mkdir -p "$WORK"
    setsid nohup bash "$0" _job > "$WORK/train.log" 2>&1 < /dev/null &
    echo "started (pid $!); log $WORK/train.log" ;;
  _job) job ;;
  collect) collect ;;
  run)
    rm -rf "$WORK" && mkdir -p "$WORK"
    job > "$WORK/train.log" 2>&1
    WAIT=0 collect ;;
  status) tail -20 "$WORK/train.log" ;;
  *) echo "usage: $0 start|collect|run|status" >&2; exit 2 ;;
esac
