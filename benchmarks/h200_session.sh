#!/usr/bin/env bash
# The pending H200 measurements, grouped into phases that each fit one device call (< 10 min).
#
#   bash benchmarks/h200_session.sh PHASE [PHASE ...]     (from the repository root)
#
# Phases:
#   serve      flashrt serve (its engine in a process of its own) against generate() at 16 and
#              64 concurrent, its steps traced: h200-serve-process.json, h200-serve-process-steps.jsonl
#   serve-budget  64 concurrent at each step budget of SERVE_BUDGETS (tokens; default "8192 16384
#              32768": a wave of 64 prompts of 512 prefills in fewer, larger forwards with more),
#              steps traced: h200-serve-budget-N.json, h200-serve-budget-N-steps.jsonl
#   engine-gpu the GPU tests of the engine's overlapped, captured decode and captured prefill steps:
#              h200-engine-gpu-tests.log
#   mhc        the mHC kernel tests natively (norm, rope, hc_coefficients at every token-tile
#              rule): h200-mhc-tests.log
#   serve-alt  64 concurrent with the engine in the server's process, then with the engine
#              process but no prefix cache (no prefix snapshots: their cost shows as the gap):
#              h200-serve-in-process.json, h200-serve-no-prefix.json
#   overlap    the overlapped-steps GPU test, then serve at 16 and 64 concurrent (overlap on, the
#              default) and at 64 with --no-overlap in the same call: h200-serve-overlap.json,
#              h200-serve-no-overlap.json
#   kernels    the CUDA kernel tests natively and the GPU tests of the model, the engine's captured
#              and overlapped steps and the decode tiles (a quick check after kernel changes):
#              h200-kernel-tests.log, h200-gpu-tests.log
#   tiles      the decode tile sweep of `small` (benchmarks/decode_tiles.py; TILES_BUDGET seconds,
#              default 180; TILES_BATCHES, default "1 8 64"): h200-decode-tiles.json and its
#              profile fragment h200-decode-tiles.yaml
#   profile    the captured decode step's kernel profile of `small` at batch 1 and 64:
#              h200-decode-profile-b1.json, h200-decode-profile-b64.json
#   e2e        the captured decode step of `small` at batch 1 / 8 / 64, synchronized and back to
#              back: h200-e2e.json
#   serve64    flashrt serve against generate() at 64 concurrent only, with the server's kernel
#              variants logged (those built in the timed level listed in the result) and its
#              steps traced (engine/step_trace.py; each level gets a summary of its steps):
#              h200-serve-64.json, h200-serve-64-jit.log, h200-serve-64-steps.jsonl
#   servestart the time from `flashrt serve --model small` to a healthy server (loaded, warmed up) on an empty
#              compile cache and again warm (benchmarks/serve_start.py), the engine process compiling on
#              the pool (h200-serve-start.json), then cold with no pool (FLASHRT_JIT_WORKERS=0: every
#              variant compiled at its first launch; h200-serve-start-nopool.json); needs .whl
#   serveplan  a cold `flashrt serve --model small` with the plan it recorded kept (h200-serve-start-record.json,
#              serve-plans/), added after the shipped plan's entries (tools/ship_plan.py --after), a cold
#              server again on the merged plan (h200-serve-start-shipped.json), then a cold and a warm
#              `flashrt run` on it (h200-jit-ttft-serveplan.json) and the merged plan (sm_90-h200-small.json,
#              to commit under core/jit_plans/triton-3.6.0/); needs .whl
#   coldstart  time to first token of a cold `flashrt run --model small`, with the compile pool:
#              h200-jit-ttft.json; then records the plan of what a run launches on this device
#              (the file to commit under core/jit_plans/)
#   plan       only the plan of what a `small` run launches on this device, recorded by
#              `flashrt jit warmup --model small` on an empty cache (the file to commit under
#              core/jit_plans/)
#   tests      the GPU tests (pytest -m gpu) and the CUDA kernel tests as the interpreter runs
#              them, under the device's own profile: h200-gpu-tests.log, h200-kernel-tests.log
#   decode     the captured decode step of `small` at batch 1 / 8 / 64 and its kernel profile:
#              h200-e2e.json, h200-decode-profile.json
#   prefill    the prefill-graph GPU tests, then a prefill forward's wall and GPU time per token
#              at 1 / 4 / 16 / 64 rows of 512 tokens (the serving engine's groups against
#              generate()'s whole batch), eager and replayed from a CUDA graph, and the batch-1
#              decode step's kernel profile: h200-prefill-rows.json, h200-decode-profile-b1.json
#   engine     the serving engine stepped in process at 64 concurrent against generate() at batch 64
#              (benchmarks/engine_steps.py: step wall and CPU time, GPU busy share, kernels per
#              decode step), with and without prefill graphs, and with arrivals spread (2 a step,
#              as over a network): h200-engine-steps.json, h200-engine-steps-no-prefill-graphs.json,
#              h200-engine-steps-spread.json
#   combine    decode-shaped hc_coefficients and sparse_attention launches under their finish and
#              combine variants (benchmarks/decode_kernel_variants.py): h200-decode-kernel-variants.json;
#              then the attention's split-K partials merged in the attention launch
#              (tiles.attention.combine.in_kernel) against the separate combine launch: its GPU
#              test, then the captured decode step of `small` at batch 1 / 8 / 64 and its batch-1
#              and batch-64 kernel profiles under each: h200-combine-{off,on}-e2e.json,
#              h200-combine-{off,on}-profile-b{1,64}.json
#   variants   only the first step of combine: h200-decode-kernel-variants.json
#   coldplan   a cold `flashrt run --model small` with its recorded plan kept (h200-jit-ttft-record.json,
#              recorded-plans/), that plan merged into the shipped one (tools/ship_plan.py), then cold
#              and warm again on the merged plan: h200-jit-ttft-shipped.json and the merged plan file
#              (sm_90-h200-small.json, to commit under core/jit_plans/triton-3.6.0/)
#   coldlog    a cold `flashrt run --model small` on the shipped plan (h200-jit-ttft-cold-log.json: the
#              pool's summed and slowest compiles, the run's own compiles classed by what the pool did
#              with their cache keys) with FLASHRT_JIT_LOG on: every variant the run's process loaded or
#              compiled and every variant a pool worker finished, when, how long, under which cache key
#              and its pieces (h200-jit-cold-log.jsonl)
#   ttftall    the time to first token cold, warm, right after `flashrt jit warmup --shapes small` and
#              right after `flashrt jit warmup --model small`, each run's compiles logged and classed by
#              what its pool did with their keys (benchmarks/jit_ttft.py; the report's startup_seconds
#              split the time before loading): h200-jit-ttft-all.json, h200-jit-ttft-all-log.jsonl
#   moeprefill the routed experts of a 4,096-token chunk at the released dimensions under the profile's
#              tile past 16 rows, tiles that fit two programs an SM and 128-row tiles
#              (benchmarks/moe_prefill_tiles.py): h200-moe-prefill-tiles.json
#   preload    the time to first token (cold and warm; benchmarks/jit_ttft.py) without and with the plan's
#              cached kernels loaded while the model loads (FLASHRT_JIT_PRELOAD=1, off by default), after
#              their tests: h200-preload-tests.log, h200-jit-ttft-preload-{off,on}.json
#   serve-allocs  64 concurrent with device timing: the step trace's per-phase device time and the
#              allocator's slow paths (cudaMalloc, retries, syncs, pinned allocations) per phase:
#              h200-serve-allocs.json, h200-serve-allocs-steps.jsonl
#   hkcp       benchmarks/hkcp.py at 4K and 128K contexts (capacity, decode with 90% of the main KV
#              cold, cold fetch, and time to first token of a 32K prompt: full prefill against a
#              prefix-cache hit): h200-hkcp.json
#   ttft-hit   only that time-to-first-token comparison (both paths warmed on another prompt, medians
#              of 3): h200-hkcp-ttft.json; then cProfile of one warm hit (tools/host_profile.py):
#              prof-hit/prefix-hit.{txt,json}
#   rows       the KV row moves against a busy GPU: their GPU test (tests/kv/test_kv_rows.py -m gpu)
#              and tools/blocking_ops.py: h200-kv-rows-gpu.log, h200-blocking-ops.txt
#   engine-profile  cProfile of the offline engine over 128 prompts of 512 at 64 running, after an
#              identical pass (tools/host_profile.py engine): prof-engine/engine.{txt,json}
#   prefix     a prompt chunk's attention through prefix_attention against sparse_attention on the
#              indices it implies (benchmarks/prefix_attention.py: h200-prefix-attention.json; its GPU
#              tests first: h200-prefix-tests.log), then the prefill forwards by row count
#              (h200-prefill-rows.json, as the prefill phase)
#   sample     greedy sampling: its kernel test on the GPU (tests/kernels_cuda/test_cuda_sample.py), then
#              the split argmax against torch.argmax at batch 1 / 8 / 64 over the vocabulary
#              (benchmarks/greedy_pick.py): h200-sample-tests.log, h200-greedy-pick.json
#   gemv       row tiles under 16 (the multiply-add K loop): their GPU tests, then the fp8_w projections and
#              the experts at 1-8 rows under tile variants against the profile's tiles, at the real
#              dimensions (benchmarks/gemv_tiles.py): h200-gemv-tests.log, h200-gemv-tiles-v41.json
#   stages     MMA tiles for the decode rows (16-row tiles of other widths and pipeline depths, 64-row
#              tiles whose fp8 operands reach the fp8 warpgroup MMA) for the projections and experts
#              at the released shapes (benchmarks/gemv_tiles.py: h200-gemv-stages.json), the fastest
#              of each family written into a profile copy, then the real-dimension slice and `small`'s
#              captured decode under it and under the profile: h200-real-slice-stages-{off,on}.json,
#              h200-e2e-stages-{off,on}.json, the copy h200-stages.yaml
#   regs       the GEMM kernels without the register pressure (spills in the sm_90 compile reports) of the
#              shared expert's path and the in-kernel activation quantization: the shared expert in
#              launches of its own (tiles.moe.shared_in_launch false; its GPU tests:
#              h200-moe-shared-tests.log), the activations quantized by their own launch
#              (tiles.moe.fused_max_tokens / tiles.linear.fused_max_rows 0), 16-row expert tiles of
#              fewer registers, at the released shapes (h200-gemv-regs.json); then the real-dimension
#              slice and `small`'s captured decode under the profile and a copy setting each:
#              h200-real-slice-{regs-off,shared-apart,quant-apart}.json, h200-e2e-{...}.json
#   attnwarps  the attention kernel benchmarks (flashrt bench kernels --families attention: decode at
#              1-64 rows and the 4K-query prefill at 64 heads x 512) under the profile, whose prefill
#              launches take 4 warps (spilling 2,152 bytes at 64 heads in the sm_90 compile), and under a
#              copy that leaves them on the decode tile's 8 warps: h200-kernels-attention-{4w,8w}.json
#   splits     K split to a number of programs an SM also where the output tiles fill the SMs once
#              (rule knob split_per_sm): the decode-tile and attention GPU tests (h200-splits-tests.log),
#              the attention kernel benchmarks under the profile's prefill variant limited to 16 heads a
#              program (h200-kernels-attention-maxheads.json), the projections and experts at 1-8 rows
#              under 3 / 4 / 6 / 8 programs an SM (h200-gemv-splits.json), then the real-dimension slice
#              and `small`'s captured decode under the profile and a copy whose decode rules of linear,
#              linear_plain and moe (or $SPLIT_RULES) take split_per_sm ${SPLIT_PER_SM:-4}: h200-real-slice-splits-{off,on}.json,
#              h200-e2e-splits-{off,on}.json
#   prefixtiles the grouped experts' SwiGLU launch (its GPU tests: h200-moe-grouped-tests-swiglu.log)
#              against the torch ops it replaced at the prefill shapes of small and the released model
#              (benchmarks/moe_swiglu.py: h200-moe-swiglu.json);
#              the prefix attention kernel (half of small's 64 x 512 prefill) at 16 rows x 512 under
#              tile variants, among them the columns split over two programs with 128 score rows or K
#              blocks of 16 (the sm_90 compiles that spill least), the fastest written into a profile
#              copy (benchmarks/prefix_attention.py: h200-prefix-tiles.json, h200-prefix-tiles.yaml);
#              the kernel's GPU tests under that copy (h200-prefix-tiles-tests.log); the prefill
#              forwards of 16 and 64 rows under the copy and the profile:
#              h200-prefill-rows-prefix-tiles-{on,off}.json
#   topkgroup  the 128K and 1M top-k (k = 512, 1 / 8 / 64 rows) with the select's list loops taking
#              2,048 (the profile), 4,096 or 8,192 elements a step (tiles.topk.select.group; 8,192
#              compiles to 243 registers without spills for sm_90, 16,384 spills), each against
#              torch.topk in its own run (benchmarks/topk_radix.py): h200-topk-group-{2048,4096,8192}.json
#              (the compiles: benchmarks/results/cpu-sm90-compile-topk-group.json)
#   hcreal     the mHC coefficients and the decode attention under their tile variants at the
#              released dimensions (hc_coefficients at K = 4 x 5,120: 160 one-block splits at one token;
#              benchmarks/decode_kernel_variants.py --model v4.1-flash): h200-decode-kernel-variants-v41.json;
#              then the real-dimension slice's kernels a step (real_slice.py --profile):
#              h200-real-slice-profile-2.json
#   prefixship the prefix attention's shipped tiles (128 score rows, columns split) checked and timed:
#              its and the mHC kernels' GPU tests (h200-prefixship-tests.log); the released model's 64
#              heads at 4 rows x 512 (two queries a program) against the sparse kernel and under the
#              tile variants, the variants over a copy with the default tiles
#              (h200-prefix-tiles-v41.json); the hc_coefficients variants at small's and the released
#              dimensions, the multiply-add GEMV's own K blocks among them
#              (h200-hc-variants-{small,v41}.json); small's prefill forwards at 1-64 rows
#              (h200-prefill-rows-prefixship.json) and captured decode (h200-e2e-prefixship.json)
#   gemvrt     the fp8 GEMV with its activations through their fp8 round trip first (gemv_round_trip): its
#              tests natively (h200-gemvrt-tests.log), the released projections at 1 / 2 / 4 rows with and
#              without it (h200-gemv-roundtrip.json), then the slice and small's decode with the profile's
#              one-or-two-row rule taking it (h200-real-slice-gemvrt-{off,on}.json, h200-e2e-gemvrt-{off,on}.json)
#   gemvrtsmall  gemvrt's GEMV variants at small's projections, 1 and 2 rows (a batch-1 verify's two rows there
#              take 56 round-trip launches): h200-gemv-roundtrip-small.json
#   gemvsmallrows  the GEMV at small's projections at 4, 5 and 8 rows (a batch-1 verify of 3, 4 and 7 drafted
#              tokens) against the profile's 16-row MMA tile: h200-gemv-small-rows.json
#   gemvsmallrule  a verify's rounds and costs with a GEMV rule for 3-8 rows on weights of at most 16M elements
#              (the linear rule knob max_weights: small's projections, not the released ones) before the
#              16-row MMA tile, and under the profile in the same call: h200-verify-breakdown-b1-k{1,4}-
#              {gemvsmall,profile}.json, h200-speculative-{gemvsmall,profile}.json
#   gemvmma    fp8 linear at 1-16 rows on mma.sync with the weight rows as its M (the gemv_mma knob,
#              kernels_cuda/gemv_mma.py): its tests natively, then the projections at the released and small
#              shapes (small's with GEMV_MMA_SMALL set) under its variants, the one-row GEMV and the profile:
#              h200-gemv-mma-tests.log, h200-gemv-mma-{v41,small}.json
#   gemvmmaslice  the real-dimension slice at batch 2 and 8 under a copy of the profile whose 2-row and 3-16-row
#              rules do not take gemv_mma, then under the profile: h200-real-slice-gemvmma-{off,on}.json
#   moemma     the routed fp4 experts on mma.sync with the weight rows as its M (the experts' gemv_mma knob,
#              kernels_cuda/moe_mma.py): its tests and the other experts tests natively, then the experts at the
#              released shapes (K-major scales, codes in words) under its variants and the profile, and one
#              call's kernels by device time (benchmarks/moe_kernels.py):
#              h200-moe-mma-tests.log, h200-moe-mma-v41.json, h200-moe-kernels.json
#   decodes    the packed decodes by sign-replicating byte permutes (codecs' E2M1 pairs, E4M3 pairs, the ws
#              attention's codes in element order and fp8 rows, the indexer's keys) and the E2M1 word layout in
#              element order (e2m1_words, codecs_words, linear_kernel, moe_mma): the kernel tests that run
#              them natively (h200-decodes-tests.log), then benchmarks/attention_ws.py at batch 8 and 64 (the
#              packed decodes against the code-by-code ones in one call: h200-attention-ws-decodes.json; with
#              BEFORE, a folder of the decodes' files before them, also under those: ...-before.json)
#   qgmma      the routed experts on the fp8 warpgroup MMA with the weights as its register operand
#              (kernels_cuda/experts_qgmma.py, moe_qgmma.py): their GPU tests (h200-qgmma-tests.log), then the
#              GEMMs alone at the released shapes under K splits and the whole moe_experts under the qgmma knob
#              against the profile's and the floor (benchmarks/experts_qgmma.py): h200-experts-qgmma.json; with BEFORE,
#              the whole op again with its files swapped in: h200-experts-qgmma-before.json
#   decodesslice  the real-dimension slice at batch 1, 8 and 64 under the profile, and with BEFORE under the
#              decodes before them: h200-real-slice-decodes{,-before}.json
#   qgmmadecode fp8 linear at 8-64 rows on the fp8 warpgroup MMA, both operands streamed, K split (qgmma_per_sm):
#              its tests, then the profile, gemv_mma_dq and the split variants against torch._scaled_mm:
#              h200-qgmma-decode-tests.log, h200-qgmma-decode-v41.json
#   qgmmadecodee2e  small's decode at batch 16 and 64 under the linear rules before the streamed launch and now:
#              h200-e2e-qgmmadec-{before,qgmma}.json
#   qgmmadecoderows  qgmmadecodee2e, then the streamed launch at 2-8 rows beside the 3-8 row rule
#              (h200-qgmma-decode-rows-v41.json) and its 64-row variants (h200-qgmma-decode-64-v41.json)
#   qgmmadecodeslice  the real-dimension slice at batch 16 and 64 under the same two: h200-real-slice-qgmmadec-{off,on}.json
#   gemvdq     fp8 linear over the activations' round trip on mma.sync (the gemv_mma_dq knob, up to 64 rows): the
#              gemv_mma tests natively, then the released projections at 1-64 rows under the profile, the
#              gemv_mma rule and its dq variants, against torch._scaled_mm: h200-gemv-dq-tests.log, h200-gemv-dq-v41.json
#   topkslices  the row split at 8 and 64 rows of 128K and 1M with larger slices (16K / 32K / 64K entries: 1-8
#              waves of scanning programs rather than the 2,048 of 4K slices that lost at 64 rows), chunks above L
#              only (split_skip 32), L's top 16 bits, against the profile:
#              h200-topk-slices-{profile,16384,32768,65536}.json
#   tunepaths  flashrt tune over the attention, linear and experts spaces (each sweeping the knobs of the launch its
#              case takes under the profile; TUNE_BUDGET seconds, default 240): h200-tune-paths.yaml, h200-tune-paths.log
#   topkrepro  the top-k split with 32 slices of 32K entries at 8 rows of 1M (its one fast run against the slow ones,
#              docs/performance.md): the sequence of the run that was fast and that row alone, every case's picks
#              checked after its timing and its list lengths kept: h200-topk-repro-{sequence,alone}.json
#   topkprograms  16-64 rows of 128K and 1M split down to 4 programs a row (several slices each):
#              h200-topk-programs-64.json; with BEFORE (a folder holding an earlier kernels_cuda/topk_split_kernel.py
#              at that path, swapped in by before_run) again under it: h200-topk-programs-64-before.json
#   topkchunkmax  the chunk-max pass with 2K-8K entries a program and 4 or 8 warps at 8 and 64 rows of 128K and
#              1M: h200-topk-chunkmax-B-wW.json
#   topkkernels  the profile's top-k at 1, 2, 8 and 64 rows of 128K and 1M with each kernel's device time a call
#              (benchmarks/topk_radix.py --kernels; a kernel's time includes its wait for the one before):
#              h200-topk-kernels.json
#   topkpick   a split row's pick searching 2, 4 or 8 bits a pass (split_pick_radix) against the profile's 1,
#              kernel by kernel at 1, 2, 8 and 64 rows of 128K and 1M, after its GPU tests:
#              h200-topkpick-tests.log, h200-topk-pick-radix-R.json (R 0: the profile)
#   topkspan   2, 4 and 8 rows of 1M split into programs of several slices under launches of at most 256, 512,
#              1,024 and 2,048 scanning programs (split_programs; fewer slices a program as it grows; the caps
#              TOPK_SPAN_PROGRAMS names): h200-topk-span-P.json; with BEFORE as topkprograms takes it, again
#              under its kernels: h200-topk-span-P-before.json
#   rowrulesslice  the real-dimension slice at batch 2, 4 and 8 under the copy rowrules compares and the profile:
#              h200-real-slice-rowrules-{off,on}.json
#   tunecheck  what `flashrt tune` picked on its own experts cases (4 warps; 2 stages for prefill), at the released
#              dimensions beside the profile: 4,096 tokens (64 + 16-row tiles) and 2,048 (32 + 16):
#              h200-tunecheck-moe-{4096,2048}.json
#   rowrules   the profile's 2-row and 3-8-row linear rules on the streamed fp8 launch and its top-k launches past
#              256 scanning programs split with several slices a program (split_min_programs): their GPU tests
#              (h200-rowrules-tests.log), then the released projections at 2-8 rows and top-k at 1-64 rows of 128K
#              and 1M under the profile and a copy as before: h200-rowrules-{linear,topk}-{before,now}.json
#   qgmmaslice  the real-dimension slice at batch 1, 8 and 64 and small's captured decode under a copy of the profile
#              as it was before its decode experts took qgmma (codes in words, qgmma off) and under the profile:
#              h200-real-slice-qgmma-{off,on}.json, h200-e2e-qgmma-{words,qgmma}.json
#   qgmmastream  a prefill chunk's routed experts on qgmma with the activations streamed (moe_qgmma_stream.py):
#              its GPU tests (h200-qgmma-stream-tests.log), then benchmarks/moe_prefill_tiles.py at 4,096 tokens
#              under its variants beside the profile's rule: h200-moe-prefill-qgmma-stream-4096.json, and two of
#              them at 2,048 and 8,192: -2048.json, -8192.json
#   prefillqgmma  the streamed experts' and the fp8 linear's qgmma (linear_qgmma.py) GPU tests
#              (h200-prefill-qgmma-tests.log), then the experts at 4,096 tokens under four streamed variants and
#              the released projections at 4,096 rows (benchmarks/linear_prefill.py, against torch._scaled_mm):
#              h200-moe-prefill-qgmma-stream-4096.json, h200-linear-prefill-qgmma.json
#   prefillbf16  the streamed experts on the bf16 warpgroup MMA (experts_bf16_stream.py): their GPU tests (-k bf16)
#              (h200-prefill-bf16-tests.log), then the experts at 4,096 tokens under five bf16 variants beside the
#              fastest fp8 one and the profile's rule: h200-moe-prefill-bf16-stream-4096.json
#   prefillbf16tiny  prefillbf16's GPU tests and two of its variants, for a short lease
#   prefillbf16small  small's prefill (benchmarks/prefill_rows.py, 1 / 4 / 16 / 64 rows of 512 tokens) under the
#              profile (small's prefill experts on the rule's MMA tile: its K under qgmma_min_k) and under a copy
#              whose rule takes the bf16 streamed launches at any K (qgmma_min_k 0), then flashrt conformance
#              under the profile: h200-prefill-rows-bf16-{off,on}.json, h200-conformance-bf16.json
#   prefilltwo  the bf16 streamed experts' row tiles with a second part (qgmma_tokens2): its GPU tests
#              (h200-prefill-two-tests.log), then the experts at 4,096 tokens under four such variants and the
#              64-row tiles alone beside the profile's rule: h200-moe-prefill-two-4096.json; at 2,048 tokens
#              (about 32 rows an expert) the profile's against 32 + 16 and 32 + 32: h200-moe-prefill-two-2048.json
#   prefillquick  prefillqgmma with its GPU tests (not the CPU compiles) and two variants of each, for a short lease
#   prefilltiny  prefillquick's GPU cases and one variant of each
#   moemmaslice  the real-dimension slice at batch 1, 8 and 64 under the profile, then under a copy whose decode
#              experts rule takes gemv_mma: h200-real-slice-moemma-{off,on}.json
#   speculative  benchmarks/speculative.py on small at batch 1 / 8 / 64 (the costs the profile's
#              speculative_costs hold): h200-speculative-TAG.json (SPEC_TAG, default "now")
#   verifysplit  benchmarks/verify_breakdown.py on small at batch 1, k 1 and 4: the verify forward, its
#              commit and a plain step, wall and GPU time, each phase's kernels by time:
#              h200-verify-breakdown-b1-k{1,4}-TAG.json (SPEC_TAG, default "now")
#   verifysparse  verifysplit under a copy of the profile with sparse_max_queries 6 (a verify's chunk through
#              the indexer and sparse_attention) and under the profile (prefix_attention), then speculative
#              under the copy: h200-verify-breakdown-b1-k{1,4}-{sparse6,prefix}.json, h200-speculative-sparse6.json
#   ncu        Nsight Compute on the kernels the targets miss on (tools/ncu_cases.py: the experts at 1 and 8
#              tokens and a one-row linear at the released shapes, small's prefix attention, the fp4_b16
#              quantize-and-store, the 128K top-k at 1 and 64 rows): speed of light, memory, warp
#              states, occupancy, launch statistics a kernel, ncu-CASE.txt (ncu-check.txt: the tool's
#              own output when it cannot profile here)
#   ncustalls  Nsight Compute's warp-stall reasons and their source lines (WarpStateStats and
#              SourceCounters, --print-details all) on the experts at 1 token, the one-row linear,
#              the prefix attention and the batch-64 decode attention (NCU_CASES to change):
#              ncu-stalls-CASE.txt
#   ncusource  Nsight Compute's source page (SASS, with executed instructions and stall samples a line)
#              of NCU_CASES (default experts1), summed by opcode and by run count (tools/ncu_source.py):
#              ncu-source-CASE[NCU_TAG].csv.gz, .txt, .json, -counts.txt, -reasons.txt (stall reasons)
#   kerneltests the CUDA kernel tests natively under the profile (h200-kernel-tests.log)
#   scales     the experts' fp4 scale loads: stored K major (formats.with_k_major_scales) and loaded a
#              K block ahead (tiles.linear.fp4_decode: packed_prefetch). Their GPU tests and the MoE
#              block's under expert_scales: k_major (h200-scales-tests.log); the experts at 1 and 8
#              tokens at the released shapes under the profile, with row- and K-major scales, and with
#              the scales a block ahead (benchmarks/gemv_tiles.py --scales-k-major:
#              h200-gemv-scales.json); then Nsight Compute's source page at one token with K-major
#              scales and with the scales a block ahead (ncu-source-experts1_kmajor.*,
#              ncu-source-experts1-prefetch.*)
#   scaleship  the experts' shipped scale loads (expert_scales: k_major, fp4_decode: packed_prefetch)
#              checked and timed: the MoE block's GPU tests (h200-scaleship-tests.log); the
#              real-dimension slice and small's captured decode under the profile and under a copy
#              with row-major scales and the plain packed decode: h200-real-slice-scales-{row,ship}.json,
#              h200-e2e-scales-{row,ship}.json; then the CUDA kernel tests natively (h200-kernel-tests.log)
#   fold       the packed fp4 decode's 2**126 re-bias folded into the scales (tiles.linear.fp4_scale_fold,
#              off in every profile): its GPU tests and the MoE block's (h200-fold-tests.log); the experts
#              at the released shapes with it on and off (gemv_tiles.py: h200-gemv-fold.json); the
#              real-dimension slice and small's captured decode with it off and on:
#              h200-real-slice-fold-{off,on}.json, h200-e2e-fold-{off,on}.json
#   actdq      the experts' activations handed over dequantized (tiles.moe.act_dequantized, off in every
#              profile): its GPU tests with the shared-expert and MoE block tests (h200-actdq-tests.log);
#              the experts at the released shapes with it, the fold, and both (h200-gemv-actdq.json); the
#              real-dimension slice and small's captured decode off, on, and on with the fold:
#              h200-real-slice-actdq-{off,on,fold}.json, h200-e2e-actdq-{off,on,fold}.json
#   halves     the fp4 experts' K order in halves (tiles.linear.fp4_halves): its tests (h200-halves-tests.log),
#              the experts at the released shapes with and without it (h200-gemv-halves.json), the
#              real-dimension slice and small's captured decode off and on
#   fp8deq     the fp8 linear with its weights dequantized instead of the fp8 MMA (tiles.linear.fp8_mma false,
#              for the 16-row rule only and for every rule): the GEMVs at the released shapes
#              (h200-gemv-fp8deq.json), the real-dimension slice and small's captured decode under each
#   nopdlprofile  the real-dimension slice's kernels at batch 1 / 8 and small's batch-1 step under a copy of
#              the profile with programmatic dependent launch off, so that each kernel's time excludes its wait on
#              the one before: h200-real-slice-profile-nopdl.json, h200-decode-profile-b1-nopdl.json
#   gemvrows   the GEMVs with several activation rows a program (the gemv_rows knob: a weight block loaded and
#              converted once for them): their tests natively (h200-gemvrows-tests.log); the fp8 projections and
#              the plain ones at 1 / 2 / 4 / 8 rows under the profile, the shipped one-row GEMV tile and the rows
#              variants (h200-gemv-rows.json), with the profile copy that puts the fastest in front of its rules
#              (h200-gemv-rows.yaml: time it end to end with phase vs)
#   gemv8      the decode rows of the fp8 and the plain-weight linears as GEMVs (the rules' gemv knob,
#              kernels_cuda/gemv.py): their tests natively (h200-gemv8-tests.log); the fp8 projections and
#              the plain ones (head, output groups, indexer) at the released shapes at 1 and 4 rows under
#              each GEMV tile of benchmarks/gemv_tiles.py, the profile and (fp8) torch._scaled_mm
#              (h200-gemv-gemv8.json); a copy of the profile with each family's fastest GEMV in front of its
#              rules, where one beats the profile by 3% (h200-gemv8.yaml: time it end to end with phase vs)
#   vs         a profile file against the h200 profile end to end, in one call: VS_PROFILE (its path in the
#              repository copy, e.g. a fetched h200-gemv8.yaml put there untracked), VS_TAG (default vs):
#              the real-dimension slice and small's captured decode (h200-real-slice-TAG-{off,on}.json,
#              h200-e2e-TAG-{off,on}.json)
#   load       small's weights load time, three repeats (benchmarks/load_time.py): h200-load-time-small.json
#   topksplit  the top-k select with rows split over scanning programs (tiles.topk.select.split_rows, as the
#              h200 profile takes it up to 256 scanning programs): its tests and the realistic rows natively (h200-topksplit-tests.log); then
#              128K and 1M rows (k = 512, 1 / 8 / 64 rows) unsplit (h200-topk-split-off.json), then under the
#              profile as it is, searching 1, 2 and 4 bits a pass (radix_bits), each run beside torch.topk
#              (benchmarks/topk_radix.py): h200-topk-split-profile.json
#   topkexit   the k-th-largest search ending on an exact count, taking L's shared bits in the split pick and
#              picking the ties unranked where all are picked: the top-k tests natively (h200-topkexit-tests.log),
#              then 128K and 1M rows under the profile (h200-topk-exit.json) and, in the same call, under the
#              kernels before them (BEFORE: a folder holding that commit's kernels_cuda/topk_kernel.py
#              and kernels_cuda/topk_split_kernel.py at those paths, swapped in for the run and back by
#              before_run: h200-topk-exit-before.json)
#   hcfinish   hc_coefficients with the partials value major (tiles.mhc.hc_finish.value_major): the mHC
#              tests natively (h200-hcfinish-tests.log), then at small's and the released dimensions, 1 and
#              8 tokens, the profile, that and the finish loading every split at once, with the model's 20
#              Sinkhorn iterations and with 1 (the iterations' share of a launch):
#              h200-hc-finish-{small,v4.1-flash}{,-iters1}.json
#   swap       the MMA operands swapped on 64-row tiles (tiles.linear.swap_operands): its tests natively
#              (h200-swap-tests.log), then the experts of a 4,096-token chunk under the profile's rule and two
#              other tiles, off and on (h200-moe-prefill-swap-{off,on}.json)
#   swaprule   the experts' rule past 16 rows with its own swap_operands knob: the swap tests natively
#              (h200-swaprule-tests.log), then the routed experts of prefill chunks under the profile's rule,
#              N 128 / K 64 / 4 warps / 4 stages plain and swapped, and two other swapped tiles: the released
#              experts at 1,024 / 2,048 / 4,096 / 8,192 tokens, small's at 512 and 2,048
#              (h200-moe-prefill-swaprule-{v4.1-flash,small}-TOKENS.json); small's prefill of 512 tokens at 1 / 16 /
#              64 rows with the swapped N 128 / K 64 tile as that rule, and under the profile
#              (h200-prefill-rows-swaprule-{on,off}.json)
#   profilecheck  the h200 profile as it is, on the card that comes: the top-k at 128K and 1M rows
#              (h200-topk-profilecheck.json; with BEFORE as topkexit takes it, the kernels before the
#              exact shortcuts in the same call: h200-topk-profilecheck-before.json), the real-dimension
#              slice (h200-real-slice-profilecheck.json), small's captured decode (h200-e2e-profilecheck.json),
#              the quantize encoders with the bf16 pairs off and on (h200-kernels-elementwise-pairs-{off,on}.json)
#   hcdiv      hc_coefficients with the Sinkhorn normalizations on the fast division: the mHC tests natively
#              (h200-hcdiv-tests.log), then the launch at small's and the released dimensions, 1 / 8 / 64
#              tokens, under the code as it is (h200-hc-div-{small,v4.1-flash}.json) and, where BEFORE names
#              a folder holding the files to compare at their repository paths (kernels_cuda/mhc.py of the
#              commit before), with those swapped in for the run in the same call (...-before.json)
#   route      the MoE gate's select (one value-and-index reduction a pick, the picked scores gathered once,
#              one token a program of its own): the gate tests natively (h200-route-tests.log), then the gate
#              at small's and the released dimensions, 1 / 8 / 64 tokens, under the select's tile variants
#              (benchmarks/decode_kernel_variants.py --ops moe_route: h200-route-{small,v4.1-flash}.json) and,
#              where BEFORE names a folder holding kernels_cuda/moe_route.py of the commit before, with it
#              swapped in (...-before.json); then the real-dimension slice and small's captured decode
#              (h200-real-slice-route-on.json, h200-e2e-route-on.json; and -before with BEFORE)
#   h100profile  on an H100, the h100 profile as a user gets it (FLASHRT_PROFILE unset: chosen by the
#              device): flashrt doctor (h100-profile-doctor.json), flashrt conformance (h100-profile-conformance.json,
#              the H100 row of hwconfigs/reports when it passes), the GPU tests (h100-profile-gpu-tests.log),
#              small's captured decode (h100-profile-e2e.json). Refuses to run on another card
#   topksplitvariants  the same rows split again as topksplit does, then unfused, at slices of 2,048 and
#              8,192, at 4 warps, with L's top 16 bits only, and searched 8 bits a pass:
#              h200-topk-split-{4096-w8-2,4096-w8-unfused,2048-w8,8192-w8,4096-w4,4096-w8-bits16,
#              4096-w8-radix8}.json
#   words      the fp4 experts' codes in the E2M1 word layout (expert_fp4: words) with the halves K order,
#              then also the fp8 shared expert's packed decode (tiles.linear.fp8_packed), all off in every
#              profile: their tests (h200-words-tests.log); the experts at the released shapes under each
#              knob, in nibbles and in words (h200-gemv-words.json); the real-dimension slice and small's
#              captured decode under the profile, words + halves, and that + fp8 packed:
#              h200-real-slice-words-{off,both,all}.json, h200-e2e-words-{off,both,all}.json
#   attnws     the warp-specialized Gluon attention kernel (tiles.attention.ws.enabled): its tests and the
#              attention tests (h200-attn-ws-tests.log), the attention kernel cases off and on
#              (h200-kernels-attention-ws-{off,on}.json), its tile variants beside the plain kernel
#              (benchmarks/attention_ws.py: h200-attention-ws.json), the real-dimension slice (64 heads: the kernel
#              serves it; small's 16 do not take it): h200-real-slice-attnws-{off,on}.json; with Nsight Compute,
#              the batch-64 decode under it: ncu-attn64-ws.txt
#   wsfirst    the first look at the ws attention kernel in one call: its GPU tests (h200-ws-tests.log) and
#              benchmarks/attention_ws.py (h200-attention-ws.json)
#   wsslice    the ws attention's tiles again (benchmarks/attention_ws.py: h200-attention-ws-2.json), then the
#              real-dimension slice under the profile and with the ws kernel on from 8 queries, packed
#              fp4_b16 decode, copies 1 block ahead (h200-real-slice-attnws-{off,on}.json)
#   wsncu      Nsight Compute's source page of the batch-64 decode (tools/ncu_cases.py attn64) under the ws
#              kernel with packed decode and copies 1 block ahead: ncu-source-attn64-ws.{txt,json,csv.gz,log}
#   wsprod     the ws attention's producer (indices a trip ahead, one row layout for every copy, one-path
#              blocks decoded without the sum) under the profile: benchmarks/attention_ws.py at batch 8, 64
#              and the prefill (h200-attention-ws-3.json), its GPU tests with the attention, packed attention
#              and prefix attention tests (h200-wsprod-tests.log), the real-dimension slice
#              (h200-real-slice-wsprod-on.json). The decode in the consumers was timed by this phase at
#              af090f3 (h200-wsdec-tests.log, ncu-source-attn64-wsdec.*)
#   ws8        the ws attention's variants (q loaded by the consumers, the profile; the split scores; the rows
#              split by warp; the stores staged; the decode's loads ahead): their GPU tests
#              (h200-ws8-tests.log), then benchmarks/attention_ws.py at batch 64 and the prefill, each chosen
#              variant beside the plain kernel (h200-attention-ws-8.json; WS8_VARIANTS: label substrings apart
#              by "|", by default "q in consumers|split scores")
#   wgmma      the bf16 warpgroup MMA's rate at the attention's tile shapes (narrow N, A shared or in
#              registers) against the bf16 GEMM (benchmarks/wgmma_rate.py: h200-wgmma-rate.json)
#   fp4dot     fp4_w weights through tl.dot_scaled (tiles.linear.fp4_decode: dot_scaled): the fp4
#              decode tests on the GPU (h200-fp4-scaled-tests.log), the experts at 1 / 8 tokens under
#              each decode (benchmarks/gemv_tiles.py: h200-gemv-fp4-scaled.json), the real-dimension
#              slice and small's decode and prefill under a copy of the profile with it on
#              (h200-real-slice-fp4-scaled-{off,on}.json, h200-e2e-fp4-scaled.json)
#   fp4packed  the same for the packed decode (fp4_decode: packed): h200-fp4-packed-tests.log,
#              h200-gemv-fp4-packed.json, h200-real-slice-fp4-packed-{off,on}.json, h200-e2e-fp4-packed.json
#   grouped    the experts of prefill-sized calls as bf16 grouped GEMMs (tiles.moe.grouped_min_rows: 256
#              under a copy of the profile): their tests natively, the GPU ones included
#              (h200-moe-grouped-tests.log), the prefill forwards by row count with and without it
#              (GROUPED_ROWS, default "1 4 16 64": h200-prefill-rows-grouped-{on,off}.json) and, unless
#              GROUPED_ROWS is set, small's e2e with it (h200-e2e-moe-grouped.json)
#   pdl        programmatic dependent launch (tiles.pdl.enabled): its tests (the GPU one compares captured
#              decode steps with it on and off), then the captured decode step of `small` at batch 1 / 8 / 64
#              and the real-dimension slice, each with it off and on: h200-pdl-tests.log,
#              h200-e2e-pdl-{off,on}.json, h200-real-slice-pdl-{off,on}.json
#   mixstream  the blocks' mHC coefficients on a second stream (hc_mix_stream_max_tokens 0 and 64 over
#              the h200 profile): its GPU test, then the captured decode step of `small` at batch 1 / 8 / 64 with it off and on,
#              twice, interleaved: h200-mix-stream-tests.log, h200-e2e-mix-stream-{off,on}-{1,2}.json
#   selectstream  the attention's compressor and indexer on a stream of their own (indexer_stream_max_tokens
#              0 and 64 over the h200 profile, its mixes forked): the fork GPU tests (mixes and selections), then the captured
#              decode step of `small` at batch 1 / 8 / 64 with it off and on, twice, interleaved:
#              h200-select-stream-tests.log, h200-e2e-select-stream-{off,on}-{1,2}.json
#   conformance  `flashrt conformance` under the h200 profile (every op against the reference on the
#              device): h200-conformance.json (copy it to hwconfigs/reports/h200.json when it passes)
#   topk       topk_positions (k = 512) at 1 / 8 / 64 rows of 2K / 4K / 128K / 1M entries under radix_bits
#              1, 2, 4 and 8 against torch.topk + sort (benchmarks/topk_radix.py): h200-topk-radix.json;
#              then rows of 2K / 4K with a summary of 4,096 (4K rows picked from registers too):
#              h200-topk-summary-4096.json
#   pairs      the fp4_b16 encoders (the midpoint comparisons; bf16 pairs in PTX with tiles.quant.quantize.pairs,
#              off in every profile): their tests, pairs off and on (h200-pairs-tests.log), then the elementwise
#              kernels under the profile and with pairs (h200-kernels-elementwise-pairs-{off,on}.json)
#   quant      the CUDA kernel tests natively of every kernel reading the encoders (quantize, the KV stores, the
#              fused activation quantization of linear and the experts) and of the top-k, then the elementwise kernels
#              (quantize, dequantize, quantize-and-store, rms_norm, rope) against the copy bandwidth and
#              their torch references (flashrt bench kernels --families elementwise):
#              h200-quant-tests.log, h200-kernels-elementwise.json; then top-k rows of 2K / 4K / 128K at
#              radix 1 under the h200 profile: h200-topk-profile.json
#   realslice  decode at the real V4.1-Flash dimensions (benchmarks/real_slice.py, batches 1 / 8 / 64)
#              with the GPU kernels of 3 replays per batch: h200-real-slice-profile.json
#
# Each phase's output goes to $OUT/phase-PHASE.log; its last lines are printed. The lent machine returns
# at most 8 files a call: with PACK set (a path), the phases write to a folder of their own, packed into
# that one archive when the script ends, also when a timeout ends it, e.g. in a device call
#   PACK=$OUT/results.tgz timeout 560 bash benchmarks/h200_session.sh P1 P2
# (a timeout under the call's limit leaves the archive its time).
# On the lent machine the dependencies come from wheels in .whl/ (no internet there; pass
# `carry: [".whl"]`). Its Python is 3.12: build the folder with
#   pip download --no-deps --python-version 3.12 --platform manylinux2014_x86_64 --only-binary=:all: -d .whl \
#     fastapi uvicorn openai starlette pydantic pydantic-core anyio sniffio h11 httpx httpcore distro jiter \
#     typing-inspection annotated-types annotated-doc opentelemetry-api prometheus-client
# (the serving phases and the server's GPU tests need them; the kernel and decode phases do not). Outputs go to $OUT (default: benchmarks/results/); copy them into
# benchmarks/results/ and quote each figure in docs/performance.md with its command.
set -u
[ $# -gt 0 ] || { sed -n "2,/^set -u/{/^#/p}" "$0"; exit 2; }
for phase in "$@"; do  # a phase is a function phase_NAME below (dashes as underscores)
  grep -q "^phase_${phase//-/_}() {" "$0" || {
    echo "unknown phase: $phase (expected one of: $(sed -n 's/^phase_\([a-z0-9_]*\)() {.*/\1/p' "$0" \
      | tr _ - | tr '\n' ' '))" >&2; exit 2; }
done
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
if [ -n "${PACK:-}" ]; then  # every output in one archive (see the header), made on the way out
  OUT=$(mktemp -d)
  trap 'tar czf "$PACK" -C "$OUT" . && echo "packed the outputs into $PACK"' EXIT
  trap 'exit 143' TERM
fi
mkdir -p "$OUT" .cache
export TRITON_CACHE_DIR=$PWD/.cache/triton FLASHRT_CACHE_DIR=$PWD/.cache/flashrt PYTHONUNBUFFERED=1
if [ -d .whl ] && ! python -c "import fastapi, uvicorn, openai" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || exit 1
fi
python -c "import flashrt" 2>/dev/null || python -m pip install --no-deps --no-build-isolation -q -e . >/dev/null 2>&1 || exit 1

variant_labels() {  # TABLE: the labels of benchmarks/gemv_tiles.py's variant table TABLE, one a line
  python -c "import sys; sys.path.insert(0, 'benchmarks'); import gemv_tiles; print('\n'.join(gemv_tiles.$1))"
}

profile_set() {  # NAME DOTTED.KEY JSON [DOTTED.KEY JSON ...]: a copy of h200.yaml named NAME with those keys set
  # (a numeric part indexes a list: tiles.moe.experts.0.1.split_per_sm is the first rule's tile); prints its path
  local f
  f=$(mktemp -d)/$1.yaml  # a profile's name is its file's
  python -c "import json, sys, yaml; p = yaml.safe_load(open('hwconfigs/h200.yaml')); p['name'] = sys.argv[2]
for key, value in zip(sys.argv[3::2], sys.argv[4::2]):
    *path, last = key.split('.'); d = p
    for k in path: d = d[int(k)] if isinstance(d, list) else d.setdefault(k, {})
    d[int(last) if isinstance(d, list) else last] = json.loads(value)
yaml.safe_dump(p, open(sys.argv[1], 'w'))" "$f" "$@"
  echo "$f"
}

profile_with() {  # NAME FAMILY KEY JSON: tiles.FAMILY.KEY = JSON (profile_set)
  profile_set "$1" "tiles.$2.$3" "$4"
}

phase_serve() {
  python benchmarks/serve_vs_generate.py --model small --step-trace "$OUT/h200-serve-process-steps.jsonl" \
    --out "$OUT/h200-serve-process.json"
}

phase_engine_gpu() {
  timeout 150 python -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/engine/test_serving_overlap.py \
    tests/engine/test_step_capture.py tests/engine/test_prefill_capture.py > "$OUT/h200-engine-gpu-tests.log" 2>&1
  tail -n 2 "$OUT/h200-engine-gpu-tests.log"
}

phase_mhc() {
  timeout 150 python -m pytest -q -n 4 -p no:cacheprovider tests/kernels_cuda/test_cuda_norm_mhc.py \
    > "$OUT/h200-mhc-tests.log" 2>&1
  tail -n 2 "$OUT/h200-mhc-tests.log"
}

phase_serve_budget() {
  local n
  for n in ${SERVE_BUDGETS:-8192 16384 32768}; do
    python benchmarks/serve_vs_generate.py --model small --concurrency 64 --max-step-tokens "$n" \
      --step-trace "$OUT/h200-serve-budget-$n-steps.jsonl" --out "$OUT/h200-serve-budget-$n.json" | tail -n 4
  done
}

phase_serve_alt() {
  python benchmarks/serve_vs_generate.py --model small --concurrency 64 --serve-arg=--no-engine-process \
    --out "$OUT/h200-serve-in-process.json"
  python benchmarks/serve_vs_generate.py --model small --concurrency 64 --serve-arg=--prefix-cache-bytes=0 \
    --out "$OUT/h200-serve-no-prefix.json"
}

phase_overlap() {
  timeout 120 python -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_serving_overlap.py 2>&1 | tail -n 3
  python benchmarks/serve_vs_generate.py --model small --out "$OUT/h200-serve-overlap.json"
  python benchmarks/serve_vs_generate.py --model small --concurrency 64 --serve-arg=--no-overlap \
    --out "$OUT/h200-serve-no-overlap.json"
}

phase_kernels() {
  timeout 200 python -m pytest -q -n 12 -p no:cacheprovider tests/kernels_cuda > "$OUT/h200-kernel-tests.log" 2>&1
  timeout 150 python -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/graphs tests/engine/test_serving_overlap.py \
    tests/engine/test_step_capture.py tests/kernels_cuda/test_cuda_decode_tiles.py > "$OUT/h200-gpu-tests.log" 2>&1
  tail -n 2 "$OUT/h200-kernel-tests.log" "$OUT/h200-gpu-tests.log"
}

phase_tiles() {
  # shellcheck disable=SC2086  # the batches are words
  python benchmarks/decode_tiles.py --model small --batches ${TILES_BATCHES:-1 8 64} --budget "${TILES_BUDGET:-180}" \
    --out "$OUT/h200-decode-tiles.json"
}

phase_profile() {
  local b
  for b in 1 64; do
    python benchmarks/decode_profile.py --model small --batch "$b" --out "$OUT/h200-decode-profile-b$b.json" | tail -n 16
  done
}

phase_e2e() {
  python benchmarks/e2e_decode.py --model small --batches 1 8 64 --prompt 512 --steps 12 --modes cuda+graph \
    --out "$OUT/h200-e2e.json"
}

phase_serve64() {
  python benchmarks/serve_vs_generate.py --model small --concurrency 64 --jit-log "$OUT/h200-serve-64-jit.log" \
    --step-trace "$OUT/h200-serve-64-steps.jsonl" --out "$OUT/h200-serve-64.json"
}

phase_servestart() {
  python benchmarks/serve_start.py --out "$OUT/h200-serve-start.json"
  python benchmarks/serve_start.py --phases cold --workers 0 --out "$OUT/h200-serve-start-nopool.json"
}

phase_serveplan() {
  python benchmarks/serve_start.py --phases cold --keep-plans "$OUT/serve-plans" \
    --out "$OUT/h200-serve-start-record.json"
  python tools/ship_plan.py --after "$OUT"/serve-plans/triton-*/sm_90-h200-small.json || return 1
  cp core/jit_plans/triton-*/sm_90-h200-small.json "$OUT/"
  python benchmarks/serve_start.py --phases cold --out "$OUT/h200-serve-start-shipped.json"
  python benchmarks/jit_ttft.py --phases cold warm --budget 120 --out "$OUT/h200-jit-ttft-serveplan.json"
}

phase_coldstart() {
  python benchmarks/jit_ttft.py --budget 420 --out "$OUT/h200-jit-ttft.json"
  phase_plan
}

phase_plan() {
  local plans
  plans=$(mktemp -d)
  FLASHRT_CACHE_DIR=$plans timeout 120 flashrt jit warmup --model small >/dev/null 2>&1
  find "$plans/jit/plans" -name '*.json' -exec cp {} "$OUT/" \;
}

phase_coldplan() {
  python benchmarks/jit_ttft.py --phases cold --budget 120 --keep-plans "$OUT/recorded-plans" \
    --out "$OUT/h200-jit-ttft-record.json"
  python tools/ship_plan.py "$OUT"/recorded-plans/triton-*/sm_90-h200-small.json || return 1
  cp core/jit_plans/triton-*/sm_90-h200-small.json "$OUT/"
  python benchmarks/jit_ttft.py --phases cold warm --budget 150 --out "$OUT/h200-jit-ttft-shipped.json"
}

phase_coldlog() {  # a cold `flashrt run --model small` on the shipped plan, its process's loads and compiles logged
  FLASHRT_JIT_LOG=$OUT/h200-jit-cold-log.jsonl python benchmarks/jit_ttft.py --phases cold --budget 120 \
    --out "$OUT/h200-jit-ttft-cold-log.json"
}

phase_ttftall() {  # every time-to-first-token phase but the first run's, with the JIT log
  FLASHRT_JIT_LOG=$OUT/h200-jit-ttft-all-log.jsonl python benchmarks/jit_ttft.py \
    --phases cold warm after_warmup after_model_warmup --budget ${TTFT_BUDGET:-300} --out "$OUT/h200-jit-ttft-all.json"
}

phase_moeprefill() {
  timeout 300 python benchmarks/moe_prefill_tiles.py --out "$OUT/h200-moe-prefill-tiles.json"
}

phase_preload() {  # the plan's cached kernels loaded while the model loads (FLASHRT_JIT_PRELOAD), off and on
  timeout 120 python -m pytest -q -p no:cacheprovider tests/core/test_jit_preload.py tests/engine/test_precompile.py \
    > "$OUT/h200-preload-tests.log" 2>&1
  tail -n 1 "$OUT/h200-preload-tests.log"
  python benchmarks/jit_ttft.py --phases cold warm --budget 150 --out "$OUT/h200-jit-ttft-preload-off.json"
  FLASHRT_JIT_PRELOAD=1 python benchmarks/jit_ttft.py --phases cold warm --budget 150 \
    --out "$OUT/h200-jit-ttft-preload-on.json"
}

phase_serve_allocs() {
  python benchmarks/serve_vs_generate.py --model small --concurrency 64 --device-timing \
    --step-trace "$OUT/h200-serve-allocs-steps.jsonl" --out "$OUT/h200-serve-allocs.json" | tail -n 4
}

phase_hkcp() {
  python benchmarks/hkcp.py --contexts 4096 131072 --out "$OUT/h200-hkcp.json" | tail -n 6
}

phase_ttft_hit() {
  python benchmarks/hkcp.py --ttft-only --out "$OUT/h200-hkcp-ttft.json" | tail -n 2
  python tools/host_profile.py prefix-hit --model small --tokens 32768 --out "$OUT/prof-hit" | tail -n 3
}

phase_engine_profile() {
  python tools/host_profile.py engine --model small --requests 128 --max-running 64 --out "$OUT/prof-engine" | tail -n 3
}

phase_prefix() {
  timeout 150 python -m pytest -q -p no:cacheprovider tests/kernels_cuda/test_cuda_prefix_attention.py \
    tests/graphs/test_prefix_selection.py > "$OUT/h200-prefix-tests.log" 2>&1
  tail -n 2 "$OUT/h200-prefix-tests.log"
  python benchmarks/prefix_attention.py --out "$OUT/h200-prefix-attention.json"
  phase_prefill
}

phase_gemv() {
  timeout 120 python -m pytest -q -p no:cacheprovider tests/kernels_cuda/test_cuda_gemv.py > "$OUT/h200-gemv-tests.log" 2>&1
  tail -n 2 "$OUT/h200-gemv-tests.log"
  python benchmarks/gemv_tiles.py --model v4.1-flash --out "$OUT/h200-gemv-tiles-v41.json"
}

fp4_decode_runs() {  # MODE NAME: the fp4dot / fp4packed phases (tiles.linear.fp4_decode MODE)
  local mode=$1 name=$2 on
  timeout 150 python -m pytest -q -p no:cacheprovider tests/kernels_cuda/test_cuda_fp4_scaled.py \
    tests/kernels_cuda/test_cuda_fp4_packed.py > "$OUT/h200-fp4-$name-tests.log" 2>&1
  tail -n 2 "$OUT/h200-fp4-$name-tests.log"
  python benchmarks/gemv_tiles.py --model v4.1-flash --variants "profile, fp4 through tl.dot_scaled" \
    "profile, fp4 decoded packed" --out "$OUT/h200-gemv-fp4-$name.json" | grep moe_experts
  on=$(profile_with "h200-fp4-$name" linear fp4_decode "\"$mode\"")
  python benchmarks/real_slice.py --batches 1 8 64 --out "$OUT/h200-real-slice-fp4-$name-off.json" | grep batch
  FLASHRT_PROFILE=$on python benchmarks/real_slice.py --batches 1 8 64 --out "$OUT/h200-real-slice-fp4-$name-on.json" \
    | grep batch
  FLASHRT_PROFILE=$on python benchmarks/e2e_decode.py --model small --batches 1 8 64 --prompt 512 --steps 12 \
    --modes cuda+graph --out "$OUT/h200-e2e-fp4-$name.json"
}

phase_fp4dot() {
  fp4_decode_runs dot_scaled scaled
}

phase_fp4packed() {
  fp4_decode_runs packed packed
}

phase_grouped() {
  local on
  timeout 150 python -m pytest -q -m "gpu or not gpu" -p no:cacheprovider tests/kernels_cuda/test_cuda_moe_grouped.py \
    > "$OUT/h200-moe-grouped-tests.log" 2>&1
  tail -n 2 "$OUT/h200-moe-grouped-tests.log"
  on=$(profile_with h200-moe-grouped moe grouped_min_rows 256)
  FLASHRT_PROFILE=$on python benchmarks/prefill_rows.py --model small --rows ${GROUPED_ROWS:-1 4 16 64} --tokens 512 \
    --out "$OUT/h200-prefill-rows-grouped-on.json" | grep -v '^ '
  python benchmarks/prefill_rows.py --model small --rows ${GROUPED_ROWS:-1 4 16 64} --tokens 512 \
    --out "$OUT/h200-prefill-rows-grouped-off.json" | grep -v '^ '
  [ -n "${GROUPED_ROWS:-}" ] && return  # rows only
  FLASHRT_PROFILE=$on python benchmarks/e2e_decode.py --model small --batches 1 8 64 --prompt 512 --steps 12 \
    --modes cuda+graph --out "$OUT/h200-e2e-moe-grouped.json"
}

phase_pdl() {
  local on
  timeout 200 python -m pytest -q -m "gpu or not gpu" -p no:cacheprovider tests/kernels_cuda/test_cuda_pdl.py \
    > "$OUT/h200-pdl-tests.log" 2>&1
  tail -n 2 "$OUT/h200-pdl-tests.log"
  on=$(profile_with h200-pdl pdl enabled true)
  python benchmarks/e2e_decode.py --model small --batches 1 8 64 --prompt 512 --steps 12 --modes cuda+graph \
    --out "$OUT/h200-e2e-pdl-off.json"
  FLASHRT_PROFILE=$on python benchmarks/e2e_decode.py --model small --batches 1 8 64 --prompt 512 --steps 12 \
    --modes cuda+graph --out "$OUT/h200-e2e-pdl-on.json"
  python benchmarks/real_slice.py --batches 1 8 64 --out "$OUT/h200-real-slice-pdl-off.json" | grep batch
  FLASHRT_PROFILE=$on python benchmarks/real_slice.py --batches 1 8 64 --out "$OUT/h200-real-slice-pdl-on.json" | grep batch
}

fork_runs() {  # NAME KEY TESTS...: the fork's GPU tests, then small's decode with KEY 0 and 64, twice
  local name=$1 key=$2 off on i
  shift 2
  timeout 200 python -m pytest -q -m gpu -p no:cacheprovider "$@" > "$OUT/h200-$name-tests.log" 2>&1
  tail -n 2 "$OUT/h200-$name-tests.log"
  off=$(profile_set "h200-$name-off" "$key" 0)
  on=$(profile_set "h200-$name" "$key" 64)
  for i in 1 2; do
    FLASHRT_PROFILE=$off python benchmarks/e2e_decode.py --model small --batches 1 8 64 --prompt 512 --steps 12 \
      --modes cuda+graph --out "$OUT/h200-e2e-$name-off-$i.json" | grep batch
    FLASHRT_PROFILE=$on python benchmarks/e2e_decode.py --model small --batches 1 8 64 --prompt 512 --steps 12 \
      --modes cuda+graph --out "$OUT/h200-e2e-$name-on-$i.json" | grep batch
  done
}

phase_mixstream() {
  fork_runs mix-stream hc_mix_stream_max_tokens tests/graphs/test_mix_stream.py
}

phase_selectstream() {
  fork_runs select-stream indexer_stream_max_tokens tests/graphs/test_mix_stream.py
}

phase_conformance() {
  python -m flashrt.cli conformance --out "$OUT/h200-conformance.json" | tail -n 3
}

phase_topk() {
  python benchmarks/topk_radix.py --out "$OUT/h200-topk-radix.json"
  python benchmarks/topk_radix.py --radix 1 --lengths 2048 4096 --summary 4096 --out "$OUT/h200-topk-summary-4096.json"
}

phase_quant() {
  timeout 200 python -m pytest -q -n 12 -p no:cacheprovider tests/kernels_cuda/test_cuda_quant.py \
    tests/kernels_cuda/test_cuda_norm_rope_quant.py tests/kernels_cuda/test_cuda_kv_store.py \
    tests/kernels_cuda/test_cuda_store_many.py tests/kernels_cuda/test_cuda_gemm.py tests/kernels_cuda/test_cuda_fused.py tests/kernels_cuda/test_cuda_moe_direct.py tests/kernels_cuda/test_cuda_moe_shared.py \
    tests/kernels_cuda/test_cuda_topk.py > "$OUT/h200-quant-tests.log" 2>&1
  tail -n 2 "$OUT/h200-quant-tests.log"
  python -m flashrt.cli bench kernels --families elementwise --out "$OUT/h200-kernels-elementwise.json" | tail -n 30
  python benchmarks/topk_radix.py --radix 1 --lengths 2048 4096 131072 --out "$OUT/h200-topk-profile.json"
}

phase_pairs() {  # fp4_b16 stores: the midpoint comparisons, then bf16 pairs in PTX (tiles.quant.quantize.pairs)
  local on
  on=$(profile_set h200-quant-pairs tiles.quant.quantize.pairs true)
  timeout 200 python -m pytest -q -n 12 -p no:cacheprovider \
    tests/kernels_cuda/test_cuda_quant.py tests/kernels_cuda/test_cuda_e2m1_midpoints.py \
    tests/kernels_cuda/test_cuda_norm_rope_quant.py tests/kernels_cuda/test_cuda_kv_store.py \
    tests/kernels_cuda/test_cuda_store_many.py > "$OUT/h200-pairs-tests.log" 2>&1
  tail -n 2 "$OUT/h200-pairs-tests.log"
  python -m flashrt.cli bench kernels --families elementwise \
    --out "$OUT/h200-kernels-elementwise-pairs-off.json" | tail -n 12
  FLASHRT_PROFILE=$on python -m flashrt.cli bench kernels --families elementwise \
    --out "$OUT/h200-kernels-elementwise-pairs-on.json" | tail -n 12
}

phase_stages() {
  local on="$OUT/h200-stages.yaml" labels
  mapfile -t labels < <(variant_labels MMA_VARIANTS)
  python benchmarks/gemv_tiles.py --model v4.1-flash --variants "${labels[@]}" --out "$OUT/h200-gemv-stages.json" \
    --profile-out "$on" | grep -v '^ '
  slice_and_decode stages off h200 on "$on"
}

phase_regs() {
  local apart quant
  timeout 150 python -m pytest -q -n 8 -p no:cacheprovider tests/kernels_cuda/test_cuda_moe_shared.py \
    > "$OUT/h200-moe-shared-tests.log" 2>&1
  tail -n 2 "$OUT/h200-moe-shared-tests.log"
  python benchmarks/gemv_tiles.py --model v4.1-flash --variants "profile, shared expert in its own launches" \
    "profile, activations quantized apart" "MMA N64 K64 s3" "MMA N64 K128 s3" "MMA N128 K64 s2" \
    --out "$OUT/h200-gemv-regs.json" | grep -v '^ '
  apart=$(profile_with h200-shared-apart moe shared_in_launch false)
  quant=$(profile_set h200-quant-apart tiles.moe.fused_max_tokens 0 tiles.linear.fused_max_rows 0)
  slice_and_decode regs off h200 shared-apart "$apart" quant-apart "$quant"
}

phase_attnwarps() {
  local eight
  eight=$(profile_set h200-attn-8w tiles.attention.prefill.min_queries 0)
  python -m flashrt.cli bench kernels --families attention --out "$OUT/h200-kernels-attention-4w.json" | tail -n 8
  FLASHRT_PROFILE=$eight python -m flashrt.cli bench kernels --families attention \
    --out "$OUT/h200-kernels-attention-8w.json" | tail -n 8
}

phase_splits() {
  local on
  timeout 150 python -m pytest -q -n 8 -p no:cacheprovider tests/kernels_cuda/test_cuda_decode_tiles.py \
    "tests/kernels_cuda/test_cuda_attention.py::test_prefill_tiles_keep_programs_of_more_heads_than_max_heads" \
    > "$OUT/h200-splits-tests.log" 2>&1
  tail -n 2 "$OUT/h200-splits-tests.log"
  python -m flashrt.cli bench kernels --families attention --out "$OUT/h200-kernels-attention-maxheads.json" | tail -n 8
  python benchmarks/gemv_tiles.py --model v4.1-flash --variants "profile, split to 3 programs an SM" \
    "profile, split to 4 programs an SM" "profile, split to 6 programs an SM" "profile, split to 8 programs an SM" \
    --out "$OUT/h200-gemv-splits.json" | grep -v '^ '
  local rule keys=()
  for rule in ${SPLIT_RULES:-linear.linear linear_plain.plain moe.experts}; do
    keys+=("tiles.$rule.0.1.split_per_sm" "${SPLIT_PER_SM:-4}")
  done
  on=$(profile_set h200-split "${keys[@]}")
  slice_and_decode splits off h200 on "$on"
}

phase_prefixtiles() {
  local on="$OUT/h200-prefix-tiles.yaml"
  timeout 150 python -m pytest -q -p no:cacheprovider tests/kernels_cuda/test_cuda_moe_grouped.py \
    > "$OUT/h200-moe-grouped-tests-swiglu.log" 2>&1
  tail -n 2 "$OUT/h200-moe-grouped-tests-swiglu.log"
  python benchmarks/moe_swiglu.py --out "$OUT/h200-moe-swiglu.json"
  python benchmarks/prefix_attention.py --rows 16 --variant-rows 16 --out "$OUT/h200-prefix-tiles.json" \
    --profile-out "$on" | grep -v '^ '
  FLASHRT_PROFILE=$on timeout 150 python -m pytest -q -n 8 -p no:cacheprovider \
    tests/kernels_cuda/test_cuda_prefix_attention.py > "$OUT/h200-prefix-tiles-tests.log" 2>&1
  tail -n 2 "$OUT/h200-prefix-tiles-tests.log"
  FLASHRT_PROFILE=$on python benchmarks/prefill_rows.py --model small --rows 16 64 --tokens 512 \
    --out "$OUT/h200-prefill-rows-prefix-tiles-on.json" | grep -v '^ '
  python benchmarks/prefill_rows.py --model small --rows 16 64 --tokens 512 \
    --out "$OUT/h200-prefill-rows-prefix-tiles-off.json" | grep -v '^ '
}

phase_prefixship() {
  local base
  base=$(profile_set h200-prefix-default tiles.prefix_attention.prefix '{"M_BLOCK": 64, "D_SPLIT": 1}')
  timeout 150 python -m pytest -q -n 8 -p no:cacheprovider tests/kernels_cuda/test_cuda_prefix_attention.py \
    tests/kernels_cuda/test_cuda_norm_mhc.py > "$OUT/h200-prefixship-tests.log" 2>&1
  tail -n 2 "$OUT/h200-prefixship-tests.log"
  FLASHRT_PROFILE=$base python benchmarks/prefix_attention.py --model v4.1-flash --rows 1 4 --variant-rows 4 \
    --out "$OUT/h200-prefix-tiles-v41.json" | grep -v '^ '
  python benchmarks/decode_kernel_variants.py --model small --ops hc_coefficients \
    --out "$OUT/h200-hc-variants-small.json" | grep -v '^ '
  python benchmarks/decode_kernel_variants.py --model v4.1-flash --ops hc_coefficients \
    --out "$OUT/h200-hc-variants-v41.json" | grep -v '^ '
  python benchmarks/prefill_rows.py --model small --rows 1 4 16 64 --tokens 512 \
    --out "$OUT/h200-prefill-rows-prefixship.json" | grep -v '^ '
  python benchmarks/e2e_decode.py --model small --batches 1 8 64 --prompt 512 --steps 12 --modes cuda+graph \
    --out "$OUT/h200-e2e-prefixship.json" | tail -n 4
}

phase_topkgroup() {
  local g
  for g in 2048 4096 8192; do
    python benchmarks/topk_radix.py --radix 1 --lengths 131072 1048576 --select "{\"group\": $g}" \
      --out "$OUT/h200-topk-group-$g.json"
  done
}

topk_split_run() {  # NAME SLICE WARPS FUSED SKIP [RADIX [BITS]]: 128K and 1M rows split so, beside torch.topk
  python benchmarks/topk_radix.py --radix "${6:-1}" --lengths 131072 1048576 --out "$OUT/h200-topk-split-$1.json" \
    --select "{\"split_rows\": 64, \"split_slice\": $2, \"split_warps\": $3, \"split_fused\": $4, \"split_skip\": $5, \"bits\": ${7:-32}}"
}

phase_topkexit() {
  timeout 200 python -m pytest -q -n 8 -m "gpu or not gpu" -p no:cacheprovider tests/kernels_cuda/test_cuda_topk.py \
    > "$OUT/h200-topkexit-tests.log" 2>&1
  tail -n 1 "$OUT/h200-topkexit-tests.log"
  python benchmarks/topk_radix.py --radix 1 --lengths 131072 1048576 --out "$OUT/h200-topk-exit.json"
  [ -z "${BEFORE:-}" ] || before_run "$BEFORE" python benchmarks/topk_radix.py --radix 1 --lengths 131072 1048576 \
    --out "$OUT/h200-topk-exit-before.json"
}

phase_hcfinish() {
  local m v=("finish: value-major partials" "finish: all splits in one load")
  timeout 150 python -m pytest -q -n 8 -m "gpu or not gpu" -p no:cacheprovider tests/kernels_cuda/test_cuda_norm_mhc.py \
    > "$OUT/h200-hcfinish-tests.log" 2>&1
  tail -n 1 "$OUT/h200-hcfinish-tests.log"
  for m in small v4.1-flash; do
    python benchmarks/decode_kernel_variants.py --model "$m" --ops hc_coefficients --batches 1 8 \
      --hc-variants "${v[@]}" --out "$OUT/h200-hc-finish-$m.json" | grep -v '^ '
    python benchmarks/decode_kernel_variants.py --model "$m" --ops hc_coefficients --batches 1 8 --hc-iters 1 \
      --hc-variants "${v[@]}" --out "$OUT/h200-hc-finish-$m-iters1.json" | grep -v '^ '
  done
}

phase_swap() {
  local on v=("M64 N128 K64, 4 warps, 4 stages" "M64 N64 K128, 4 warps, 3 stages")
  on=$(profile_set h200-swap tiles.linear.swap_operands true)
  timeout 150 python -m pytest -q -n 8 -m "gpu or not gpu" -p no:cacheprovider \
    tests/kernels_cuda/test_cuda_swap_operands.py > "$OUT/h200-swap-tests.log" 2>&1
  tail -n 1 "$OUT/h200-swap-tests.log"
  python benchmarks/moe_prefill_tiles.py --variants "${v[@]}" --out "$OUT/h200-moe-prefill-swap-off.json"
  FLASHRT_PROFILE=$on python benchmarks/moe_prefill_tiles.py --variants "${v[@]}" \
    --out "$OUT/h200-moe-prefill-swap-on.json"
}

phase_swaprule() {
  local n on v=("M64 N128 K64, 4 warps, 4 stages" "M64 N128 K64, 4 warps, 4 stages, swapped"
             "M64 N64 K128, 4 warps, 3 stages, swapped" "M128 N64 K64, 8 warps, 3 stages, swapped")
  timeout 150 python -m pytest -q -n 8 -m "gpu or not gpu" -p no:cacheprovider \
    tests/kernels_cuda/test_cuda_swap_operands.py > "$OUT/h200-swaprule-tests.log" 2>&1
  tail -n 1 "$OUT/h200-swaprule-tests.log"
  for n in 4096 1024 2048 8192; do
    python benchmarks/moe_prefill_tiles.py --tokens $n --variants "${v[@]}" \
      --out "$OUT/h200-moe-prefill-swaprule-v4.1-flash-$n.json"
  done
  for n in 512 2048; do
    python benchmarks/moe_prefill_tiles.py --model small --tokens $n --variants "${v[@]}" \
      --out "$OUT/h200-moe-prefill-swaprule-small-$n.json"
  done
  on=$(profile_set h200-swaprule tiles.moe.experts.2.1 '{"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64,
    "num_warps": 4, "num_stages": 4, "min_block_n": 32, "split_min_blocks": 2, "swap_operands": true}')
  FLASHRT_PROFILE=$on python benchmarks/prefill_rows.py --model small --rows 1 16 64 --tokens 512 \
    --out "$OUT/h200-prefill-rows-swaprule-on.json" | grep -v '^ '
  python benchmarks/prefill_rows.py --model small --rows 1 16 64 --tokens 512 \
    --out "$OUT/h200-prefill-rows-swaprule-off.json" | grep -v '^ '
}

phase_profilecheck() {
  local off
  python benchmarks/topk_radix.py --radix 1 --lengths 131072 1048576 --out "$OUT/h200-topk-profilecheck.json"
  [ -z "${BEFORE:-}" ] || before_run "$BEFORE" python benchmarks/topk_radix.py --radix 1 --lengths 131072 1048576 \
    --out "$OUT/h200-topk-profilecheck-before.json"
  python benchmarks/real_slice.py --batches 1 8 64 --out "$OUT/h200-real-slice-profilecheck.json" | tail -n 4
  python benchmarks/e2e_decode.py --model small --batches 1 8 64 --prompt 512 --steps 12 --modes cuda+graph \
    --out "$OUT/h200-e2e-profilecheck.json" | tail -n 4
  off=$(profile_set h200-quant-pairs-off tiles.quant.quantize.pairs false)
  FLASHRT_PROFILE=$off python -m flashrt.cli bench kernels --families elementwise \
    --out "$OUT/h200-kernels-elementwise-pairs-off.json" | tail -n 12
  python -m flashrt.cli bench kernels --families elementwise \
    --out "$OUT/h200-kernels-elementwise-pairs-on.json" | tail -n 12
}

before_run() {  # DIR CMD...: CMD with the files under DIR (at their repository paths) swapped in, then restored
  local dir=$1 keep f rc=0
  shift
  keep=$(mktemp -d)
  while read -r f; do
    mkdir -p "$keep/$(dirname "$f")" && cp "$f" "$keep/$f" && cp "$dir/$f" "$f"
  done < <(cd "$dir" && find . -type f)
  "$@" || rc=$?
  while read -r f; do cp "$keep/$f" "$f"; done < <(cd "$keep" && find . -type f)
  return $rc
}

variants_before() {  # TAG ARGS...: benchmarks/decode_kernel_variants.py ARGS at small's and the released
  # dimensions, 1 / 8 / 64 tokens (h200-TAG-MODEL.json), and where BEFORE is set with its files swapped in
  # (h200-TAG-MODEL-before.json)
  local tag=$1 m
  shift
  for m in small v4.1-flash; do
    python benchmarks/decode_kernel_variants.py --model "$m" --batches 1 8 64 "$@" \
      --out "$OUT/h200-$tag-$m.json" | grep -v '^ '
    [ -z "${BEFORE:-}" ] || before_run "$BEFORE" python benchmarks/decode_kernel_variants.py --model "$m" \
      --batches 1 8 64 "$@" --out "$OUT/h200-$tag-$m-before.json" | grep -v '^ '
  done
}

phase_hcdiv() {
  timeout 150 python -m pytest -q -n 8 -m "gpu or not gpu" -p no:cacheprovider tests/kernels_cuda/test_cuda_norm_mhc.py \
    > "$OUT/h200-hcdiv-tests.log" 2>&1
  tail -n 1 "$OUT/h200-hcdiv-tests.log"
  variants_before hc-div --ops hc_coefficients --hc-variants shipped
}

phase_route() {
  timeout 150 python -m pytest -q -n 8 -m "gpu or not gpu" -p no:cacheprovider tests/kernels_cuda/test_cuda_moe_route.py \
    > "$OUT/h200-route-tests.log" 2>&1
  tail -n 1 "$OUT/h200-route-tests.log"
  variants_before route --ops moe_route
  slice_and_decode route on h200
  [ -z "${BEFORE:-}" ] || before_run "$BEFORE" slice_and_decode route before h200
}

phase_h100profile() {
  nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100 || { echo "h100profile: not an H100"; return 1; }
  (
    unset FLASHRT_PROFILE
    python -m flashrt.cli doctor --json > "$OUT/h100-profile-doctor.json"
    python -c "import json, sys; c = json.load(open(sys.argv[1]))['profiles']['chosen']; print(c['name'], c['reason'])" \
      "$OUT/h100-profile-doctor.json"
    python -m flashrt.cli conformance --out "$OUT/h100-profile-conformance.json" | tail -n 2
    timeout 300 python -m pytest -q -m gpu -n 8 -p no:cacheprovider tests > "$OUT/h100-profile-gpu-tests.log" 2>&1
    tail -n 1 "$OUT/h100-profile-gpu-tests.log"
    python benchmarks/e2e_decode.py --model small --batches 1 8 64 --prompt 512 --steps 12 --modes cuda+graph \
      --out "$OUT/h100-profile-e2e.json" | tail -n 3
  )
}

phase_topksplit() {  # the top-k rows split over scanning programs (tiles.topk.select.split_rows): tests, then timed
  timeout 300 python -m pytest -q -n 8 -m "gpu or not gpu" -p no:cacheprovider tests/kernels_cuda/test_cuda_topk.py \
    -k "split or realistic" > "$OUT/h200-topksplit-tests.log" 2>&1
  tail -n 2 "$OUT/h200-topksplit-tests.log"
  python benchmarks/topk_radix.py --radix 1 --lengths 131072 1048576 --select '{"split_rows": 0}' \
    --out "$OUT/h200-topk-split-off.json"
  python benchmarks/topk_radix.py --radix 1 2 4 --lengths 131072 1048576 --out "$OUT/h200-topk-split-profile.json"
}

phase_topksplitvariants() {  # the split's other tiles, each beside torch.topk (and topksplit's own split again)
  topk_split_run 4096-w8-2 4096 8 true 0
  topk_split_run 4096-w8-unfused 4096 8 false 0
  topk_split_run 2048-w8 2048 8 true 0
  topk_split_run 8192-w8 8192 8 true 0
  topk_split_run 4096-w4 4096 4 true 0
  topk_split_run 4096-w8-bits16 4096 8 true 0 1 16
  topk_split_run 4096-w8-radix8 4096 8 true 0 8
}

phase_hcreal() {
  python benchmarks/decode_kernel_variants.py --model v4.1-flash --batches 1 8 64 \
    --out "$OUT/h200-decode-kernel-variants-v41.json" | grep -v '^ '
  python benchmarks/real_slice.py --batches 1 8 64 --profile 3 --out "$OUT/h200-real-slice-profile-2.json" | grep batch
}

find_ncu() {  # the Nsight Compute CLI's path (on PATH or in /opt/nvidia); notes its absence in ncu-check.txt
  command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1 | grep . \
    || { echo "no ncu here" | tee "$OUT/ncu-check.txt" >&2; return 1; }
}

phase_ncu() {
  local ncu case
  ncu=$(find_ncu) || return 1
  for case in ${NCU_CASES:-experts1 experts8 linear1 prefix quant_fp4_b16 topk128k topk128k_64}; do
    timeout 150 "$ncu" --profile-from-start off --clock-control none --section SpeedOfLight \
      --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats \
      --section SchedulerStats --section Occupancy --section LaunchStats \
      python tools/ncu_cases.py "$case" > "$OUT/ncu-$case.txt" 2>&1
    tail -n 3 "$OUT/ncu-$case.txt"
    grep -q "Duration" "$OUT/ncu-$case.txt" || { cp "$OUT/ncu-$case.txt" "$OUT/ncu-check.txt"; return 1; }
  done
}

phase_ncustalls() {
  local ncu case
  ncu=$(find_ncu) || return 1
  for case in ${NCU_CASES:-experts1 linear1 prefix attn64}; do
    timeout 150 "$ncu" --profile-from-start off --clock-control none --section WarpStateStats \
      --section SourceCounters --print-details all python tools/ncu_cases.py "$case" > "$OUT/ncu-stalls-$case.txt" 2>&1
    grep -i -m 12 "stall" "$OUT/ncu-stalls-$case.txt"
  done
}

phase_ncusource() {
  local ncu case
  ncu=$(find_ncu) || return 1
  for case in ${NCU_CASES:-experts1}; do
    local f="$OUT/ncu-source-$case${NCU_TAG:-}"  # NCU_TAG: a suffix telling runs of one case apart
    timeout 150 "$ncu" --profile-from-start off --clock-control none --section SourceCounters \
      --section WarpStateStats --import-source yes -f -o "$f" python tools/ncu_cases.py "$case" > "$f.log" 2>&1
    "$ncu" -i "$f.ncu-rep" --page source --csv --print-source sass > "$f.csv" 2>&1
    python tools/ncu_source.py "$f.csv" --json "$f.json" > "$f.txt" && rm -f "$f.ncu-rep" \
      && python tools/ncu_source.py "$f.csv" --by-count > "$f-counts.txt" \
      && python tools/ncu_source.py "$f.csv" --reasons > "$f-reasons.txt" && gzip -f "$f.csv"  # the report kept when unread
    head -n 30 "$f.txt"
  done
}

phase_kerneltests() {
  timeout 240 python -m pytest -q -n 8 -p no:cacheprovider tests/kernels_cuda > "$OUT/h200-kernel-tests.log" 2>&1
  tail -n 3 "$OUT/h200-kernel-tests.log"
}

phase_scales() {
  local ahead
  timeout 150 python -m pytest -q -n 8 -p no:cacheprovider tests/kernels_cuda/test_cuda_scales_k_major.py \
    tests/kernels_cuda/test_cuda_fp4_packed.py tests/graphs/test_moe_shared_block.py > "$OUT/h200-scales-tests.log" 2>&1
  tail -n 2 "$OUT/h200-scales-tests.log"
  python benchmarks/gemv_tiles.py --model v4.1-flash --variants profile "profile, fp4 scales loaded a block ahead" \
    --scales-k-major --out "$OUT/h200-gemv-scales.json" | grep moe_experts
  NCU_CASES=experts1_kmajor phase_ncusource
  ahead=$(profile_set h200-scale-prefetch tiles.linear.fp4_decode '"packed_prefetch"')
  FLASHRT_PROFILE=$ahead NCU_CASES=experts1 NCU_TAG=-prefetch phase_ncusource
}

slice_and_decode() {  # TAG NAME PROFILE [NAME PROFILE ...]: the real-dimension slice under each profile in
  # turn, then small's captured decode under each: h200-real-slice-TAG-NAME.json, h200-e2e-TAG-NAME.json
  local tag=$1 i
  shift
  local -a runs=("$@")
  for ((i = 0; i < ${#runs[@]}; i += 2)); do
    FLASHRT_PROFILE=${runs[i+1]} python benchmarks/real_slice.py --batches 1 8 64 \
      --out "$OUT/h200-real-slice-$tag-${runs[i]}.json" | tail -n 3
  done
  for ((i = 0; i < ${#runs[@]}; i += 2)); do
    FLASHRT_PROFILE=${runs[i+1]} python benchmarks/e2e_decode.py --model small --batches 1 8 64 --prompt 512 \
      --steps 12 --modes cuda+graph --out "$OUT/h200-e2e-$tag-${runs[i]}.json" | tail -n 3
  done
}

phase_scaleship() {
  local row
  row=$(profile_set h200-scales-row expert_scales '"row"' tiles.linear.fp4_decode '"packed"')
  timeout 90 python -m pytest -q -p no:cacheprovider tests/graphs/test_moe_shared_block.py \
    > "$OUT/h200-scaleship-tests.log" 2>&1
  tail -n 1 "$OUT/h200-scaleship-tests.log"
  slice_and_decode scales row "$row" ship h200
  phase_kerneltests
}

phase_fold() {
  local on
  on=$(profile_set h200-fold tiles.linear.fp4_scale_fold true)
  timeout 120 python -m pytest -q -n 8 -p no:cacheprovider tests/kernels_cuda/test_cuda_fp4_packed.py \
    tests/graphs/test_moe_shared_block.py > "$OUT/h200-fold-tests.log" 2>&1
  tail -n 1 "$OUT/h200-fold-tests.log"
  python benchmarks/gemv_tiles.py --model v4.1-flash --variants profile "profile, fp4 re-bias folded into the scales" \
    --scales-k-major --out "$OUT/h200-gemv-fold.json" | grep moe_experts
  slice_and_decode fold off h200 on "$on"
}

phase_actdq() {
  local on both
  on=$(profile_set h200-actdq tiles.moe.act_dequantized true)
  both=$(profile_set h200-actdq-fold tiles.moe.act_dequantized true tiles.linear.fp4_scale_fold true)
  timeout 150 python -m pytest -q -n 8 -p no:cacheprovider tests/kernels_cuda/test_cuda_moe_act_dequantized.py \
    tests/kernels_cuda/test_cuda_moe_shared.py tests/graphs/test_moe_shared_block.py > "$OUT/h200-actdq-tests.log" 2>&1
  tail -n 1 "$OUT/h200-actdq-tests.log"
  python benchmarks/gemv_tiles.py --model v4.1-flash --variants profile "profile, activations dequantized" \
    "profile, fp4 re-bias folded into the scales" "profile, activations dequantized, re-bias folded" \
    --scales-k-major --out "$OUT/h200-gemv-actdq.json" | grep moe_experts
  slice_and_decode actdq off h200 on "$on" fold "$both"
}

phase_halves() {
  local on
  on=$(profile_set h200-halves tiles.linear.fp4_halves true)
  timeout 150 python -m pytest -q -n 8 -p no:cacheprovider tests/kernels_cuda/test_cuda_fp4_halves.py \
    tests/kernels_cuda/test_cuda_fp4_packed.py tests/graphs/test_moe_shared_block.py > "$OUT/h200-halves-tests.log" 2>&1
  tail -n 1 "$OUT/h200-halves-tests.log"
  python benchmarks/gemv_tiles.py --model v4.1-flash --variants profile "profile, fp4 halves order" --scales-k-major \
    --out "$OUT/h200-gemv-halves.json" | grep moe_experts
  slice_and_decode halves off h200 on "$on"
}

phase_words() {  # the fp4 experts' codes in words and the halves K order, then the fp8 shared expert packed too
  local both all
  both=$(profile_set h200-words-halves expert_fp4 '"words"' tiles.linear.fp4_halves true)
  all=$(profile_set h200-words-halves-fp8 expert_fp4 '"words"' tiles.linear.fp4_halves true tiles.linear.fp8_packed true)
  timeout 150 python -m pytest -q -n 8 -p no:cacheprovider tests/kernels_cuda/test_cuda_fp4_words.py \
    tests/kernels_cuda/test_cuda_fp4_halves.py tests/kernels_cuda/test_cuda_fp4_packed.py \
    tests/kernels_cuda/test_cuda_fp8_packed.py tests/kernels_cuda/test_cuda_moe_act_dequantized.py \
    tests/graphs/test_moe_shared_block.py > "$OUT/h200-words-tests.log" 2>&1
  tail -n 1 "$OUT/h200-words-tests.log"
  python benchmarks/gemv_tiles.py --model v4.1-flash --variants profile "profile, fp4 halves order" \
    "profile, fp8 shared expert packed" "profile, fp4 halves order, fp8 packed" --scales-k-major \
    --expert-words --out "$OUT/h200-gemv-words.json" | grep moe_experts
  slice_and_decode words off h200 both "$both" all "$all"
}

phase_attnws() {  # the warp-specialized Gluon attention kernel (tiles.attention.ws)
  local on
  on=$(profile_set h200-attn-ws tiles.attention.ws.enabled true)
  timeout 240 python -m pytest -q -n 8 -p no:cacheprovider tests/kernels_cuda/test_cuda_attention_ws.py \
    tests/kernels_cuda/test_cuda_attention.py > "$OUT/h200-attn-ws-tests.log" 2>&1
  tail -n 1 "$OUT/h200-attn-ws-tests.log"
  python -m flashrt.cli bench kernels --families attention --out "$OUT/h200-kernels-attention-ws-off.json" | tail -n 4
  FLASHRT_PROFILE=$on timeout 120 python -m flashrt.cli bench kernels --families attention \
    --out "$OUT/h200-kernels-attention-ws-on.json" | tail -n 4
  timeout 200 python benchmarks/attention_ws.py --out "$OUT/h200-attention-ws.json" | tail -n 40
  local ncu
  if ncu=$(find_ncu); then  # where its time goes on the first run: the batch-64 decode under Nsight Compute
    FLASHRT_PROFILE=$on timeout 150 "$ncu" --profile-from-start off --clock-control none --section SpeedOfLight \
      --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy \
      python tools/ncu_cases.py attn64 > "$OUT/ncu-attn64-ws.txt" 2>&1
    grep -m 8 -i "duration\|throughput\|stall" "$OUT/ncu-attn64-ws.txt"
  fi
  for run in off:h200 on:$on; do  # small's 16 heads do not take the kernel: the slice only
    FLASHRT_PROFILE=${run#*:} timeout 200 python benchmarks/real_slice.py --batches 1 8 64 \
      --out "$OUT/h200-real-slice-attnws-${run%%:*}.json" | tail -n 3  # (a timeout: a kernel that hangs)
  done
}

phase_wsfirst() {  # the ws attention: correctness, then its benchmark (each bounded: a kernel may hang)
  timeout 240 python -m pytest -q -n 8 -p no:cacheprovider -m gpu tests/kernels_cuda/test_cuda_attention_ws.py \
    > "$OUT/h200-ws-tests.log" 2>&1
  tail -n 15 "$OUT/h200-ws-tests.log"
  timeout 200 python benchmarks/attention_ws.py --out "$OUT/h200-attention-ws.json" 2>&1 | tail -n 45
}

phase_wsslice() {
  local on
  on=$(profile_set h200-attn-ws-packed tiles.attention.ws.enabled true tiles.attention.ws.min_queries 8 \
    tiles.attention.ws.RAW_STAGES 2 tiles.attention.dequant.packed_fp4_b16 true)
  timeout 200 python benchmarks/attention_ws.py --out "$OUT/h200-attention-ws-2.json" 2>&1 | grep -v "^ " | tail -n 60
  for run in off:h200 on:$on; do
    FLASHRT_PROFILE=${run#*:} timeout 200 python benchmarks/real_slice.py --batches 1 8 64 \
      --out "$OUT/h200-real-slice-attnws-${run%%:*}.json" | tail -n 4
  done
}

phase_wsncu() {
  FLASHRT_PROFILE=$(profile_set h200-attn-ws-packed tiles.attention.ws.enabled true tiles.attention.ws.min_queries 8 \
    tiles.attention.ws.RAW_STAGES 2 tiles.attention.dequant.packed_fp4_b16 true) NCU_CASES=attn64 NCU_TAG=-ws \
    phase_ncusource
}

phase_ws8() {
  local -a v
  IFS='|' read -ra v <<< "${WS8_VARIANTS:-q in consumers|split scores}"
  timeout 240 python -m pytest -q -n 8 -m "gpu or not gpu" -p no:cacheprovider tests/kernels_cuda/test_cuda_attention_ws.py \
    -k "default or q-in or split-scores or rows-by-warp or staged or decode-ahead" > "$OUT/h200-ws8-tests.log" 2>&1
  tail -n 4 "$OUT/h200-ws8-tests.log"
  timeout 320 python benchmarks/attention_ws.py --batches 64 --out "$OUT/h200-attention-ws-8.json" \
    --variants "${v[@]}" 2>&1 \
    | grep -v "^ " | tail -n 40
}

phase_wgmma() {
  timeout 120 python benchmarks/wgmma_rate.py --out "$OUT/h200-wgmma-rate.json"
}

phase_wsprod() {  # ordered by what a short lease must bring back first
  timeout 170 python benchmarks/attention_ws.py --batches 8 64 --out "$OUT/h200-attention-ws-3.json" 2>&1 \
    | grep -v "^ " | tail -n 40
  timeout 150 python -m pytest -q -n 8 -m "gpu or not gpu" -p no:cacheprovider tests/kernels_cuda/test_cuda_attention_ws.py \
    tests/kernels_cuda/test_cuda_attention_packed.py tests/kernels_cuda/test_cuda_attention.py \
    tests/kernels_cuda/test_cuda_prefix_attention.py > "$OUT/h200-wsprod-tests.log" 2>&1
  tail -n 12 "$OUT/h200-wsprod-tests.log"
  timeout 100 python benchmarks/real_slice.py --batches 1 8 64 --out "$OUT/h200-real-slice-wsprod-on.json" | tail -n 3
}

phase_fp8deq() {
  local rows16 all
  rows16=$(profile_set h200-fp8deq-16 tiles.linear.linear.0.1.fp8_mma false)  # the first rule only
  all=$(profile_set h200-fp8deq tiles.linear.fp8_mma false)
  python benchmarks/gemv_tiles.py --model v4.1-flash \
    --variants profile "profile, fp8 weights dequantized (no fp8 MMA)" --out "$OUT/h200-gemv-fp8deq.json" \
    | grep -v moe_experts
  slice_and_decode fp8deq off h200 rows16 "$rows16" all "$all"
}

phase_gemv8() {
  local -a v
  timeout 150 python -m pytest -q -n 8 -m "gpu or not gpu" -p no:cacheprovider tests/kernels_cuda/test_cuda_fp8_gemv.py \
    tests/kernels_cuda/test_cuda_plain_gemv.py > "$OUT/h200-gemv8-tests.log" 2>&1
  tail -n 1 "$OUT/h200-gemv8-tests.log"
  mapfile -t v < <(variant_labels GEMV_VARIANTS)
  python benchmarks/gemv_tiles.py --model v4.1-flash --variants profile "${v[@]}" --profile-out "$OUT/h200-gemv8.yaml" \
    --out "$OUT/h200-gemv-gemv8.json" | grep -v moe_experts
  grep -c "gemv: true" "$OUT/h200-gemv8.yaml" || true
}

phase_gemvrows() {
  timeout 200 python -m pytest -q -n 8 -m "gpu or not gpu" -p no:cacheprovider tests/kernels_cuda/test_cuda_fp8_gemv.py \
    tests/kernels_cuda/test_cuda_plain_gemv.py > "$OUT/h200-gemvrows-tests.log" 2>&1
  tail -n 1 "$OUT/h200-gemvrows-tests.log"
  python benchmarks/gemv_tiles.py --model v4.1-flash --rows 1 2 4 8 --variants "GEMV N32 K256 s3" "GEMV N64 K256 s3" \
    "GEMV N64 K256 s3, 2 rows a program" "GEMV N64 K256 s3, 4 rows a program" "GEMV N32 K256 s3, 4 rows a program" \
    "GEMV N64 K128 s3, 4 rows a program" --out "$OUT/h200-gemv-rows.json" --profile-out "$OUT/h200-gemv-rows.yaml" \
    | grep -v moe_experts
}

phase_nopdlprofile() {  # where the decode step's GPU time goes with each kernel's time its own (no PDL overlap)
  local off
  off=$(profile_set h200-nopdl tiles.pdl.enabled false)
  FLASHRT_PROFILE=$off python benchmarks/real_slice.py --batches 1 8 --profile 3 \
    --out "$OUT/h200-real-slice-profile-nopdl.json"
  FLASHRT_PROFILE=$off python benchmarks/decode_profile.py --model small --batch 1 \
    --out "$OUT/h200-decode-profile-b1-nopdl.json" > "$OUT/h200-decode-profile-b1-nopdl.log" 2>&1
  grep -A 12 "GPU time per decode step" "$OUT/h200-decode-profile-b1-nopdl.log"
}

phase_gemvrt() {  # the fp8 GEMV's activations through their fp8 round trip by a launch before it (gemv_round_trip)
  timeout 200 python -m pytest -q -n 8 -m "gpu or not gpu" -p no:cacheprovider tests/kernels_cuda/test_cuda_fp8_gemv.py \
    tests/kernels_cuda/test_cuda_moe_act_dequantized.py > "$OUT/h200-gemvrt-tests.log" 2>&1
  tail -n 1 "$OUT/h200-gemvrt-tests.log"
  python benchmarks/gemv_tiles.py --model v4.1-flash --rows 1 2 4 --variants "GEMV N64 K256 s3" \
    "GEMV N64 K256 s3, round trip" "GEMV N64 K256 s3, 2 rows a program" "GEMV N64 K256 s3, 2 rows a program, round trip" \
    "GEMV N64 K256 s3, 4 rows a program" "GEMV N64 K256 s3, 4 rows a program, round trip" \
    "GEMV N32 K256 s3, 4 rows a program, round trip" --out "$OUT/h200-gemv-roundtrip.json" | grep -v moe_experts
  local on
  on=$(profile_set h200-gemv-round-trip tiles.linear.linear.0.1.gemv_round_trip true)
  slice_and_decode gemvrt off h200 on "$on"
}

phase_gemvrtsmall() {  # the two-row GEMV with and without its round trip at small's projections (a verify's rows)
  python benchmarks/gemv_tiles.py --model small --rows 1 2 --variants "GEMV N64 K256 s3" \
    "GEMV N64 K256 s3, round trip" "GEMV N64 K256 s3, 2 rows a program" "GEMV N64 K256 s3, 2 rows a program, round trip" \
    --out "$OUT/h200-gemv-roundtrip-small.json" | grep -v moe_experts
}

phase_gemvsmallrows() {  # small's weights fit in L2: past 2 rows, is a GEMV still faster than the MMA tile there?
  python benchmarks/gemv_tiles.py --model small --rows 4 5 8 --variants "GEMV N64 K256 s3" \
    "GEMV N64 K256 s3, 4 rows a program" "GEMV N32 K256 s3, 4 rows a program" \
    --out "$OUT/h200-gemv-small-rows.json" | grep -v moe_experts
}

phase_gemvmma() {  # fp8 linear at 1-16 rows on mma.sync with the weight rows as its M (the gemv_mma knob)
  timeout 200 python -m pytest -q -m "gpu or not gpu" -p no:cacheprovider tests/kernels_cuda/test_cuda_gemv_mma.py \
    > "$OUT/h200-gemv-mma-tests.log" 2>&1
  tail -n 15 "$OUT/h200-gemv-mma-tests.log"
  local variants
  mapfile -t variants < <(variant_labels MMA_GEMV_VARIANTS)
  python benchmarks/gemv_tiles.py --model v4.1-flash --rows 1 2 4 8 16 --variants "GEMV N64 K256 s3" "${variants[@]}" \
    --out "$OUT/h200-gemv-mma-v41.json" | grep -v 'moe_experts\|plain '
  [ -n "${GEMV_MMA_SMALL:-}" ] || return 0
  python benchmarks/gemv_tiles.py --model small --rows 1 2 5 8 --variants "GEMV N64 K256 s3" "${variants[@]}" \
    --out "$OUT/h200-gemv-mma-small.json" | grep -v 'moe_experts\|plain '
}

slice_off_on() {  # TAG OFF_PROFILE ON_PROFILE BATCH...: the real-dimension slice under both profiles,
  # h200-real-slice-TAG-{off,on}.json
  local tag=$1 off=$2 on=$3
  shift 3
  FLASHRT_PROFILE=$off python benchmarks/real_slice.py --batches "$@" --out "$OUT/h200-real-slice-$tag-off.json" \
    | tail -n 4
  FLASHRT_PROFILE=$on python benchmarks/real_slice.py --batches "$@" --out "$OUT/h200-real-slice-$tag-on.json" \
    | tail -n 4
}

phase_gemvmmaslice() {  # the real-dimension slice at batch 2 and 8 under the profile and a copy without gemv_mma
  local off
  off=$(profile_set h200-no-gemv-mma tiles.linear.linear.2.1.gemv_mma false)  # the 3-8 row rule (batch 8's)
  slice_off_on gemvmma "$off" h200 2 8
}

phase_moemma() {  # the routed fp4 experts on mma.sync with the weight rows as its M (the experts' gemv_mma knob)
  timeout 300 python -m pytest -q -m "gpu or not gpu" -p no:cacheprovider tests/kernels_cuda/test_cuda_moe_mma.py \
    tests/kernels_cuda/test_cuda_moe_act_dequantized.py tests/kernels_cuda/test_cuda_moe_shared.py \
    > "$OUT/h200-moe-mma-tests.log" 2>&1
  tail -n 15 "$OUT/h200-moe-mma-tests.log"
  local variants
  mapfile -t variants < <(variant_labels EXPERT_MMA_VARIANTS)
  python benchmarks/gemv_tiles.py --model v4.1-flash --rows 1 --scales-k-major --expert-words --variants \
    "${variants[@]}" --out "$OUT/h200-moe-mma-v41.json" | grep 'fp4 words'
  python benchmarks/moe_kernels.py --variant "${variants[@]:0:3}" --out "$OUT/h200-moe-kernels.json" | grep -v Warn
}

phase_decodes() {  # the packed decodes' GPU tests, then the ws attention with them against the code-by-code decodes
  timeout 240 python -m pytest -q -n 8 -m "gpu or not gpu" -p no:cacheprovider tests/kernels_cuda/test_cuda_fp4_packed.py \
    tests/kernels_cuda/test_cuda_fp8_packed.py tests/kernels_cuda/test_cuda_attention_ws.py \
    tests/kernels_cuda/test_cuda_attention_packed.py tests/kernels_cuda/test_cuda_attention.py \
    tests/kernels_cuda/test_cuda_prefix_attention.py tests/kernels_cuda/test_cuda_indexer.py \
    tests/kernels_cuda/test_cuda_moe_shared.py tests/kernels_cuda/test_cuda_fp4_words.py \
    tests/kernels_cuda/test_cuda_moe_mma.py tests/kernels_cuda/test_cuda_scales_k_major.py \
    tests/graphs/test_moe_shared_block.py > "$OUT/h200-decodes-tests.log" 2>&1
  tail -n 15 "$OUT/h200-decodes-tests.log"
  timeout 170 python benchmarks/attention_ws.py --batches 8 64 --out "$OUT/h200-attention-ws-decodes.json" 2>&1 \
    | grep -v "^ " | tail -n 40
  [ -z "${BEFORE:-}" ] || before_run "$BEFORE" timeout 170 python benchmarks/attention_ws.py --batches 8 64 \
    --out "$OUT/h200-attention-ws-decodes-before.json" 2>&1 | grep -v "^ " | tail -n 40
}

phase_qgmma() {  # the experts' GEMMs on the fp8 warpgroup MMA, weights as its register operand
  timeout 240 python -m pytest -q -n 4 -m "gpu or not gpu" -p no:cacheprovider tests/kernels_cuda/test_cuda_experts_qgmma.py \
    tests/kernels_cuda/test_cuda_moe_qgmma.py tests/kernels_cuda/test_cuda_gemm.py -k "qgmma or fp8_codes" \
    > "$OUT/h200-qgmma-tests.log" 2>&1
  tail -n 15 "$OUT/h200-qgmma-tests.log"
  timeout 240 python benchmarks/experts_qgmma.py --out "$OUT/h200-experts-qgmma.json"
  [ -z "${BEFORE:-}" ] || before_run "$BEFORE" timeout 240 python benchmarks/experts_qgmma.py --splits \
    --qgmma-per-sm 16 --out "$OUT/h200-experts-qgmma-before.json"
}

phase_decodesslice() {  # the real-dimension slice with the packed decodes, and with BEFORE's files before them
  timeout 150 python benchmarks/real_slice.py --batches 1 8 64 --out "$OUT/h200-real-slice-decodes.json" | tail -n 4
  [ -z "${BEFORE:-}" ] || before_run "$BEFORE" timeout 150 python benchmarks/real_slice.py --batches 1 8 64 \
    --out "$OUT/h200-real-slice-decodes-before.json" | tail -n 4
}

phase_gemvdq() {  # fp8 linear over the activations' round trip on mma.sync, up to 64 rows (the gemv_mma_dq knob)
  timeout 200 python -m pytest -q -m "gpu or not gpu" -p no:cacheprovider tests/kernels_cuda/test_cuda_gemv_mma.py \
    tests/kernels_cuda/test_cuda_fp8_packed.py > "$OUT/h200-gemv-dq-tests.log" 2>&1
  tail -n 15 "$OUT/h200-gemv-dq-tests.log"
  local variants
  mapfile -t variants < <(variant_labels DQ_GEMV_VARIANTS)
  python benchmarks/gemv_tiles.py --model v4.1-flash --rows 1 4 8 16 32 64 --variants \
    "MMA GEMV, 4 warps, kw 8, 4 an SM, 3 stages" "${variants[@]}" --out "$OUT/h200-gemv-dq-v41.json" \
    | grep -v 'moe_experts\|plain '
}

phase_qgmmadecode() {  # fp8 linear at 1-64 rows on the fp8 warpgroup MMA, K split (the qgmma_per_sm knob)
  timeout 200 python -m pytest -q -m "gpu or not gpu" -p no:cacheprovider tests/kernels_cuda/test_cuda_linear_qgmma.py \
    > "$OUT/h200-qgmma-decode-tests.log" 2>&1
  tail -n 15 "$OUT/h200-qgmma-decode-tests.log"
  local variants
  mapfile -t variants < <(variant_labels QGMMA_DECODE_VARIANTS)
  python benchmarks/gemv_tiles.py --model v4.1-flash --rows 8 16 32 64 --variants \
    "MMA GEMV dq, 4 warps, 4 an SM" "${variants[@]}" --out "$OUT/h200-qgmma-decode-v41.json" \
    | grep -v 'moe_experts\|plain '
}

qgmma_decode_before() {  # a copy of h200.yaml with the linear rules for 9-64 rows as before the streamed launch
  profile_set h200-gemv-mma-rules tiles.linear.linear.3 '[16, {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128,
    "num_warps": 4, "num_stages": 3, "split_min_blocks": 1, "gemv_mma": true, "gemv_mma_kw": 8, "gemv_mma_per_sm": 4,
    "gemv_mma_stages": 3, "gemv_mma_min_weights": 8388608, "max_weights": 16777216}]' \
    tiles.linear.linear.4 '[32, {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3,
    "split_reduce": true, "gemv_mma": true, "gemv_mma_dq": true, "gemv_mma_kw": 8, "gemv_mma_per_sm": 4,
    "gemv_mma_stages": 3, "gemv_mma_min_weights": 16777216}]' \
    tiles.linear.linear.5 '[64, {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3,
    "split_reduce": true}]'
}

phase_qgmmadecodee2e() {  # small's decode at batch 16 and 64 under the linear rules before the streamed launch and now
  local off tag prof
  off=$(qgmma_decode_before)
  for tag in before qgmma; do
    prof=h200
    [ "$tag" = before ] && prof=$off
    FLASHRT_PROFILE=$prof python benchmarks/e2e_decode.py --model small --batches 16 64 --prompt 512 --steps 12 \
      --modes cuda+graph --out "$OUT/h200-e2e-qgmmadec-$tag.json" | tail -n 3
  done
}

phase_qgmmadecoderows() {  # qgmmadecodee2e; the streamed launch at 2-8 rows and its 64-row variants
  phase_qgmmadecodee2e
  python benchmarks/gemv_tiles.py --model v4.1-flash --rows 2 4 8 --variants "MMA GEMV, 4 warps, kw 8, 4 an SM, 3 stages" \
    "qgmma, 4 warps, 3 an SM, 3 stages" "qgmma, 4 warps, 4 an SM, 3 stages" \
    --out "$OUT/h200-qgmma-decode-rows-v41.json" | grep -v 'moe_experts\|plain '
  python benchmarks/gemv_tiles.py --model v4.1-flash --rows 32 64 --variants "qgmma, 4 warps, 2 an SM, 3 stages" \
    "qgmma, 4 warps, 3 an SM, 3 stages, 168 registers" "qgmma, 4 warps, 4 an SM, 3 stages, 32 rows a program" \
    "qgmma, 4 warps, 3 an SM, 3 stages, 32 rows a program" "qgmma, 8 warps, 2 an SM, 3 stages, two token groups" \
    "qgmma, 8 warps, 3 an SM, 3 stages, two token groups" --out "$OUT/h200-qgmma-decode-64-v41.json" \
    | grep -v 'moe_experts\|plain '
}

phase_topkslices() {  # the top-k row split with slices of 16K-64K entries at 8 and 64 rows
  local s
  python benchmarks/topk_radix.py --radix 1 --rows 8 64 --lengths 131072 1048576 \
    --out "$OUT/h200-topk-slices-profile.json" | tail -n 4
  for s in 16384 32768 65536; do
    python benchmarks/topk_radix.py --radix 1 --rows 8 64 --lengths 131072 1048576 --select "{\"split_rows\": 64, \
\"split_programs\": 0, \"split_slice\": $s, \"split_skip\": 32, \"split_bits\": 16}" \
      --out "$OUT/h200-topk-slices-$s.json" | tail -n 4
  done
}

phase_tunepaths() {  # flashrt tune's rule spaces, each on the launch its case takes under the profile
  python -m flashrt.cli tune --kernels attention linear_decode linear_small linear_large moe_decode moe_prefill \
    --budget "${TUNE_BUDGET:-240}" --out "$OUT/h200-tune-paths.yaml" > "$OUT/h200-tune-paths.log" 2>&1
  grep -v '^tuning' "$OUT/h200-tune-paths.log" | tail -n 25
}

phase_topkrepro() {  # the 8 x 1M split in 32K slices again and alone
  local sel='{"split_rows": 64, "split_programs": 0, "split_slice": 32768, "split_skip": 32, "split_bits": 16}'
  python benchmarks/topk_radix.py --radix 1 --rows 8 64 --lengths 131072 1048576 --select "$sel" \
    --out "$OUT/h200-topk-repro-sequence.json" | tail -n 4
  python benchmarks/topk_radix.py --radix 1 --rows 8 --lengths 1048576 --select "$sel" \
    --out "$OUT/h200-topk-repro-alone.json" | tail -n 1
}

phase_topkprograms() {  # 16-64 rows split down to 4 programs a row (several slices each); with BEFORE's kernels too
  local sel='{"split_rows": 64, "split_min_programs": 4}' tag
  for tag in "" ${BEFORE:+-before}; do
    ${tag:+before_run "$BEFORE"} python benchmarks/topk_radix.py --radix 1 --rows 16 32 64 --lengths 131072 1048576 \
      --select "$sel" --out "$OUT/h200-topk-programs-64$tag.json" | tail -n 6
  done
}

phase_topkchunkmax() {  # the chunk-max pass's tiles at 8 and 64 rows
  local b w
  for b in 2048 4096 8192; do
    for w in 4 8; do
      python benchmarks/topk_radix.py --radix 1 --rows 8 64 --lengths 131072 1048576 \
        --chunk-max "{\"block\": $b, \"num_warps\": $w}" --out "$OUT/h200-topk-chunkmax-$b-w$w.json" | tail -n 4
    done
  done
}

phase_topkkernels() {  # the profile's top-k launches kernel by kernel at 1-64 rows of 128K and 1M
  python benchmarks/topk_radix.py --radix 1 --rows 1 2 8 64 --lengths 131072 1048576 --kernels \
    --out "$OUT/h200-topk-kernels.json" | tail -n 16
}

phase_topkpick() {  # the split pick's radix: tests, then each radix kernel by kernel
  local r
  timeout 150 python -m pytest -q -n 8 -m "gpu or not gpu" -p no:cacheprovider tests/kernels_cuda/test_cuda_topk.py \
    -k "split_pick_radix or split_rows" > "$OUT/h200-topkpick-tests.log" 2>&1
  tail -n 1 "$OUT/h200-topkpick-tests.log"
  for r in 0 2 4 8; do
    python benchmarks/topk_radix.py --radix 1 --rows 1 2 8 64 --lengths 131072 1048576 --kernels \
      --select "{\"split_pick_radix\": $r}" --out "$OUT/h200-topk-pick-radix-$r.json" | tail -n 8
  done
}

phase_topkspan() {  # 2-8 rows of 1M in programs of several slices, the launch's scanning programs capped at P
  local p tag
  for tag in "" ${BEFORE:+-before}; do
    for p in ${TOPK_SPAN_PROGRAMS:-256 512 1024 2048}; do
      ${tag:+before_run "$BEFORE"} python benchmarks/topk_radix.py --radix 1 --rows 2 4 8 --lengths 1048576 \
        --select "{\"split_programs\": $p}" --out "$OUT/h200-topk-span-$p$tag.json" | tail -n 3
    done
  done
}

phase_rowrulesslice() {  # the real-dimension slice at batch 2, 4 and 8 under the rules before rowrules' and now
  slice_off_on rowrules "$(rowrules_before)" h200 2 4 8
}

phase_tunecheck() {  # tune's experts winners (4 warps) at the released dimensions, beside the profile
  local b="bf16 streamed" c="128 registers"
  timeout 200 python benchmarks/moe_prefill_tiles.py --variants "$b, 64+16-row tiles, 4 warps, 2 stages, $c" \
    "$b, 64+16-row tiles, 4 warps, 3 stages, $c" --out "$OUT/h200-tunecheck-moe-4096.json"
  timeout 150 python benchmarks/moe_prefill_tiles.py --tokens 2048 --variants "$b, 32+16-row tiles, 4 warps, 3 stages, $c" \
    "$b, 32+16-row tiles, 8 warps, 3 stages, $c" --out "$OUT/h200-tunecheck-moe-2048.json"
}

rowrules_before() {  # a copy of h200.yaml with the 2-row and 3-8-row linear rules and the top-k select as before them
  profile_set h200-rowrules-before tiles.linear.linear.1 '[2, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256,
    "num_warps": 4, "num_stages": 3, "split_min_blocks": 1, "gemv": true, "gemv_rows": 2, "gemv_round_trip": true,
    "gemv_shared_min_weights": 16777216}]' \
    tiles.linear.linear.2 '[8, {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3,
    "split_min_blocks": 1, "gemv_mma": true, "gemv_mma_kw": 8, "gemv_mma_per_sm": 4, "gemv_mma_stages": 3,
    "gemv_mma_min_weights": 8388608}]' tiles.topk.select.split_min_programs 0
}

phase_rowrules() {  # the 2-8-row linear rules on the streamed launch and top-k programs of several slices, before and now
  local off tag prof
  timeout 300 python -m pytest -q -n 4 -m "gpu or not gpu" -p no:cacheprovider tests/kernels_cuda/test_cuda_linear_qgmma.py \
    tests/kernels_cuda/test_cuda_topk.py -k "other_launches or split" > "$OUT/h200-rowrules-tests.log" 2>&1
  tail -n 2 "$OUT/h200-rowrules-tests.log"
  off=$(rowrules_before)
  for tag in before now; do
    prof=h200
    [ "$tag" = before ] && prof=$off
    FLASHRT_PROFILE=$prof python benchmarks/gemv_tiles.py --model v4.1-flash --rows 2 3 4 8 --variants profile \
      --out "$OUT/h200-rowrules-linear-$tag.json" | grep -v 'moe_experts\|plain '
    FLASHRT_PROFILE=$prof python benchmarks/topk_radix.py --radix 1 --rows 1 2 4 8 64 --lengths 131072 1048576 \
      --out "$OUT/h200-rowrules-topk-$tag.json" | tail -n 10
  done
}

phase_qgmmadecodeslice() {  # the real-dimension slice at 16 and 64 rows under the linear rules before and now
  slice_off_on qgmmadec "$(qgmma_decode_before)" h200 16 64
}

phase_moemmaslice() {  # the real-dimension slice under the profile and a copy whose decode experts rule takes gemv_mma
  local on
  on=$(profile_set h200-moe-mma tiles.moe.experts.0.1.gemv_mma true)
  slice_off_on moemma h200 "$on" 1 8 64
}

phase_qgmmaslice() {  # the real slice and small's decode: the profile (experts on qgmma) and a copy as it was before
  local off tag prof
  off=$(profile_set h200-words expert_fp4 '"words"' tiles.moe.experts.0.1.qgmma false)
  slice_off_on qgmma "$off" h200 1 8 64
  for tag in words qgmma; do
    prof=h200
    [ "$tag" = words ] && prof=$off
    FLASHRT_PROFILE=$prof python benchmarks/e2e_decode.py --model small --batches 1 8 64 --prompt 512 --steps 12 \
      --modes cuda+graph --out "$OUT/h200-e2e-qgmma-$tag.json" | tail -n 3
  done
}

phase_qgmmastream() {  # a prefill chunk's experts on qgmma, the activations streamed (moe_qgmma_stream.py)
  local n v=("qgmma streamed, 64-row tiles, 8 warps, 3 stages" "qgmma streamed, 32-row tiles, 8 warps, 3 stages")
  timeout 180 python -m pytest -q -n 4 -m "gpu or not gpu" -p no:cacheprovider \
    tests/kernels_cuda/test_cuda_moe_qgmma_stream.py > "$OUT/h200-qgmma-stream-tests.log" 2>&1
  tail -n 15 "$OUT/h200-qgmma-stream-tests.log"
  timeout 180 python benchmarks/moe_prefill_tiles.py --variants "M64 N128 K64, 4 warps, 4 stages, swapped" \
    "${v[@]}" "qgmma streamed, 64-row tiles, 8 warps, 4 stages" "qgmma streamed, 64-row tiles, 4 warps, 3 stages" \
    "qgmma streamed, 32-row tiles, 4 warps, 4 stages" --out "$OUT/h200-moe-prefill-qgmma-stream-4096.json"
  for n in 2048 8192; do
    timeout 80 python benchmarks/moe_prefill_tiles.py --tokens $n --variants "${v[@]}" \
      --out "$OUT/h200-moe-prefill-qgmma-stream-$n.json"
  done
}

phase_prefillqgmma() {  # a prefill chunk's experts and fp8 projections on qgmma, operands streamed: tests, then timed
  timeout 200 python -m pytest -q -n 4 -m "gpu or not gpu" -p no:cacheprovider \
    tests/kernels_cuda/test_cuda_moe_qgmma_stream.py tests/kernels_cuda/test_cuda_linear_qgmma.py \
    > "$OUT/h200-prefill-qgmma-tests.log" 2>&1
  tail -n 15 "$OUT/h200-prefill-qgmma-tests.log"
  timeout 150 python benchmarks/moe_prefill_tiles.py --variants "qgmma streamed, 64-row tiles, 8 warps, 3 stages" \
    "qgmma streamed, 64-row tiles, 8 warps, 3 stages, one in flight, 128 registers" \
    "qgmma streamed, 32-row tiles, 8 warps, 3 stages" "qgmma streamed, 64-row tiles, 8 warps, 4 stages" \
    "qgmma streamed, 64-row tiles, 4 warps, 3 stages" --out "$OUT/h200-moe-prefill-qgmma-stream-4096.json"
  timeout 170 python benchmarks/linear_prefill.py --out "$OUT/h200-linear-prefill-qgmma.json"
}

bf16_tests() {  # SECONDS: the bf16 streamed experts' GPU tests (h200-prefill-bf16-tests.log)
  timeout "$1" python -m pytest -q -n 8 -m gpu -p no:cacheprovider tests/kernels_cuda/test_cuda_moe_qgmma_stream.py \
    -k bf16 > "$OUT/h200-prefill-bf16-tests.log" 2>&1
  tail -n 15 "$OUT/h200-prefill-bf16-tests.log"
}

phase_prefillbf16() {  # a prefill chunk's experts on the bf16 MMA, operands streamed: tests, then timed
  bf16_tests 200
  local b="bf16 streamed"
  timeout 200 python benchmarks/moe_prefill_tiles.py --variants "$b, 64-row tiles, 8 warps, 3 stages, 128 registers" \
    "$b, 64-row tiles, 8 warps, 4 stages, 128 registers" "$b, 32-row tiles, 8 warps, 3 stages, 128 registers" \
    "$b, 64-row tiles, 8 warps, 3 stages" "$b, 64-row tiles, 4 warps, 4 stages" \
    "qgmma streamed, 64-row tiles, 8 warps, 3 stages, one in flight, 128 registers" \
    --out "$OUT/h200-moe-prefill-bf16-stream-4096.json"
}

phase_prefillbf16tiny() {  # prefillbf16's tests and two variants
  bf16_tests 100
  local b="bf16 streamed"
  timeout 100 python benchmarks/moe_prefill_tiles.py --variants "$b, 64-row tiles, 8 warps, 4 stages, 128 registers" \
    "$b, 32-row tiles, 8 warps, 3 stages, 128 registers" --out "$OUT/h200-moe-prefill-bf16-stream-4096.json"
}

phase_prefilltwo() {  # row tiles of 64 + 16 or 64 + 32 rows on the bf16 MMA: tests, then timed beside the profile
  timeout 150 python -m pytest -q -n 8 -m gpu -p no:cacheprovider tests/kernels_cuda/test_cuda_moe_qgmma_stream.py \
    -k "second_part or bf16-in-kernel" > "$OUT/h200-prefill-two-tests.log" 2>&1
  tail -n 15 "$OUT/h200-prefill-two-tests.log"
  local b="bf16 streamed, 64+"
  timeout 200 python benchmarks/moe_prefill_tiles.py --variants "${b}16-row tiles, 8 warps, 4 stages, 128 registers" \
    "${b}32-row tiles, 8 warps, 3 stages, 128 registers" "${b}32-row tiles, 8 warps, 4 stages, 128 registers" \
    "${b}16-row tiles, 8 warps, 3 stages, 128 registers" "bf16 streamed, 64-row tiles, 8 warps, 4 stages, 128 registers" \
    --out "$OUT/h200-moe-prefill-two-4096.json"
  local t="8 warps, 3 stages, 128 registers"
  timeout 120 python benchmarks/moe_prefill_tiles.py --tokens 2048 --variants "bf16 streamed, 32+16-row tiles, $t" \
    "bf16 streamed, 32+32-row tiles, $t" --out "$OUT/h200-moe-prefill-two-2048.json"
}

phase_prefillbf16small() {  # small's prefill without and with the bf16 streamed experts, then conformance
  local on
  on=$(profile_set h200-stream-any-k tiles.moe.experts.1.1.qgmma_min_k 0 tiles.moe.experts.2.1.qgmma_min_k 0)
  timeout 120 python benchmarks/prefill_rows.py --model small --rows 1 4 16 64 --tokens 512 \
    --out "$OUT/h200-prefill-rows-bf16-off.json" | tail -n 6
  FLASHRT_PROFILE=$on timeout 120 python benchmarks/prefill_rows.py --model small --rows 1 4 16 64 --tokens 512 \
    --out "$OUT/h200-prefill-rows-bf16-on.json" | tail -n 6
  timeout 200 python -m flashrt.cli conformance --out "$OUT/h200-conformance-bf16.json" | tail -n 3
}

phase_prefillquick() {  # prefillqgmma's tests and its two leading variants of each, for a short lease
  timeout 130 python -m pytest -q -n 8 -m "gpu or not gpu" -p no:cacheprovider \
    tests/kernels_cuda/test_cuda_moe_qgmma_stream.py tests/kernels_cuda/test_cuda_linear_qgmma.py -k "not compiles" \
    > "$OUT/h200-prefill-qgmma-tests.log" 2>&1
  tail -n 15 "$OUT/h200-prefill-qgmma-tests.log"
  timeout 100 python benchmarks/moe_prefill_tiles.py --variants "qgmma streamed, 64-row tiles, 8 warps, 3 stages" \
    "qgmma streamed, 64-row tiles, 8 warps, 3 stages, one in flight, 128 registers" \
    --out "$OUT/h200-moe-prefill-qgmma-stream-4096.json"
  timeout 120 python benchmarks/linear_prefill.py --variants "qgmma, 64 rows, 8 warps, 3 stages" \
    "qgmma, 64 rows, 8 warps, 3 stages, one in flight, 128 registers" --out "$OUT/h200-linear-prefill-qgmma.json"
}

phase_prefilltiny() {  # prefillquick's GPU cases and one variant of each, for a lease of a few minutes
  timeout 100 python -m pytest -q -n 8 -m gpu -p no:cacheprovider tests/kernels_cuda/test_cuda_moe_qgmma_stream.py \
    tests/kernels_cuda/test_cuda_linear_qgmma.py > "$OUT/h200-prefill-qgmma-tests.log" 2>&1
  tail -n 15 "$OUT/h200-prefill-qgmma-tests.log"
  timeout 75 python benchmarks/moe_prefill_tiles.py --variants "qgmma streamed, 64-row tiles, 8 warps, 3 stages" \
    --out "$OUT/h200-moe-prefill-qgmma-stream-4096.json"
  timeout 65 python benchmarks/linear_prefill.py --variants "qgmma, 64 rows, 8 warps, 3 stages" \
    --out "$OUT/h200-linear-prefill-qgmma.json"
}

phase_gemvsmallrule() {  # rows 3-8 as the one-row GEMV on small weights: the verify of 2-7 drafted tokens
  local rules on
  rules=$(python -c "import json, yaml; r = yaml.safe_load(open('hwconfigs/h200.yaml'))['tiles']['linear']['linear']
r.insert(2, [8, dict(r[0][1], max_weights=16777216)]); print(json.dumps(r))")
  on=$(profile_set h200-gemv-small-rule tiles.linear.linear "$rules")
  FLASHRT_PROFILE=$on SPEC_TAG=gemvsmall phase_verifysplit
  SPEC_TAG=profile phase_verifysplit
  FLASHRT_PROFILE=$on SPEC_TAG=gemvsmall phase_speculative
  SPEC_TAG=profile phase_speculative
}

phase_speculative() {  # the verify and draft costs against a plain step (the profile's speculative_costs)
  python benchmarks/speculative.py --model small --batches 1 8 64 --out "$OUT/h200-speculative-${SPEC_TAG:-now}.json" \
    | tail -n 12
}

phase_verifysplit() {  # a verify round's forward and commit against a plain step, with their kernels by time
  local k
  for k in 1 4; do
    python benchmarks/verify_breakdown.py --model small --batch 1 --k $k \
      --out "$OUT/h200-verify-breakdown-b1-k$k-${SPEC_TAG:-now}.json" | tail -n 2
  done
}

phase_verifysparse() {  # a verify's queries through the decode path's attention (sparse_max_queries 6) and not
  local on
  on=$(profile_set h200-sparse-verify sparse_max_queries 6)
  FLASHRT_PROFILE=$on SPEC_TAG=sparse6 phase_verifysplit
  SPEC_TAG=prefix phase_verifysplit
  FLASHRT_PROFILE=$on SPEC_TAG=sparse6 phase_speculative
}

phase_vs() {
  if [ -z "${VS_PROFILE:-}" ] || [ ! -f "$VS_PROFILE" ]; then
    echo "vs: VS_PROFILE must name a profile file, got '${VS_PROFILE:-}'"
    return 1
  fi
  slice_and_decode "${VS_TAG:-vs}" off h200 on "$VS_PROFILE"
}

phase_load() {
  python benchmarks/load_time.py --model small --repeats 3 --out "$OUT/h200-load-time-small.json"
}

phase_realslice() {
  python benchmarks/real_slice.py --batches 1 8 64 --profile 3 --out "$OUT/h200-real-slice-profile.json"
}

phase_sample() {
  timeout 120 python -m pytest -q -p no:cacheprovider tests/kernels_cuda/test_cuda_sample.py > "$OUT/h200-sample-tests.log" 2>&1
  tail -n 2 "$OUT/h200-sample-tests.log"
  python benchmarks/greedy_pick.py --out "$OUT/h200-greedy-pick.json"
}

phase_rows() {
  timeout 90 python -m pytest -q -m gpu -p no:cacheprovider tests/kv/test_kv_rows.py > "$OUT/h200-kv-rows-gpu.log" 2>&1
  tail -n 2 "$OUT/h200-kv-rows-gpu.log"
  timeout 90 python tools/blocking_ops.py --model small > "$OUT/h200-blocking-ops.txt" 2>&1
  cat "$OUT/h200-blocking-ops.txt"
}

phase_tests() {
  timeout 300 python -m pytest -q -m gpu -n 8 -p no:cacheprovider tests > "$OUT/h200-gpu-tests.log" 2>&1
  timeout 240 python -m pytest -q -n 8 -p no:cacheprovider tests/kernels_cuda > "$OUT/h200-kernel-tests.log" 2>&1
  tail -n 3 "$OUT/h200-gpu-tests.log" "$OUT/h200-kernel-tests.log"
}

phase_decode() {
  python benchmarks/e2e_decode.py --model small --batches 1 8 64 --prompt 512 --steps 12 --modes cuda+graph \
    --out "$OUT/h200-e2e.json"
  python benchmarks/decode_profile.py --model small --batch 8 --out "$OUT/h200-decode-profile.json"
}

phase_prefill() {
  timeout 150 python -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_prefill_capture.py 2>&1 | tail -n 5
  python benchmarks/prefill_rows.py --model small --rows 1 4 16 64 --tokens 512 --out "$OUT/h200-prefill-rows.json"
  python benchmarks/decode_profile.py --model small --batch 1 --out "$OUT/h200-decode-profile-b1.json"
}

phase_engine() {
  python benchmarks/engine_steps.py --model small --concurrency 64 --out "$OUT/h200-engine-steps.json"
  python benchmarks/engine_steps.py --model small --concurrency 64 --no-prefill-graphs \
    --out "$OUT/h200-engine-steps-no-prefill-graphs.json"
  python benchmarks/engine_steps.py --model small --concurrency 64 --arrivals-per-step 2 \
    --out "$OUT/h200-engine-steps-spread.json"
}

phase_variants() {
  python benchmarks/decode_kernel_variants.py --model small --out "$OUT/h200-decode-kernel-variants.json"
}

phase_combine() {
  local mode b on
  phase_variants
  timeout 150 python -m pytest -q -p no:cacheprovider tests/kernels_cuda/test_cuda_attention.py -k merged_in 2>&1 | tail -n 2
  on=$(profile_with h200-combine attention combine '{"in_kernel": true}')
  for mode in off on; do
    local profile=h200
    [ "$mode" = on ] && profile=$on
    FLASHRT_PROFILE=$profile python benchmarks/e2e_decode.py --model small --batches 1 8 64 --prompt 512 --steps 12 \
      --modes cuda+graph --out "$OUT/h200-combine-$mode-e2e.json"
    for b in 1 64; do
      FLASHRT_PROFILE=$profile python benchmarks/decode_profile.py --model small --batch "$b" \
        --out "$OUT/h200-combine-$mode-profile-b$b.json" > "$OUT/h200-combine-$mode-profile-b$b.log" 2>&1
      grep -m 1 "GPU time per decode step" "$OUT/h200-combine-$mode-profile-b$b.log"  # (not a pipe: head would end the script early)
    done
  done
}

for phase in "$@"; do
  echo "== $phase"
  "phase_${phase//-/_}" > "$OUT/phase-$phase.log" 2>&1
  tail -n 30 "$OUT/phase-$phase.log"
done
