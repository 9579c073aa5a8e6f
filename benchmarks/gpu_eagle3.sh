#!/bin/bash
# Train the demo target's EAGLE-3 head On an H200 host with several recipes side by side (train_eagle3
# --recipe v3 / v3s / v3xs: the same data and schedule, smaller and smaller heads), measure each in the same
# run against the demo draft and the committed head, and keep the smallest head that beats the draft.
#
# Needs only what an H200 host has (python3 with torch+CUDA, transformers, tokenizers, safetensors,
# numpy; onnx + onnxruntime for the optional bench): no wheels to carry. Data are made there from its
# Python's standard library with the COMMITTED tokenizer; the held-out prompts are the committed 200
# (bundler/demo/heldout_prompts.json); the target answers the training questions once for all recipes.
# The device tool replaces the working tree at every call: run `start` from a copy (cp -r . /tmp/repo).
#
#   benchmarks/gpu_eagle3.sh start     starts everything in the background (setsid) and returns at once
#   benchmarks/gpu_eagle3.sh collect   waits (up to WAIT seconds, default 560) for it, copies results to $OUT
#   benchmarks/gpu_eagle3.sh run       both in the foreground (about 9-10 minutes)
#   benchmarks/gpu_eagle3.sh status    the log's tail
#
# Results under $OUT: config.json + model.safetensors (the picked head, public layout: commit to
# bundler/demo/models/eagle3/ if better), training_metrics.json (its recipe, curves, held-out checkpoint
# selection and acceptance_k3), metrics-RECIPE.json and train-RECIPE.log per recipe, train.log, summary.txt
# (every head, the committed head and the draft: parameters, acceptance, mean acceptance length, which was
# picked), bench.log (bench_eagle3 on the CPU cores with the picked head, when BENCH=1, the default),
# bench_cuda.log (the same with --cuda, only when onnxruntime-gpu loads: set EXTRA_SITE=/tmp/site).
# Knobs: SECONDS_BUDGET (training time limit per recipe, default 300), RECIPES ("v3 v3s v3xs"), BENCH (1/0),
# WORK (/tmp/eagle3), TINY=1 (a seconds-long smoke run of the same path on any CPU: tiny sizes, 12 files),
# TOKENS_TAR (a .tar.xz holding tokens/, made with train_eagle3's prepare_tokens elsewhere, e.g. from the
# CPython 3.11.7 standard library the demo pair was trained on: then nothing is prepared there).
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=${WORK:-/tmp/eagle3}
SECONDS_BUDGET=${SECONDS_BUDGET:-300}
RECIPES=${RECIPES:-v3 v3s v3xs}  # trained side by side; the first also measures the draft and the committed head

job() {  # the whole run; writes $WORK/DONE (exit status) last
  cd "$REPO" || exit 9
  export PYTHONPATH=${EXTRA_SITE:+$EXTRA_SITE:}$REPO PYTHONUNBUFFERED=1
  rc=0
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"
  set -- $RECIPES
  common="--tokens $WORK/tokens --target bundler/demo/models/target ${TINY:+--tiny}"
  # data and the target's answers once, then every recipe side by side on the one GPU (each is launch-bound)
  if [ -n "${TOKENS_TAR:-}" ]; then  # token streams made elsewhere (train_eagle3 prepare_tokens), as a .tar.xz of tokens/
    python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$TOKENS_TAR" "$WORK" || rc=$?
    prepare=""
  else
    prepare="--prepare $WORK/data ${TINY:+--max-files 12}"
  fi
  [ "$rc" != 0 ] || python3 -m bundler.demo.train_eagle3 --recipe "$1" $common --out "$WORK/unused" --answers-only \
      $prepare || rc=$?
  pids=""
  extra="--draft bundler/demo/models/draft --baseline-head bundler/demo/models/eagle3"
  for r in $RECIPES; do
    [ "$rc" = 0 ] || break
    python3 -m bundler.demo.train_eagle3 --recipe "$r" $common --seconds "$SECONDS_BUDGET" $extra \
        --out "$WORK/head-$r" > "$WORK/train-$r.log" 2>&1 &
    pids="$pids $!"
    extra=""  # the first recipe alone measures the draft and the committed head
  done
  for p in $pids; do wait "$p" || rc=$?; done
  for r in $RECIPES; do echo "== $r"; tail -3 "$WORK/train-$r.log"; done
  # the smallest head that beats the draft's mean acceptance length, else the one with the longest
  [ "$rc" = 0 ] || : > "$WORK/summary.txt"
  [ "$rc" != 0 ] || python3 - "$WORK" $RECIPES <<'EOF' > "$WORK/summary.txt" 2>&1 || rc=8
import json, shutil, sys
work, recipes = sys.argv[1], sys.argv[2:]
runs = {r: json.load(open(f"{work}/head-{r}/training_metrics.json")) for r in recipes}
base = runs[recipes[0]]["acceptance_k3"]
rows = {f"eagle3 {r}": m["acceptance_k3"]["eagle3"] for r, m in runs.items()}
rows.update({"eagle3 committed": base["eagle3_baseline"], "draft_model": base["draft_model"]})
for r, m in runs.items():
    print(f"recipe {r}: {m['config']}\n  steps {m['steps_done']} in {m['train_seconds']} s, total {m['total_seconds']} s")
for name, a in rows.items():
    print(f"{name:18s} parameters {a.get('parameters', 0):>9,}  acceptance {a['rate']:.3f}  "
          f"mean acceptance length {a['mean_acceptance_length']:.3f}  ({a['accepted']}/{a['drafted']})")
draft = base["draft_model"]["mean_acceptance_length"]
better = [r for r in recipes if runs[r]["acceptance_k3"]["eagle3"]["mean_acceptance_length"] > draft]
pick = min(better, key=lambda r: runs[r]["head_parameters"]) if better else max(
    recipes, key=lambda r: runs[r]["acceptance_k3"]["eagle3"]["mean_acceptance_length"])
print(f"picked {pick}: " + ("BETTER than the draft" if better else "NOT better than the draft"))
shutil.copytree(f"{work}/head-{pick}", f"{work}/head", dirs_exist_ok=True)
EOF
  cat "$WORK/summary.txt"
  if [ "$rc" = 0 ] && [ "${BENCH:-1}" = 1 ]; then
    # the ONNX graphs on the CPU cores (onnxruntime CPU), same run: plain / draft_model / ngram / eagle3
    timeout 400 python3 benchmarks/bench_eagle3.py --threads "${BENCH_THREADS:-8}" --repeats 3 ${TINY:+--tokens 8 --ks 3} \
        --head "$WORK/head" > "$WORK/bench.log" 2>&1 || echo "bench_eagle3 exited $?" >> "$WORK/bench.log"
    if python3 -c "import sys; from runtime.engines.cudalib import onnxruntime_cuda; sys.exit(onnxruntime_cuda()[0] is None)"; then
      timeout 400 python3 benchmarks/bench_eagle3.py --cuda --threads "${BENCH_THREADS:-8}" --repeats 3 \
          --head "$WORK/head" > "$WORK/bench_cuda.log" 2>&1 || echo "bench_eagle3 --cuda exited $?" >> "$WORK/bench_cuda.log"
    fi
  fi
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
  for r in $RECIPES; do
    [ -f "$WORK/head-$r/training_metrics.json" ] && cp "$WORK/head-$r/training_metrics.json" "$out/metrics-$r.json"
    [ -f "$WORK/train-$r.log" ] && cp "$WORK/train-$r.log" "$out/"
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
