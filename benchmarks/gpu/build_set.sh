#!/bin/bash
# Build SGLang 0.5.23's GPU set for a Python 3.12 host with no network, as the parts benchmarks/gpu/job.sh
# receives (`receive` + `part`, or `install`):
#   bash benchmarks/gpu/build_set.sh WORK CARRY   (WORK: scratch, CARRY: where the parts go, e.g. an ignored folder)
# The set: sglang, torch 2.14.1 (cu130), triton, sglang-kernel (FA3 ops), flashinfer, sgl-flash-mla, NCCL 2.30.7,
# transformers, tokenizers, tvm-ffi, torchvision, and the pure-Python packages in pure-deps.txt; packages the host
# image already has at compatible versions (numpy, pandas, pyarrow, pillow, lxml, psutil) are left out.
set -euo pipefail
W=$1; C=$2; HERE=$(cd "$(dirname "$0")" && pwd)
P="--only-binary=:all: --python-version 3.12 --implementation cp"
for n in 2_35 2_34 2_31 2_28 2_27 2_24 2_18 2_17; do P="$P --platform manylinux_${n}_x86_64"; done
P="$P --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
mkdir -p "$W/whl" "$W/pure" "$C"
python3 -m pip download -q --no-deps $P -d "$W/whl" sglang==0.5.23 torch==2.14.1 triton==3.8.0 \
  sglang-kernel==0.4.10 flashinfer-python==0.7.2 sgl-flash-mla==1.0.0 transformers==5.19.0 tokenizers==0.23.2 \
  apache-tvm-ffi==0.1.11 torchvision==0.29.1 nvidia-nccl-cu13==2.30.7
python3 -m pip download -q $P -d "$W/pure" -r "$HERE/pure-deps.txt"
# Imported at start-up but declared with torch among their needs: fetched alone.
python3 -m pip download -q --no-deps $P -d "$W/pure" xgrammar==0.2.7 compressed-tensors==0.18.0 loguru \
  torch_memory_saver cuda-python
rm -f "$W"/pure/{pyarrow,numpy,pandas,pillow,lxml,psutil}-*
python3 -m pip install -q --no-deps $P --target "$W/sgl" "$W"/whl/*.whl "$W"/pure/*.whl
# Not needed on an H200 (sm90): Blackwell kernels and tools, static libraries, protoc.
rm -rf "$W/sgl/sgl_kernel/sm100" "$W/sgl/triton/backends/nvidia/lib/cupti-blackwell" \
  "$W/sgl/triton/backends/nvidia/bin/ptxas-blackwell" "$W"/sgl/torch/bin/protoc*
find "$W/sgl" -name "*.a" -size +1M -delete
find "$W/sgl" -name __pycache__ -type d -prune -exec rm -rf {} +
# The CuTe-DSL dual GEMM would need nvidia-cutlass-dsl: Llama's MLP takes SGLang's plain projections instead.
python3 - "$W/sgl/sglang/srt/layers/dual_gemm.py" <<'PY'
import sys
path = sys.argv[1]
text = open(path).read()
old = "        if not is_cuda():\n            return None\n\n        from sglang.kernels.ops.gemm.cutedsl_dual_gemm"
assert old in text, "dual_gemm.py changed: review the patch"
open(path, "w").write(text.replace(old, old.replace("if not is_cuda():", "if True:  # CuTe-DSL not carried"), 1))
PY
tar -C "$W/sgl" -cf - . | zstd -q -T0 -9 --long=27 | split -b 59M -d -a 2 - "$C/A."
(cd "$C" && sha256sum A.* > manifest.sha256 && ls -la A.* | wc -l)
