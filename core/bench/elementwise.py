"""Benchmarks of the memory-bound kernel families: quant, norm_rope, mhc, compress, engram.

Each case times the Triton launcher (``flashrt.kernels_cuda.<family>``) and, as the baseline,
the torch reference (``flashrt.backends.reference``) on the same GPU and inputs. Bytes are the
minimum each kernel must move (inputs read once, outputs written once); every case here is
memory-bound, so ``roofline_fraction`` is the fraction of copy bandwidth reached.
``quantize_store`` is measured against the target "quantize-and-store >= 70% of copy bandwidth"
(docs/performance.md; its baseline: ``formats.quantize`` then the indexed copy into the cache, as
``flashrt.kv.util.write_rows``).

    python -m flashrt.bench.elementwise     # prints the rows as JSON
"""
from __future__ import annotations

import json
import math
import traceback

import torch

from . import common
from .common import nbytes as _nb


def _case(rows, ceil, kernel, shape, fn, ref, nbytes, flops=0.0, **extra):
    ms = common.bench_ms(fn)
    base = common.bench_ms(ref) if ref is not None else None
    rows.append(common.row(kernel, shape, ms, flops, nbytes, ceil, baseline="torch reference" if ref else None,
                           baseline_ms=base, **extra))


def _quant(rows, ceil):
    from flashrt.backends import reference as ref
    from flashrt.kernels_cuda import quant

    x = torch.randn(16384, 512, device="cuda", dtype=torch.bfloat16)
    for fmt in ("fp8", "fp4_b16", "fp4_b32"):
        q = quant.quantize(x, fmt)
        _case(rows, ceil, f"quantize {fmt}", "[16384, 512] bf16", lambda: quant.quantize(x, fmt),
              lambda: ref.quantize(x, fmt), _nb(x, q))
        out = quant.dequantize(q, torch.bfloat16)
        _case(rows, ceil, f"dequantize {fmt}", "[16384, 512] -> bf16", lambda: quant.dequantize(q, torch.bfloat16),
              lambda: ref.dequantize(q, torch.bfloat16), _nb(q, out))
        for n in (16384, 131072):  # the target's shape, then a long prefill chunk (steady-state bandwidth)
            _quantize_store_case(rows, ceil, x if n == x.shape[0] else x.repeat(n // x.shape[0], 1), fmt)


def _quantize_store_case(rows, ceil, x, fmt):
    from flashrt import formats
    from flashrt.kernels_cuda import quant

    s = formats.spec(fmt)
    n, d = x.shape
    slots_total = 2 * n  # pages of 64 entries, rows land on a random half of the slots
    cache_data = torch.zeros(slots_total // 64, 64, d // 2 if s.packed else d, dtype=torch.uint8, device="cuda")
    cache_scale = torch.zeros(slots_total // 64, 64, d // s.block, dtype=torch.uint8, device="cuda")
    slots = torch.randperm(slots_total, device="cuda")[:n]
    flat_d, flat_s = cache_data.view(-1, cache_data.shape[-1]), cache_scale.view(-1, cache_scale.shape[-1])

    def baseline():  # what flashrt.kv.util.write_rows does after formats.quantize
        q = formats.quantize(x, fmt)
        flat_d[slots] = q.data.view(torch.uint8)
        flat_s[slots] = q.scale.view(torch.uint8)

    written = n * (cache_data.shape[-1] + cache_scale.shape[-1])
    _case(rows, ceil, f"quantize_store {fmt}", f"[{n}, {d}] bf16 -> {slots_total}-slot paged cache",
          lambda: quant.quantize_store(x, fmt, cache_data, cache_scale, slots), baseline,
          _nb(x, slots) + written, target_copy_fraction=0.7)


def _norm_rope(rows, ceil):
    from flashrt.backends import reference as ref
    from flashrt.rope import rope_table
    from flashrt.kernels_cuda import norm_rope

    x = torch.randn(8192, 5120, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(5120, device="cuda", dtype=torch.bfloat16)
    _case(rows, ceil, "rms_norm", "[8192, 5120] bf16", lambda: norm_rope.rms_norm(x, w, 1e-6),
          lambda: ref.rms_norm(x, w, 1e-6), 2 * _nb(x) + _nb(w), flops=4 * x.numel())
    f = rope_table(64, 8192, 10000.0).to("cuda")
    q = torch.randn(1, 8192, 64, 64, device="cuda", dtype=torch.bfloat16)
    _case(rows, ceil, "rope", "[1, 8192, 64 heads, 64] bf16", lambda: norm_rope.rope(q, f),
          lambda: ref.rope(q, f, False), 2 * _nb(q) + _nb(f), flops=6 * q.numel() // 2)
    wide = torch.randn(1, 8192, 64, 512, device="cuda", dtype=torch.bfloat16)[..., -64:]
    _case(rows, ceil, "rope (strided slice)", "q[..., -64:] of [1, 8192, 64, 512] bf16",
          lambda: norm_rope.rope(wide, f), lambda: ref.rope(wide, f, False), 2 * _nb(q) + _nb(f),
          flops=6 * q.numel() // 2)


def _mhc(rows, ceil):
    from flashrt.backends import reference as ref
    from flashrt.kernels_cuda import mhc

    hc, d = 4, 5120
    fn = torch.randn((2 + hc) * hc, hc * d, device="cuda") / math.sqrt(hc * d)
    scale, base = torch.rand(3, device="cuda") + 0.1, torch.randn((2 + hc) * hc, device="cuda") * 0.5
    for t in (1, 64, 4096):
        x = torch.randn(1, t, hc, d, device="cuda", dtype=torch.bfloat16)
        args = (x, fn, scale, base, 20, 1e-6, 1e-6)
        outs = mhc.hc_coefficients(*args)
        _case(rows, ceil, "hc_coefficients", f"T={t}, hc=4, D=5120, bf16, 20 Sinkhorn iters",
              lambda: mhc.hc_coefficients(*args), lambda: ref.hc_coefficients(*args),
              _nb(x, fn, scale, base, *outs), flops=2 * t * fn.numel())
    x = torch.randn(1, 4096, hc, d, device="cuda", dtype=torch.bfloat16)
    pre, post, comb = mhc.hc_coefficients(x, fn, scale, base, 20, 1e-6, 1e-6)
    y = torch.randn(1, 4096, d, device="cuda", dtype=torch.bfloat16)
    _case(rows, ceil, "hc_collapse", "[4096, 4, 5120] bf16", lambda: mhc.hc_collapse(x, pre),
          lambda: ref.hc_collapse(x, pre), _nb(x, pre, y), flops=2 * x.numel())
    _case(rows, ceil, "hc_expand", "[4096, 4, 5120] bf16", lambda: mhc.hc_expand(y, x, post, comb),
          lambda: ref.hc_expand(y, x, post, comb), _nb(y, x, post, comb) + _nb(x), flops=10 * x.numel())


def _compress_engram(rows, ceil):
    from flashrt import formats
    from flashrt.backends import reference as ref
    from flashrt.kernels_cuda import compress, engram

    kv = torch.randn(1, 2048, 2, 512, device="cuda")
    score = torch.randn(1, 2048, 2, 512, device="cuda")
    _case(rows, ceil, "compress_pool", "[1, 2048, 2, 512] fp32", lambda: compress.compress_pool(kv, score),
          lambda: ref.compress_pool(kv, score), _nb(kv, score) + _nb(kv) // 2, flops=5 * kv.numel())
    n_rows, dh = 1 << 24, 256
    data = torch.randint(0, 0x7F, (n_rows, dh), dtype=torch.uint8, device="cuda")  # 4 GiB, no NaN bytes
    scale = torch.randint(110, 140, (n_rows, dh // 32), dtype=torch.uint8, device="cuda")
    table = formats.QTensor(data.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu), "fp8", (n_rows, dh))
    ids = torch.randint(0, n_rows, (64, 1, 24), device="cuda")
    gathered = ids.numel() * (dh + dh // 32)
    _case(rows, ceil, "engram_lookup", "[64, 1, 24, 256] from 16M rows", lambda: engram.engram_lookup(table, ids),
          lambda: ref.engram_lookup(table, ids), _nb(ids) + gathered + ids.numel() * dh * 2)
    del table, data, scale
    torch.cuda.empty_cache()
    h = torch.randn(1, 4096, 4, 5120, device="cuda", dtype=torch.bfloat16)
    key = torch.randn_like(h)
    value = torch.randn(1, 4096, 5120, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(4, 5120, device="cuda")
    _case(rows, ceil, "engram_gate", "[4096, 4, 5120] bf16", lambda: engram.engram_gate(h, key, value, weight, 1e-6),
          lambda: ref.engram_gate(h, key, value, weight, 1e-6), _nb(h, key, value, weight) + _nb(h),
          flops=8 * h.numel())


def run(ceil: common.Ceilings) -> list[dict]:
    """Every case; a group that fails leaves an error row (ms NaN) and the other groups still run."""
    rows: list[dict] = []
    for group in (_quant, _norm_rope, _mhc, _compress_engram):
        try:
            group(rows, ceil)
        except Exception as exc:  # noqa: BLE001 - recorded in the results, not swallowed
            traceback.print_exc()
            rows.append({"kernel": group.__name__.strip("_"), "shape": "-", "ms": float("nan"),
                         "roofline_fraction": float("nan"), "bound": "error", "error": f"{type(exc).__name__}: {exc}"})
        torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    print(json.dumps(run(common.Ceilings.measure()), indent=1))
