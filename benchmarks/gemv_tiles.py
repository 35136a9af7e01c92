"""Decode-sized block-scaled GEMMs under row tiles under 16 (the multiply-add K loop) and, for the
experts, each E2M1 decode, against the active profile's tiles, next to their weight-read floor; the
linear cases also as GEMVs (the rules' ``gemv`` knob), the fp8 ones against ``torch._scaled_mm``.

    python benchmarks/gemv_tiles.py --model v4.1-flash --out F

Cases, at the model's dimensions: ``linear`` with ``fp8_w`` weights on each attention projection
shape at 1 / 4 rows (``--rows``), plain bf16 weights at the same rows (the head on fp32 x, the output groups, the
indexer's query projection: ``tiles.linear_plain.plain``, its MMA tiles and GEMVs), and
``moe_experts`` (``fp4_w`` routed experts, the ``fp8_w`` shared expert in the same launches) at
1 / 8 tokens. Each variant puts one rule in front of the active profile's
rules for the case's rows (``tiles.linear.linear`` / ``tiles.moe.experts``; the experts: for one
row a tile): the multiply-add tiles, or MMA tiles of 16 rows (other widths and pipeline depths) or 64
rows with the launch knobs of the profile's rule, or the profile's rule splitting K to a number of
programs an SM (``split_per_sm``); or, for the experts, sets ``tiles.linear.fp4_decode`` or
``tiles.moe.shared_in_launch`` or ``tiles.moe.fused_max_tokens``, for ``linear``
``tiles.linear.fused_max_rows``, or a ``gemv`` rule (``GEMV ...``, :mod:`flashrt.kernels_cuda.gemv`; one
activation row a program, or several: ``gemv_rows``; with ``, round trip``: the activations through their
fp8 round trip by a launch before it, ``gemv_round_trip``), or, for ``linear``, ``MMA GEMV ...`` (the
``gemv_mma`` knob, :mod:`flashrt.kernels_cuda.gemv_mma`: mma.sync with the weight rows as its M);
each ``linear`` case also times ``torch._scaled_mm`` on e4m3 operands with per-tensor scales (the
target's baseline: rows of variant ``torch._scaled_mm (per tensor)``, no output compared); "profile" is
the active profile as it is. Per case and variant: microseconds per call (``flashrt.timing.bench_ms``:
replays from a CUDA graph, each behind an L2 flush), the weight bytes the call must read over the
device-to-device copy bandwidth measured in the same run (its floor), and the largest difference
of the output from the profile's (the variants sum fp32 products in another order).
``--profile-out F.yaml`` writes the active profile with each family's fastest MMA variant as its
first rule, or its fastest GEMV in front of its rules (:func:`fastest_rules`), for an end-to-end
check against the profile.
"""
from __future__ import annotations

import argparse
import dataclasses

import torch

from flashrt import formats, ops, profiles
import flashrt
from flashrt.bench.gemm import scaled_mm_timing
from flashrt.graphs.config import shipped_config
from flashrt.kernels_cuda import linear, linear_plain, moe
from flashrt.timing import bench_ms
from real_slice import copy_bandwidth, nbytes
from results_io import profile_copy, write_json


def fma(block_m: int, block_n: int, block_k: int, warps: int = 4, stages: int = 3, **knobs) -> dict:
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
                split_min_blocks=knobs.pop("split_min_blocks", 1), **knobs)


# label -> tile (BLOCK_M: the case's)
VARIANTS = {
    "N32 K128": dict(block_n=32, block_k=128),
    "N32 K256": dict(block_n=32, block_k=256),
    "N64 K128": dict(block_n=64, block_k=128),
    "N32 K256, 8 warps": dict(block_n=32, block_k=256, warps=8),
    "N64 K256, 8 warps": dict(block_n=64, block_k=256, warps=8),
    "N32 K128, splits of 2 blocks": dict(block_n=32, block_k=128, split_min_blocks=2),
}
# label -> MMA tiles for the decode rows (the launch knobs: the profile rule's): 16-row tiles of other
# widths and pipeline depths, which keep more weight bytes in flight a program; 64-row tiles, whose
# fp8 operands go to Hopper's fp8 warpgroup MMA where the 16-row tiles' are widened to fp16 first
MMA_VARIANTS = {("MMA " if m == 16 else f"MMA M{m} ") + f"N{n} K{k} s{st}" + (f", {w} warps" if w != 4 else ""):
                dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=st)
                for m, n, k, st, w in ((16, 128, 64, 3, 4), (16, 128, 64, 4, 4), (16, 128, 64, 5, 4),
                                       (16, 128, 64, 6, 4), (16, 128, 128, 3, 4), (16, 128, 128, 4, 4),
                                       (16, 64, 128, 4, 4), (16, 64, 128, 5, 4), (16, 64, 64, 6, 4),
                                       (16, 256, 64, 3, 8), (16, 128, 64, 4, 8), (16, 64, 64, 3, 4),
                                       (16, 64, 64, 2, 4), (16, 64, 128, 3, 4), (16, 128, 64, 2, 4),
                                       (64, 64, 128, 3, 4), (64, 64, 128, 4, 4), (64, 64, 256, 3, 4),
                                       (64, 128, 64, 3, 4))}
# label -> launch knobs set on the profile's rule for the case's rows: K split to bring the programs
# nearest to that many an SM, also where the output tiles fill the SMs once (``split_per_sm``)
SPLIT_VARIANTS = {f"profile, split to {p} programs an SM": {"split_per_sm": p} for p in (3, 4, 6, 8)}
# label -> the fp8 and plain-weight linear cases' rule as a GEMV (the ``gemv`` knob, kernels_cuda/gemv.py:
# one row and BLOCK_N weight rows a program, multiply-adds on the CUDA cores; BLOCK_M unused), K split
# to fill the SMs
GEMV_VARIANTS = {f"GEMV N{n} K{k} s{st}" + (f", {w} warps" if w != 4 else "") + (f", {p} programs an SM" if p else ""):
                 dict(BLOCK_M=16, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=st, split_min_blocks=1, gemv=True,
                      **({"split_per_sm": p} if p else {}))
                 for n, k, st, w, p in ((32, 256, 3, 4, None), (32, 512, 3, 4, None), (64, 256, 3, 4, None),
                                        (128, 128, 3, 4, None), (128, 128, 4, 4, None), (128, 256, 3, 8, None),
                                        (64, 256, 3, 4, 4), (128, 128, 3, 4, 4), (32, 256, 3, 4, 6))}
# the same with several activation rows a program (the ``gemv_rows`` knob: a weight block loaded and converted
# once for them)
GEMV_VARIANTS.update({f"GEMV N{n} K{k} s3, {r} rows a program": dict(BLOCK_M=16, BLOCK_N=n, BLOCK_K=k, num_warps=4,
                                                                      num_stages=3, split_min_blocks=1, gemv=True,
                                                                      gemv_rows=r)
                      for n, k, r in ((64, 256, 2), (64, 256, 4), (32, 256, 4), (64, 128, 4))})
# the same with the activations through their fp8 round trip by one launch before the GEMV (the
# ``gemv_round_trip`` knob: every program loads their values instead of quantizing its rows again)
GEMV_VARIANTS.update({label + ", round trip": dict(GEMV_VARIANTS[label], gemv_round_trip=True)
                      for label in ("GEMV N64 K256 s3", "GEMV N64 K256 s3, 2 rows a program",
                                    "GEMV N64 K256 s3, 4 rows a program", "GEMV N32 K256 s3, 4 rows a program")})
# label -> the fp8 linear cases' rule on mma.sync with the weight rows as its M (the ``gemv_mma`` knob,
# kernels_cuda/gemv_mma.py: num_warps x 16 weight rows a program, KW K elements a thread's operand
# register run, the K split aiming at that many programs an SM, the ring's slots and K slices a slot)
MMA_GEMV_VARIANTS = {f"MMA GEMV, {w} warps, kw {kw}, {p} an SM" + (f", {st} stages" if st != 4 else "")
                     + (f", {sub} slices a slot" if sub != 4 else ""):
                     dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=w, num_stages=3, gemv_mma=True,
                          gemv_mma_kw=kw, gemv_mma_per_sm=p, gemv_mma_stages=st, gemv_mma_sub=sub)
                     for w, kw, p, st, sub in ((4, 8, 4, 3, 4), (4, 8, 4, 4, 4), (2, 8, 4, 3, 4), (4, 8, 3, 3, 4),
                                               (1, 8, 8, 3, 4), (4, 8, 4, 3, 2))}
# the same over the activations' fp8 round trip by a launch before (the ``gemv_mma_dq`` knob: bf16 operands,
# no quantization in the K loop, up to 64 rows)
DQ_GEMV_VARIANTS = {f"MMA GEMV dq, {w} warps, {p} an SM": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=w,
                                                             num_stages=3, gemv_mma=True, gemv_mma_dq=True,
                                                             gemv_mma_kw=8, gemv_mma_per_sm=p, gemv_mma_stages=3)
                    for w, p in ((4, 4), (4, 8), (8, 2), (2, 8))}
MMA_GEMV_VARIANTS.update(DQ_GEMV_VARIANTS)
# the same on Hopper's fp8 warpgroup MMA, both operands streamed, K split to that many programs an SM (the linear
# rule's ``qgmma`` and ``qgmma_per_sm`` knobs, kernels_cuda/linear_qgmma.py: 16 x warps weight rows and up to 64
# activation rows a program, the activations' fp8 codes by a launch before it)
# (two token groups: the 8 warps as two warpgroups side by side over the tokens of one 64-row weight tile)
QGMMA_DECODE_VARIANTS = {f"qgmma, {w} warps, {p} an SM, {st} stages" + (", one MMA in flight" if fl == 1 else "")
                         + (f", {t} rows a program" if t != 64 else "") + (f", {r} registers" if r else "")
                         + (", two token groups" if g == 2 else ""):
                         dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3, qgmma=True,
                              qgmma_tokens=t, qgmma_warps=w, qgmma_stages=st, qgmma_inflight=fl, qgmma_per_sm=p,
                              qgmma_maxnreg=r, qgmma_token_groups=g)
                         for w, p, st, fl, t, r, g in (
                             (4, 2, 3, 2, 64, None, 1), (4, 3, 3, 2, 64, None, 1), (4, 4, 3, 2, 64, None, 1),
                             (4, 2, 4, 2, 64, None, 1), (8, 1, 3, 2, 64, None, 1), (8, 2, 3, 2, 64, None, 1),
                             (4, 3, 3, 1, 64, None, 1), (4, 3, 3, 2, 64, 168, 1), (4, 4, 3, 2, 32, None, 1),
                             (4, 3, 3, 2, 32, None, 1), (8, 2, 3, 2, 64, None, 2), (8, 3, 3, 2, 64, None, 2),
                             (8, 2, 4, 2, 64, None, 2))}
MMA_GEMV_VARIANTS.update(QGMMA_DECODE_VARIANTS)
# label -> the experts cases' rule on mma.sync with the weight rows as its M (the experts' ``gemv_mma`` knob,
# kernels_cuda/moe_mma.py: fp4_w words only, so with --expert-words; num_warps x 16 weight rows a program,
# the K split aiming at that many programs an SM, the ring's slots and K slices a slot)
EXPERT_MMA_VARIANTS = {f"experts MMA GEMV, {w} warps, {p} an SM, {st} stages"
                       + (f", {sub} slices a slot" if sub != 4 else ""):
                       dict(num_warps=w, gemv_mma=True, gemv_mma_per_sm=p, gemv_mma_stages=st, gemv_mma_sub=sub)
                       for w, p, st, sub in ((4, 4, 3, 4), (4, 8, 3, 4), (4, 4, 4, 4), (2, 8, 3, 4), (4, 4, 3, 2),
                                             (8, 2, 3, 4))}
SCALED_MM = "torch._scaled_mm (per tensor)"  # the baseline of the linear cases: e4m3 x and w, rows padded to 16
# label -> {family: tiles entries}, the profile's rules kept: the linear cases only
LINEAR_VARIANTS = {"profile, activations quantized apart": {"linear": {"fused_max_rows": 0}},
                   "profile, fp8 weights dequantized (no fp8 MMA)": {"linear": {"fp8_mma": False}}}
# label -> {family: tiles entries}, the profile's rules kept: the experts cases only
EXPERT_VARIANTS = {"profile, fp4 through tl.dot_scaled": {"linear": {"fp4_decode": "dot_scaled"}},
                   "profile, fp4 decoded packed": {"linear": {"fp4_decode": "packed"}},
                   "profile, fp4 scales loaded a block ahead": {"linear": {"fp4_decode": "packed_prefetch"}},
                   "profile, fp4 re-bias folded into the scales": {"linear": {"fp4_scale_fold": True}},
                   "profile, fp4 decoded bit by bit": {"linear": {"fp4_decode": "bits"}},
                   "profile, shared expert in its own launches": {"moe": {"shared_in_launch": False}},
                   "profile, activations quantized apart": {"moe": {"fused_max_tokens": 0}},
                   "profile, activations dequantized": {"moe": {"act_dequantized": True}},
                   "profile, activations dequantized, re-bias folded": {"moe": {"act_dequantized": True},
                                                                         "linear": {"fp4_scale_fold": True}},
                   "profile, fp4 halves order": {"linear": {"fp4_halves": True}},
                   "profile, fp8 shared expert packed": {"linear": {"fp8_packed": True}},
                   "profile, fp4 halves order, fp8 packed": {"linear": {"fp4_halves": True, "fp8_packed": True}}}


# a family's active rules (defaults merged) and launch knobs
TILES_OF = {"linear": linear._tiles, "moe": moe._tiles, "linear_plain": linear_plain.PLANS.tiles}
KNOBS_OF = {"linear": linear.KNOBS, "moe": moe.KNOBS, "linear_plain": linear_plain.KNOBS}


def with_rule(family: str, entry: str, rows: int, tile: dict | None, extra: dict | None = None):
    """The active profile with ``[rows, tile]`` in front of ``tiles.<family>.<entry>``'s rules (None:
    its rules as they are) and ``extra`` ({family: entries}) merged into its ``tiles``."""
    base = profiles.active_profile()
    merged = {k: dict(v) for k, v in base.tiles.items()}
    if tile is not None:
        rules = TILES_OF[family]()[entry]
        merged.setdefault(family, {})[entry] = [[rows, tile]] + [list(r) for r in rules]
    for fam, entries in (extra or {}).items():
        merged.setdefault(fam, {}).update(entries)
    return profiles.using(dataclasses.replace(base, tiles=merged))


def mma(family: str, entry: str, rows: int, tile: dict) -> dict:
    """``tile`` with the launch knobs of the active rule serving ``rows``."""
    rule = linear.pick_tile(TILES_OF[family]()[entry], rows)
    return {**{k: rule[k] for k in KNOBS_OF[family] if k in rule}, **tile}


def tweaked(family: str, entry: str, rows: int, knobs: dict) -> dict:
    """The active rule serving ``rows`` (tile and launch knobs) with ``knobs`` set."""
    return {**linear.pick_tile(TILES_OF[family]()[entry], rows), **knobs}


def baseline_operands(call) -> tuple:
    """(x, w) of a linear case's call (its default arguments)."""
    return call.__defaults__


def linear_cases(cfg, dev, g, row_counts=(1, 4)):
    """(name, rows, rule limit, BLOCK_M, family, entry, call, weight bytes) of the fp8_w projections."""
    shapes = {"wq_a + wkv": (cfg.q_lora_rank + cfg.head_dim, cfg.dim),
              "wq_b": (cfg.n_heads * cfg.head_dim, cfg.q_lora_rank), "wo_b": (cfg.dim, cfg.o_groups * cfg.o_lora_rank)}
    for name, (n, k) in shapes.items():
        w = formats.quantize(torch.randn(n, k, generator=g) * 0.05, "fp8_w").to(dev)
        for m in row_counts:
            x = torch.randn(m, k, generator=g).to(dev, torch.bfloat16)
            yield f"linear {name} {n}x{k}", m, m, m, "linear", "linear", (lambda x=x, w=w: ops.linear(x, w)), nbytes(w)


def plain_cases(cfg, dev, g, row_counts=(1, 4)):
    """(name, rows, rule limit, BLOCK_M, family, entry, call, weight bytes) of plain bf16 weights at
    decode: the head (fp32 x), the output groups (``grouped_linear``) and the indexer's query
    projection (bf16 x)."""
    G, gd = cfg.o_groups, torch.Generator(device=dev).manual_seed(0)  # the head's 662M weights made on the device
    shapes = {"head": (cfg.vocab_size, cfg.dim, 1, torch.float32),
              "wo_a (grouped)": (G * cfg.o_lora_rank, cfg.n_heads * cfg.head_dim // G, G, torch.bfloat16),
              "indexer wq_b": (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank, 1, torch.bfloat16)}
    for name, (n, k, groups, xdt) in shapes.items():
        w = (torch.randn(n, k, generator=gd, device=dev) * k ** -0.5).to(torch.bfloat16)
        for m in row_counts:
            if groups > 1:
                x = torch.randn(m, groups, k, generator=g).to(dev, xdt)
                call = (lambda x=x, w=w: ops.grouped_linear(x, w))
            else:
                x = torch.randn(m, k, generator=g).to(dev, xdt)
                call = (lambda x=x, w=w: ops.linear(x, w))
            yield f"plain {name} {n}x{k}", m, m, m, "linear_plain", "plain", call, nbytes(w)


def random_experts(cfg, dev, scales_k_major: bool = False, words: bool = False):
    """The routed experts' w1, w3, w2 of ``cfg`` as random fp4 bytes (every code; scale bytes 119-122),
    seeded on ``dev``, laid out as the model's load lays them out (``formats.as_expert_stack``: the
    largest scale byte recorded; ``scales_k_major``: the scales stored K major; ``words``: the codes in
    the E2M1 word layout)."""
    E, D, I = cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim
    gen = torch.Generator(device=dev).manual_seed(0)

    def fp4(*shape):
        data = torch.randint(0, 256, (*shape[:-1], shape[-1] // 2), dtype=torch.uint8, device=dev, generator=gen)
        scale = torch.randint(119, 123, (*shape[:-1], shape[-1] // 32), dtype=torch.uint8, device=dev, generator=gen)
        return formats.as_expert_stack(formats.QTensor(data, scale.view(torch.float8_e8m0fnu), "fp4_w", shape),
                                       scales_k_major, words)

    return fp4(E, I, D), fp4(E, I, D), fp4(E, D, I)


def random_shared(cfg, dev, g, scales_k_major: bool = False):
    """The shared expert's w1, w3 [1, I, D] and w2 [1, D, I] in fp8_w, laid out as the model's load lays them
    out (``formats.as_expert_stack``: the largest scale byte recorded, which the packed fp8 decodes' fold and
    ``gemv_mma``'s shared rows read; ``scales_k_major`` as the routed experts')."""
    D, I = cfg.dim, cfg.moe_inter_dim
    return tuple(formats.as_expert_stack(formats.quantize(torch.randn(1, *s, generator=g) * 0.05, "fp8_w").to(dev),
                                         scales_k_major) for s in ((I, D), (I, D), (D, I)))


def expert_cases(cfg, dev, g, scales_k_major: bool = False, words: bool = False):
    """moe_experts at 1 and 8 tokens (the routed experts: :func:`random_experts`); one-row tiles
    (pairs mode at 1 token; at 8, routing-table tiles of about one row an expert)."""
    E, k, D, I = cfg.n_routed_experts, cfg.n_activated_experts, cfg.dim, cfg.moe_inter_dim
    w1, w3, w2 = random_experts(cfg, dev, scales_k_major, words)
    shared = random_shared(cfg, dev, g, scales_k_major)
    per_expert = sum(nbytes(w) for w in (w1, w3, w2)) / E
    for n in (1, 8):
        x = torch.randn(n, D, generator=g).to(dev, torch.bfloat16)
        idx = torch.rand(n, E, generator=g).topk(k).indices.to(dev, torch.int32)
        rw = torch.rand(n, k, generator=g).to(dev)
        touched = len(torch.unique(idx))
        call = (lambda x=x, idx=idx, rw=rw: ops.moe_experts(x, rw, idx, w1, w3, w2, 10.0, None, torch.bfloat16,
                                                            shared))
        yield (f"moe_experts E{E} top{k} {D}x{I} + shared" + (", scales K major" if scales_k_major else "")
               + (", fp4 words" if words else ""), n, 1, 1, "moe", "experts", call,
               touched * per_expert + sum(nbytes(w) for w in shared))


def fastest_rules(rows: list[dict], margin: float = 0.97) -> dict:
    """(family, entry) -> (tile, rows or None) of the variant with the least time summed over that family's
    cases (every case timed), where it is under ``margin`` times the profile's sum. An MMA variant replaces
    the first rule's tile (None). A GEMV variant (the linears') goes in front of the rules for up to a row
    count of its own: the one, with the GEMV, that gives the least sum when the profile serves the cases with
    more rows."""
    out = {}
    for family, entry, prefix in (("linear", "linear", "linear"), ("moe", "experts", "moe_experts"),
                                  ("linear_plain", "plain", "plain")):
        mine = [r for r in rows if r["case"].startswith(prefix) and "us_per_call" in r]
        cases = {(r["case"], r["rows"]) for r in mine}
        total = {}
        for r in mine:
            if r["variant"] == "profile" or r["variant"] in MMA_VARIANTS or r["variant"] in GEMV_VARIANTS:
                total.setdefault(r["variant"], {})[(r["case"], r["rows"])] = r
        if not cases or set(total.get("profile", {})) != cases:
            continue
        profile = total["profile"]
        sums = {}  # (variant, row limit or None) -> time of every case
        for v, got in total.items():
            if set(got) != cases or v == "profile":
                continue
            if v in GEMV_VARIANTS:
                for limit in sorted({m for _, m in cases}):
                    sums[(v, limit)] = sum((got if m <= limit else profile)[(c, m)]["us_per_call"] for c, m in cases)
            else:
                sums[(v, None)] = sum(r["us_per_call"] for r in got.values())
        whole = sum(r["us_per_call"] for r in profile.values())
        best = min(sums, key=sums.get, default=None)
        if best is not None and sums[best] < margin * whole:
            out[(family, entry)] = (dict(next(iter(total[best[0]].values()))["tile"]), best[1])
            upto = "" if best[1] is None else f" up to {best[1]} rows"
            print(f"{family}.{entry}: {best[0]}{upto} {sums[best]:.1f} us against the profile's {whole:.1f} us")
    return out


def write_profile(path: str, rules: dict) -> None:
    """A copy of the active profile's file named for ``path``, each of ``rules`` as the tile of its
    entry's first rule (its row limit kept), or (a row limit given) a rule of its own in front, in
    place of the rules for no more rows than it serves."""
    def edit(data):
        for (family, entry), (tile, limit) in rules.items():
            if limit is None:
                data["tiles"][family][entry][0][1] = tile
            else:  # the rules it covers whole (a limit of at most its own) give way to it
                kept = [r for r in data["tiles"][family][entry] if r[0] is None or r[0] > limit]
                data["tiles"][family][entry] = [[limit, tile]] + kept

    profile_copy(path, edit)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="v4.1-flash")
    ap.add_argument("--variants", nargs="+", default=None, metavar="LABEL",
                    help="only these variants (and the profile's tiles); default: all")
    ap.add_argument("--scales-k-major", action="store_true",
                    help="also time the expert cases with their scales stored K major")
    ap.add_argument("--expert-words", action="store_true",
                    help="also time the expert cases with their scales K major and their codes in words")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4],
                    help="the activation rows of the linear and plain-weight cases (default: 1 4)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile-out", default=None, metavar="FILE.yaml",
                    help="write a copy of the active profile with the fastest MMA (or GEMV) variant of each family "
                         "(summed over its cases, at least 3%% under the profile's) as its first rule")
    args = ap.parse_args()
    if args.profile_out and not args.profile_out.endswith(".yaml"):
        ap.error(f"--profile-out: expected a FILE.yaml, got {args.profile_out!r}")
    if not torch.cuda.is_available():
        ap.error("a CUDA device is needed")
    cfg, dev, g = shipped_config(args.model), torch.device("cuda"), torch.Generator().manual_seed(0)
    bw = copy_bandwidth(dev)
    rows = []
    with flashrt.use_backend("cuda"), flashrt.value_checks(False):
        for name, m, limit, block_m, family, entry, call, weight_bytes in [*linear_cases(cfg, dev, g, args.rows),
                                                                           *plain_cases(cfg, dev, g, args.rows),
                                                                           *expert_cases(cfg, dev, g),
                                                                           *(expert_cases(cfg, dev, g, True)
                                                                             if args.scales_k_major else ()),
                                                                           *(expert_cases(cfg, dev, g, True, True)
                                                                             if args.expert_words else ())]:
            floor_us = weight_bytes / bw * 1e6
            first = None
            fmas = VARIANTS if family != "linear_plain" else {}  # the plain kernel has no multiply-add loop
            variants = {"profile": (None, None), **{k: (fma(block_m, **v), None) for k, v in fmas.items()},
                        **{k: (mma(family, entry, limit, v), None) for k, v in MMA_VARIANTS.items()},
                        **{k: (tweaked(family, entry, limit, v), None) for k, v in SPLIT_VARIANTS.items()}}
            variants.update({k: (None, v) for k, v in {"moe": EXPERT_VARIANTS, "linear": LINEAR_VARIANTS}.get(
                family, {}).items()})
            if family in ("linear", "linear_plain"):
                variants.update({k: (v, None) for k, v in GEMV_VARIANTS.items()  # the round trip: fp8 activations only
                                 if family == "linear" or not v.get("gemv_round_trip")})
            if family == "moe":
                variants.update({k: (tweaked(family, entry, limit, v), None) for k, v in EXPERT_MMA_VARIANTS.items()})
            if family == "linear":
                variants.update({k: (v, None) for k, v in MMA_GEMV_VARIANTS.items()})
                us = 1e3 * scaled_mm_timing(*baseline_operands(call)).ms
                rows.append({"case": name, "rows": m, "variant": SCALED_MM, "us_per_call": us, "floor_us": floor_us,
                             "of_floor": floor_us / us})
                print(f"{name:44s} m={m:2d} {SCALED_MM:30s} {us:8.2f} us", flush=True)
            for label, (tile, extra) in variants.items():
                if args.variants and label != "profile" and label not in args.variants:
                    continue
                with with_rule(family, entry, limit, tile, extra):
                    profiles._TILES_CACHE.clear()
                    try:
                        out = call()
                        t = bench_ms(call)
                    except Exception as e:  # a tile that does not compile or fit: recorded, not fatal
                        error = f"{type(e).__name__}: {e}"[:300]
                        rows.append({"case": name, "rows": m, "variant": label, "error": error})
                        print(f"{name:44s} m={m:2d} {label:30s} failed: {rows[-1]['error'][:80]}", flush=True)
                        continue
                first = out.clone() if first is None else first
                us = 1e3 * t.ms
                rows.append({"case": name, "rows": m, "variant": label, "tile": tile, "tiles": extra,
                             "us_per_call": us,
                             "floor_us": floor_us, "of_floor": floor_us / us,
                             "timing": "graph" if t.graph is not None else "plain",
                             "max_abs_diff_from_profile": float((out.float() - first.float()).abs().max())})
                print(f"{name:44s} m={m:2d} {label:30s} {us:8.2f} us  floor {floor_us:7.2f} us "
                      f"({100 * floor_us / us:5.1f}%)  diff {rows[-1]['max_abs_diff_from_profile']:.3g}", flush=True)
    profiles._TILES_CACHE.clear()
    write_json(args.out, {"model": args.model, "device": torch.cuda.get_device_name(), "copy_bytes_per_s": bw,
                          "rows": rows})
    if args.profile_out:
        write_profile(args.profile_out, fastest_rules(rows))


if __name__ == "__main__":
    main()
