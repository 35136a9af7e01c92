#!/usr/bin/env bash
# One device call each (<= 10 minutes): rounds 1-5 are session 3's (results in benchmarks/results/),
# round 6 is due next. Run from the repository root on the device machine: `bash benchmarks/h200_round.sh N`.
# Results land under $OUT (fetched back) and are copied into benchmarks/results/ by hand.
# Compile caches go to ./.cache (git-ignored): calls on a still-warm machine reuse them.
set -o pipefail
round=${1:?usage: h200_round.sh ROUND (1-6)}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" .cache
export TRITON_CACHE_DIR=$PWD/.cache/triton FLASHRT_CACHE_DIR=$PWD/.cache/flashrt PYTHONUNBUFFERED=1
python -m pip install --no-deps --no-build-isolation -q -e . >/dev/null 2>&1 || exit 1
cd benchmarks || exit 1
case $round in
  1)  # correctness on the GPU; where a graph decode step's time goes; the attention candidates
    (cd .. && timeout 250 python -m pytest -m gpu -n 8 -q -p no:cacheprovider --durations=15 tests 2>&1 \
      | tee "$OUT/gpu-tests.log" | grep -v -i warn | tail -40)
    timeout 100 python decode_profile.py --model small --batch 8 --out "$OUT/h200-decode-profile.json" 2>&1 | tail -28
    timeout 210 python attention_probe.py --out "$OUT/h200-attention-probe.json" 2>&1 | grep -v Warning | tail -40
    ;;
  2)  # the kernel suite with graph-replay timing (the report is rewritten after every family)
    timeout 570 flashrt bench kernels --out "$OUT/h200-kernels.json" 2>&1 | tail -100
    ;;
  3)  # the new kernels on the GPU, a graph decode step by kernel again, tuning, end to end decode
    (cd .. && timeout 150 python -m pytest -m gpu -n 8 -q -p no:cacheprovider tests/test_cuda_linear_plain.py \
      tests/test_cuda_moe_route.py tests/test_cuda_moe_tables.py tests/test_model_gpu.py tests/test_step_capture.py \
      tests/test_cuda_gemm.py 2>&1 | tee "$OUT/gpu-tests-3.log" | grep -v -i warn | tail -12)
    timeout 80 python decode_profile.py --model small --batch 8 --out "$OUT/h200-decode-profile.json" 2>&1 | tail -12
    timeout 240 flashrt tune --out "$OUT/h200.yaml" --budget 200 2>&1 | tail -16
    timeout 150 python e2e_decode.py --model small --batches 1 8 64 --prompt 512 --steps 12 --out "$OUT/h200-e2e.json" 2>&1 | tail -10
    ;;
  4)  # the glue kernels on the GPU, tuning by graph replay, conformance, a decode step by kernel, end to end
    (cd .. && timeout 120 python -m pytest -m gpu -n 8 -q -p no:cacheprovider tests/test_cuda_linear_plain.py \
      tests/test_cuda_moe_route.py tests/test_cuda_moe_tables.py tests/test_model_gpu.py tests/test_cuda_gemm.py \
      tests/test_tune.py 2>&1 | tee "$OUT/gpu-tests-4.log" | grep -v -i warn | tail -8)
    timeout 200 flashrt tune --out "$OUT/h200.yaml" --budget 160 2>&1 | tail -14
    timeout 60 flashrt conformance --out "$OUT/h200-conformance.json" 2>&1 | tail -4
    timeout 50 python decode_profile.py --model small --batch 8 --out "$OUT/h200-decode-profile.json" 2>&1 | tail -3
    timeout 140 python e2e_decode.py --model small --batches 1 8 64 --prompt 512 --steps 12 --out "$OUT/h200-e2e.json" 2>&1 | tail -10
    ;;
  5)  # the fp32 plain linear (FMA) on the GPU, a decode step by kernel, end to end
    (cd .. && timeout 90 python -m pytest -m gpu -n 8 -q -p no:cacheprovider tests/test_cuda_linear_plain.py \
      tests/test_cuda_moe_route.py tests/test_model_gpu.py 2>&1 | tee "$OUT/gpu-tests-5.log" | grep -v -i warn | tail -6)
    timeout 90 python decode_profile.py --model small --batch 8 --out "$OUT/h200-decode-profile.json" 2>&1 | tail -3
    timeout 150 python e2e_decode.py --model small --batches 1 8 64 --prompt 512 --steps 12 --out "$OUT/h200-e2e.json" 2>&1 | tail -10
    ;;
  6)  # due next (not run yet): every GPU test incl. the new warmup hooks, HKCP with cold steps captured, TTFT after warmup
    (cd .. && timeout 200 python -m pytest -m gpu -n 8 -q -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu-tests.log" \
      | grep -v -i warn | tail -8)
    timeout 200 python hkcp.py --contexts 4096 131072 1048576 --out "$OUT/h200-hkcp.json" 2>&1 | grep -v Warn | tail -6
    timeout 170 python jit_ttft.py --phases cold warm after_warmup --budget 160 --out "$OUT/h200-jit-ttft.json" 2>&1 | tail -6
    ;;
  *) echo "round: expected 1-6, got $round" >&2; exit 2 ;;
esac
