#!/usr/bin/env bash
# One device call each (<= 10 minutes): the H200 measurements that are due, in the order they are
# needed. Run from the repository root on the device machine: `bash benchmarks/h200_round.sh N`.
# Results land under $OUT (fetched back) and are copied into benchmarks/results/ by hand.
# Compile caches go to ./.cache (git-ignored): calls on a still-warm machine reuse them.
set -o pipefail
round=${1:?usage: h200_round.sh ROUND (1-4)}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" .cache
export TRITON_CACHE_DIR=$PWD/.cache/triton FLASHRT_CACHE_DIR=$PWD/.cache/flashrt PYTHONUNBUFFERED=1
python -m pip install --no-deps --no-build-isolation -q -e . >/dev/null 2>&1 || exit 1
cd benchmarks || exit 1
case $round in
  1)  # correctness on the GPU, then the attention candidates (two-pass included)
    (cd .. && timeout 330 python -m pytest -m gpu -n 4 -q -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu-tests.log" | tail -15)
    timeout 200 python attention_probe.py --out "$OUT/h200-attention-probe.json" 2>&1 | grep -v Warning | tail -45
    ;;
  2)  # the kernel suite with graph-replay timing
    timeout 560 flashrt bench kernels --out "$OUT/h200-kernels.json" 2>&1 | tail -30
    ;;
  3)  # tuning (attention, linear, MoE and top-k spaces included), then JIT TTFT after warmup
    timeout 360 flashrt tune --out "$OUT/h200.yaml" --budget 330 2>&1 | tail -25
    timeout 200 python jit_ttft.py --phases cold warm after_warmup --budget 190 --out "$OUT/h200-jit-ttft.json" 2>&1 | tail -8
    ;;
  4)  # end to end: decode by kernel, HKCP with cold steps captured, e2e decode
    timeout 120 python decode_profile.py --model small --batch 8 --out "$OUT/h200-decode-profile.json" 2>&1 | tail -28
    timeout 260 python hkcp.py --capture-cold --contexts 4096 131072 1048576 --out "$OUT/h200-hkcp.json" 2>&1 | grep -v Warn | tail -8
    timeout 170 python e2e_decode.py --model small --batches 1 8 64 --prompt 512 --steps 12 --out "$OUT/h200-e2e.json" 2>&1 | tail -10
    ;;
  *) echo "round: expected 1-4, got $round" >&2; exit 2 ;;
esac
