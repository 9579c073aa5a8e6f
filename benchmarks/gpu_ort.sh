#!/bin/bash
# onnxruntime-gpu On an H200 host (device tool), where its 255 MB wheel is larger than one call may carry.
# Prepare here once (all ignored, under .gpu/): the wheel stripped of what the engine does not load and
# zstd-compressed (205 MB), split in 7 parts of 28 MiB (each call carries the whole tree, ~30 MiB, plus one):
#   pip download onnxruntime-gpu==1.31.1 --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
#       --python-version 3.12 --implementation cp -d W && mkdir x && (cd x && unzip -q ../W/*.whl &&
#     rm -rf onnxruntime/capi/libonnxruntime_providers_tensorrt.so onnxruntime/{transformers,tools,quantization,datasets} &&
#     tar cf - onnxruntime onnxruntime_gpu-1.31.1.dist-info | zstd -19 -T0 -o ../ort.tar.zst)
#   mkdir -p .gpu/parts && split -n 7 -d ort.tar.zst .gpu/parts/p && sha256sum ort.tar.zst > .gpu/ort.sha256
#   (cd /tmp && apt-get download zstd libzstd1) && for d in /tmp/*zstd*.deb; do dpkg -x $d .gpu/zstd; done
#   cp benchmarks/gpu_ort.sh .gpu/ort.sh
# There, back to back (the machine goes back 30 s after a call; carried files do NOT stay between calls, and
# each call replaces the working tree, so copy what later calls need to /tmp, and run background jobs from a
# copy of the tree, never from the tree itself):
#   call 1..7: carry .gpu/parts/p0N (the first also .gpu/zstd .gpu/ort.sh .gpu/ort.sha256):
#              mkdir -p /tmp/p /tmp/g && cp .gpu/parts/p0* /tmp/p/ (first: && cp -r .gpu/zstd .gpu/ort.sh .gpu/ort.sha256 /tmp/g/)
#   then:      cd /tmp/g && mkdir -p .gpu/parts && cp -r zstd ort.sh ort.sha256 .gpu/ && cp /tmp/p/* .gpu/parts/ && . .gpu/ort.sh
# Source it (`. .gpu/ort.sh`): joins the parts, checks the sha256, unpacks into /tmp/site (once), and sets
# LD_LIBRARY_PATH (NVIDIA's pip CUDA libraries) and PYTHONPATH.
G=$PWD/.gpu
export PATH=$G/zstd/usr/bin:$PATH LD_LIBRARY_PATH=$G/zstd/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
if [ ! -f /tmp/site/onnxruntime/__init__.py ]; then
  ls $G/parts/ | tr '\n' ' '; echo
  mkdir -p /tmp/site
  cat $G/parts/p0* > /tmp/ort.tar.zst
  (cd /tmp && echo "$(cut -d' ' -f1 $G/ort.sha256)  ort.tar.zst" | sha256sum -c -) || return 3 2>/dev/null || exit 3
  zstd -dc /tmp/ort.tar.zst | tar x -C /tmp/site || return 4 2>/dev/null || exit 4
  rm -f /tmp/ort.tar.zst
fi
NV=$(python3 -c "import nvidia, os; print(':'.join(sorted({r for p in nvidia.__path__ for r, _, fs in os.walk(p) if any(f.startswith('lib') and '.so' in f for f in fs)})))")
export LD_LIBRARY_PATH=$NV:$LD_LIBRARY_PATH PYTHONPATH=/tmp/site:${PYTHONPATH:-}
python3 -c "import onnxruntime as o; print('onnxruntime', o.__version__, o.get_available_providers())"
