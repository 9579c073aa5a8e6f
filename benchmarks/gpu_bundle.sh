#!/bin/bash
# bench_bundle.py on an H200 host's 16 CPU cores (no GPU used): 4 GiB in two 2 GiB files (every step,
# twice), 16 GiB in eight 2 GiB files, and one 2 GiB file alone; about 5 minutes, at most 9.
# Run from the repository root, with the device tool's `run` (carry .whl and .zstd). That machine has no
# zstandard, cryptography (+ cffi, pycparser) and no zstd binary; prepare them here, in the repo root:
#   python3 -m pip download --only-binary=:all: --no-deps --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl zstandard==0.25.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
#   (mkdir -p .zstd/deb && cd .zstd/deb && apt-get download zstd libzstd1 && for d in *.deb; do dpkg -x "$d" ..; done)
# Writes to $OUT (at most 8 files): gpu_bundle.log, bundle_4g.json, bundle_16g.json, bundle_2g_1file.json,
# bundle_16cores.png (when matplotlib is there), disk.txt.
# Disk: the input, the bundle and one step's output at a time: about 2.8x the input (45 GiB at 16 GiB).
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/out}
mkdir -p "$out"
exec > >(tee -a "$out/gpu_bundle.log") 2>&1
start=$(date +%s)
left() {  # seconds left of a budget counted from the start (at least 1: `timeout 0` would never stop)
  local n=$(( ${1} - ($(date +%s) - start) ))
  [ "$n" -gt 0 ] && echo "$n" || echo 1
}

PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}
SIZES=(${SIZES:-4 2 16})  # a dry run elsewhere: SIZES="0.25 0.125 0.5"
$PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$ROOT"/.whl/*.whl || exit 3
export PYTHONPATH=$SITE:$ROOT PYTHONUNBUFFERED=1
Z=$ROOT/.zstd
export PATH=$Z/usr/bin:$PATH LD_LIBRARY_PATH=$Z/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
zstd --version || exit 4
$PY -c "import zstandard, cryptography, tqdm; print('zstandard', zstandard.__version__, 'libzstd',
zstandard.ZSTD_VERSION, 'cryptography', cryptography.__version__)" || exit 5
plot=yes
$PY -c "import matplotlib" 2>/dev/null || { plot=""; echo "no matplotlib: no PNG"; }
nproc; free -g | head -2
work=${WORK:-/var/tmp/bench-bundle}
rm -rf "$work" && mkdir -p "$work"
df -h "$work"
B=benchmarks/bench_bundle.py
ALL=sha256sum,tar-zstd,zstd-d-tar-x,create,create-hash-first,pack,verify,install,install-whole-hash
cd "$ROOT"

# 4 GiB, two files: every step twice, interleaved (the machine is noisy; the faster run counts)
timeout "$(left 170)" $PY $B --work "$work" --size-gb "${SIZES[0]}" --steps $ALL --repeat 2 \
  --json "$out/bundle_4g.json" || echo "4 GiB run stopped (rc $?)"
# one 2 GiB file: what a file's sequential sha256 bounds (create) and what part digests lift (install)
rm -rf "$work"/*  # what a run cut short left
timeout "$(left 230)" $PY $B --work "$work" --size-gb "${SIZES[1]}" --files 1 \
  --steps tar-zstd,zstd-d-tar-x,create,create-hash-first,install,install-whole-hash --json "$out/bundle_2g_1file.json" \
  || echo "2 GiB one-file run stopped (rc $?)"
# 16 GiB, eight files: memory flat as the input grows? (peak RSS column); disk peak printed
rm -rf "$work"/*
timeout "$(left 520)" $PY $B --work "$work" --size-gb "${SIZES[2]}" \
  --steps sha256sum,tar-zstd,zstd-d-tar-x,create,verify,install,create-hash-first \
  --json "$out/bundle_16g.json" || echo "16 GiB run stopped (rc $?)"
df -h "$work" > "$out/disk.txt"
if [ -n "$plot" ]; then  # else, anywhere with matplotlib: bench_bundle.py --plot-from A,B,C --plot-runs PNG
  $PY $B --plot-from "$out/bundle_4g.json,$out/bundle_2g_1file.json,$out/bundle_16g.json" \
    --plot-runs "$out/bundle_16cores.png" || echo "plot failed"
fi
rm -rf "$work"
echo "done in $(( $(date +%s) - start )) s"
