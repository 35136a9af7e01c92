"""One kernel case at a time, for Nsight Compute: the case is built and run until every kernel it
launches is compiled and warm, then run once more between ``cudaProfilerStart`` and
``cudaProfilerStop``, so that ``ncu --profile-from-start off`` sees only that call.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight ... \\
        python tools/ncu_cases.py CASE

Cases (the kernels the speed targets miss on, at the shapes of their targets):

- ``experts1`` / ``experts8``: ``moe_experts`` at the released dimensions (384 fp4_w experts of
  2304 x 5120, top 6, the fp8_w shared expert) for 1 / 8 tokens (benchmarks/gemv_tiles.py's case);
  ``experts1_kmajor`` / ``experts8_kmajor``: the same with the routed experts' scales K major;
- ``qgmma1`` / ``qgmma8``: the same for 1 / 8 tokens with the routed experts in the standard nibbles under
  the experts decode rule's ``qgmma`` knob (kernels_cuda/moe_qgmma.py: the fp8 warpgroup MMA);
- ``experts4096``: the routed experts of a 4,096-token prefill chunk at the released dimensions
  (about 64 rows an expert; benchmarks/moe_prefill_tiles.py's case, laid out as the profile says, under its
  rule: in the h200 profile the streamed launches on the bf16 MMA, kernels_cuda/experts_bf16_stream.py);
  ``experts1024``: the same for 1,024 tokens (about 16 rows an expert: the h200 profile's rule for chunks of
  9-40 rows an expert, row tiles of 32 + 16 rows);
- ``stream4096``: ``experts4096`` under the experts rule's ``qgmma`` knob with 64-row tiles, one MMA in flight
  and 128 registers a thread (the activations streamed: kernels_cuda/moe_qgmma_stream.py);
- ``linear1``: ``linear`` of one row through the released ``wo_b`` (fp8_w, 5120 x 8192); ``linear16`` /
  ``linear64``: of 16 / 64 rows (a decode batch's; the h200 profile's rules put them on the streamed fp8
  warpgroup MMA with K split, kernels_cuda/linear_qgmma.py); ``linear4096``: of 4,096 rows, and
  ``linear4096q`` the same under the linear rule's ``qgmma`` knob, capped alike (kernels_cuda/linear_qgmma.py);
- ``prefix``: ``prefix_attention`` of 16 rows x 512 queries over 512 entries at ``small``'s shapes
  (benchmarks/prefix_attention.py's case);
- ``quant_fp4_b16``: ``quantize_store`` of 131,072 bf16 rows of 512 into an fp4_b16 paged cache;
- ``topk128k`` / ``topk128k_64``: ``topk_positions`` (k = 512) of 1 / 64 rows of 131,072 scores;
- ``hc1``: ``hc_coefficients`` of one token at the released dimensions (4 x 5,120 bf16 streams, 20
  Sinkhorn iterations; benchmarks/decode_kernel_variants.py's case);
- ``attn64``: ``sparse_attention`` decode of 64 rows at the released shapes (64 heads x 512, an fp8
  window ring of 128 and 512 picks of an fp4_b16 main cache of 262,144 entries: K = 640);
- ``attn2048``: the same op for a prefill of 2,048 queries of one sequence over a main cache of 131,072.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def _experts(tokens: int, scales_k_major: bool = False):
    import gemv_tiles
    from flashrt.graphs.config import shipped_config

    cfg, g = shipped_config("v4.1-flash"), torch.Generator().manual_seed(0)
    for _, n, *_, call, _ in gemv_tiles.expert_cases(cfg, torch.device("cuda"), g, scales_k_major):
        if n == tokens:
            return call
    raise AssertionError(tokens)


def _qgmma(tokens: int):
    import gemv_tiles
    from flashrt import profiles

    call = _experts(tokens, profiles.active_profile().expert_scales == "k_major")  # codes in nibbles
    return _under_rule("moe", "experts", 1, gemv_tiles.tweaked("moe", "experts", 1, {"qgmma": True}), call)


def _experts_chunk(tokens: int = 4096):
    import moe_prefill_tiles
    from flashrt.graphs.config import shipped_config

    call, _, _ = moe_prefill_tiles.experts(shipped_config("v4.1-flash"), tokens, torch.device("cuda"),
                                           torch.Generator().manual_seed(0))
    return call


def _under_rule(family: str, entry: str, rows: int | None, rule: dict, call):
    """``call`` with ``[rows, rule]`` in front of ``tiles.<family>.<entry>``'s rules (None: every row count)."""
    import gemv_tiles
    from flashrt import profiles

    def run():
        with gemv_tiles.with_rule(family, entry, rows, rule):
            profiles._TILES_CACHE.clear()  # the tiles of the rule just put in front
            call()
        profiles._TILES_CACHE.clear()
    return run


def _stream4096():
    import moe_prefill_tiles

    rule = moe_prefill_tiles.VARIANTS["qgmma streamed, 64-row tiles, 8 warps, 3 stages, one in flight, 128 registers"]
    return _under_rule("moe", "experts", None, rule, _experts_chunk())


def _linear(rows: int):
    from flashrt import formats, ops

    g = torch.Generator().manual_seed(0)
    w = formats.quantize(torch.randn(5120, 8192, generator=g) * 0.05, "fp8_w").to("cuda")
    x = torch.randn(rows, 8192, generator=g).to("cuda", torch.bfloat16)
    return lambda: ops.linear(x, w)


def _linear4096q():
    import linear_prefill

    rule = linear_prefill.qgmma(64, 8, 3, qgmma_inflight=1, qgmma_maxnreg=128)
    return _under_rule("linear", "linear", None, rule, _linear(4096))


def _prefix():
    import prefix_attention
    from flashrt import ops
    from flashrt.graphs.config import shipped_config

    g = torch.Generator(device="cuda").manual_seed(0)
    args = prefix_attention.case(shipped_config("small"), 16, 512, 0, 512, torch.device("cuda"), g)
    return lambda: ops.prefix_attention(*args)


def _quant_fp4_b16():
    from flashrt.kernels_cuda import quant

    rows, d = 131072, 512
    x = torch.randn(rows, d, device="cuda").to(torch.bfloat16)
    data = torch.empty(2 * rows, d // 2, dtype=torch.uint8, device="cuda")
    scale = torch.empty(2 * rows, d // 16, dtype=torch.uint8, device="cuda")
    slots = torch.randperm(2 * rows, device="cuda")[:rows]
    return lambda: quant.quantize_store(x, "fp4_b16", data, scale, slots)


def _topk(rows: int):
    from flashrt.kernels_cuda import topk

    scores = torch.randn(rows, 1, 131072, device="cuda")
    return lambda: topk.topk_positions(scores, 512)


def _hc1():
    from flashrt.graphs.config import shipped_config
    from flashrt.kernels_cuda import mhc

    cfg, g = shipped_config("v4.1-flash"), torch.Generator(device="cuda").manual_seed(0)
    hc, k = cfg.hc_mult, cfg.hc_mult * cfg.dim
    x = torch.randn(1, 1, hc, cfg.dim, device="cuda", generator=g).to(torch.bfloat16)
    fn = torch.randn((2 + hc) * hc, k, device="cuda", generator=g) * k ** -0.5
    scale = torch.rand(3, device="cuda", generator=g)
    base = torch.randn((2 + hc) * hc, device="cuda", generator=g)
    return lambda: mhc.hc_coefficients(x, fn, scale, base, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps)


def _attn(B: int, S: int, T: int):
    from flashrt import formats, ops

    H, D, W, K = 64, 512, 128, 512
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, S, H, D, device="cuda", generator=g).to(torch.bfloat16)
    ring = formats.quantize(torch.randn(B, W, D, device="cuda", generator=g), "fp8")
    main = formats.quantize(torch.randn(1, T, D, device="cuda", generator=g), "fp4_b16")
    window = torch.arange(W, device="cuda", dtype=torch.int32).expand(B, S, W).contiguous()
    picks = (W + torch.randint(0, T, (B, S, K), device="cuda", generator=g)).to(torch.int32)
    sink = torch.randn(H, device="cuda", generator=g)
    return lambda: ops.sparse_attention(q, (ring, main), (window, picks), sink, D ** -0.5)


CASES = {"experts1": lambda: _experts(1), "experts8": lambda: _experts(8),
         "experts1_kmajor": lambda: _experts(1, True), "experts8_kmajor": lambda: _experts(8, True),
         "qgmma1": lambda: _qgmma(1), "qgmma8": lambda: _qgmma(8), "experts4096": _experts_chunk,
         "experts1024": lambda: _experts_chunk(1024),
         "stream4096": _stream4096, "linear1": lambda: _linear(1), "linear16": lambda: _linear(16),
         "linear64": lambda: _linear(64), "linear4096": lambda: _linear(4096),
         "linear4096q": _linear4096q, "prefix": _prefix,
         "quant_fp4_b16": _quant_fp4_b16, "topk128k": lambda: _topk(1), "topk128k_64": lambda: _topk(64),
         "hc1": _hc1, "attn64": lambda: _attn(64, 1, 262144),
         "attn2048": lambda: _attn(1, 2048, 131072)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case", choices=sorted(CASES))
    ap.add_argument("--warmup", type=int, default=3, help="calls before the profiled one (compiles, caches)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("a CUDA device is needed")
    import flashrt

    with flashrt.use_backend("cuda"), flashrt.value_checks(False):
        call = CASES[args.case]()
        for _ in range(args.warmup):
            call()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        call()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    print(f"ncu_cases: {args.case} ran", flush=True)


if __name__ == "__main__":
    main()
