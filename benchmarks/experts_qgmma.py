"""The routed experts on the fp8 warpgroup MMA with the weights as its register operand at the released
shapes: its two GEMMs alone (kernels_cuda/experts_qgmma.py) and the whole ``moe_experts`` call under the
experts rule's ``qgmma`` knob (kernels_cuda/moe_qgmma.py), against the active profile's call and the
weight-read floor, in one run.

    python benchmarks/experts_qgmma.py [--tokens 1 8] [--splits 512 1024 ...] [--out FILE.json]

Per token count (each token routed to 6 of 384 experts; one tile of up to 8 tokens an expert): the
up GEMM (W1 and W3 as one [2I, D] matrix an expert) and the down GEMM ([D, I]) under each K split
and with the weights loaded where used or through a ring of 4 trips,
their device time a call (graph replays behind an L2 flush, ``moe_kernels.kernel_times``), and the
routed weights' bytes (codes and scales) over the copy bandwidth of the same run: the floor. The
profile's ``moe_experts`` (routed and fp8 shared experts, SwiGLU, combine) at the same routing over the
experts' codes in words, which ``qgmma`` does not take (so the 16-row tile's path, the profile's before
it took ``qgmma``), with its own floor (the routed and shared bytes), then the same call with the
profile's decode rule taking ``qgmma`` (ring ``--qgmma-stages``) over the same codes in the standard
nibbles (scales as the profile stores them), its output's relative difference from the words' call. The
GEMMs' partials are checked against float64 products of the codes' values first.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gemv_tiles  # noqa: E402
from moe_kernels import kernel_times  # noqa: E402
from real_slice import copy_bandwidth, nbytes  # noqa: E402
from results_io import write_json  # noqa: E402

import flashrt  # noqa: E402
from flashrt import formats, ops, profiles  # noqa: E402
from flashrt.graphs.config import shipped_config  # noqa: E402
from flashrt.kernels_cuda import experts_qgmma as q  # noqa: E402


def random_packed(E: int, N: int, K: int, dev, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Random fp4_w bytes (every code) and UE8M0 scale bytes 119-122."""
    data = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device=dev, generator=gen)
    scale = torch.randint(119, 123, (E, N, K // 32), dtype=torch.uint8, device=dev, generator=gen)
    return data, scale


def tiles_for(idx: torch.Tensor, pairs: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile_e, tile_tok [tiles, 8]) of a routing: one tile an expert, its tokens (``pairs``: its pair rows)."""
    n, k = idx.shape
    tile_e, tile_tok = [], []
    for e in torch.unique(idx).tolist():
        tok, slot = (idx == e).nonzero(as_tuple=True)
        rows = (tok * k + slot) if pairs else tok
        tile_e.append(e)
        tile_tok.append(rows.tolist() + [-1] * (8 - len(rows)))
    return (torch.tensor(tile_e, dtype=torch.int32, device=idx.device),
            torch.tensor(tile_tok, dtype=torch.int32, device=idx.device))


def dividing(split: int, K: int) -> int:
    """The largest multiple of 128 at most ``split`` that divides ``K`` (at least 128)."""
    s = max(128, min(split, K) // 128 * 128)
    while K % s:
        s -= 128
    return s


def check(dev, gen) -> float:
    """Largest relative error of the GEMM's summed partials against float64 products, on random codes."""
    E, N, K, T = 3, 128, 1024, 9
    codes = torch.randint(0, 16, (E, N, K), dtype=torch.uint8, generator=gen)
    sb = torch.randint(119, 123, (E, N, K // 32), dtype=torch.uint8, generator=gen)
    x = torch.randn(T, K, generator=gen).to(torch.float8_e4m3fn)
    xe = torch.randint(-4, 4, (T, K // 32), generator=gen).double()
    mag = torch.tensor(formats.E2M1_VALUES, dtype=torch.float64)[(codes & 7).long()]
    wv = torch.where(codes & 8 > 0, -mag, mag) * torch.pow(2.0, sb.double() - 127).repeat_interleave(32, 2)
    xv = x.double() * torch.pow(2.0, xe).repeat_interleave(32, 1)
    tile_e = torch.tensor([0, 2, 1], dtype=torch.int32)
    tile_tok = torch.randint(-1, T, (3, 8), generator=gen, dtype=torch.int32)
    nibbles = codes[..., 0::2] | (codes[..., 1::2] << 4)
    out = q.experts_gemm(x.to(dev), (torch.pow(2.0, xe) * q.DECODE_SCALE).float().to(dev), nibbles.to(dev),
                         sb.to(dev), tile_e.to(dev), tile_tok.to(dev), 256).sum(0).cpu().double()
    worst = 0.0
    for i in range(3):
        for c in range(8):
            if tile_tok[i, c] >= 0:
                want = wv[tile_e[i]] @ xv[tile_tok[i, c]]
                worst = max(worst, float((out[i, c] - want).norm() / want.norm()))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--splits", type=int, nargs="*", default=[256, 512, 1024, 2560],
                    help="K codes a program (rounded down to a multiple of 128 that divides each GEMM's K)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--qgmma-stages", type=int, nargs="+", default=[4, 0])
    ap.add_argument("--qgmma-per-sm", type=int, nargs="+", default=[16])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0) or not q.AVAILABLE:
        ap.error("an sm_90 CUDA device with Gluon is needed")
    dev, g = torch.device("cuda"), torch.Generator().manual_seed(0)
    gen = torch.Generator(device=dev).manual_seed(0)
    err = check(dev, g)
    print(f"check: largest relative error {err:.3g}")
    cfg = shipped_config("v4.1-flash")
    E, k, D, I = cfg.n_routed_experts, cfg.n_activated_experts, cfg.dim, cfg.moe_inter_dim
    w13, s13 = random_packed(E, 2 * I, D, dev, gen)
    w2, s2 = random_packed(E, D, I, dev, gen)
    per_expert = (w13.numel() + s13.numel() + w2.numel() + s2.numel()) / E
    k_major = profiles.active_profile().expert_scales == "k_major"
    pw1, pw3, pw2 = gemv_tiles.random_experts(cfg, dev, k_major, True)
    nibbles = tuple(formats.with_nibbles(w) for w in (pw1, pw3, pw2))
    shared = gemv_tiles.random_shared(cfg, dev, g, k_major)
    bw = copy_bandwidth(dev)
    rows = []
    for n in args.tokens:
        idx = torch.rand(n, E, generator=g).topk(k).indices.to(dev, torch.int32)
        touched = len(torch.unique(idx))
        floor_us = touched * per_expert / bw * 1e6
        x = torch.randn(n, D, generator=g).to(dev, torch.float8_e4m3fn)
        xs = torch.full((n, D // 32), q.DECODE_SCALE, device=dev)
        h = torch.randn(n * k, I, generator=g).to(dev, torch.float8_e4m3fn)
        hs = torch.full((n * k, I // 32), q.DECODE_SCALE, device=dev)
        te, tt = tiles_for(idx, False)
        _, tp = tiles_for(idx, True)
        for split in args.splits:
            up_split, down_split = dividing(split, D), dividing(split, I)
            for stages in (0, 4):
                def call():
                    q.experts_gemm(x, xs, w13, s13, te, tt, up_split, stages)
                    q.experts_gemm(h, hs, w2, s2, te, tp, down_split, stages)

                times = kernel_times(call, args.calls)
                us = sum(times.values())
                label = f"qgmma up K {up_split}, down K {down_split}, " + (f"ring {stages}" if stages else "direct")
                rows.append({"tokens": n, "variant": label, "us": us, "floor_us": floor_us, "of_floor": floor_us / us,
                             "kernels_us": times, "experts_touched": touched})
                print(f"tokens {n}  {label:44s} {us:8.1f} us  floor {floor_us:6.1f} us  {100 * floor_us / us:5.1f}%",
                      flush=True)
        xb = torch.randn(n, D, generator=g).to(dev, torch.bfloat16)
        rw = torch.rand(n, k, generator=g).to(dev)
        pfloor = (touched * sum(nbytes(w) for w in (pw1, pw3, pw2)) / E + sum(nbytes(w) for w in shared)) / bw * 1e6
        base = None
        for stages, per_sm in [(None, None)] + [(s, p) for s in args.qgmma_stages for p in args.qgmma_per_sm]:
            ws = (pw1, pw3, pw2) if stages is None else nibbles
            tile = None if stages is None else gemv_tiles.tweaked("moe", "experts", 1, {
                "qgmma": True, "qgmma_stages": stages, "qgmma_per_sm": per_sm})
            with gemv_tiles.with_rule("moe", "experts", 1, tile), flashrt.use_backend("cuda"), \
                    flashrt.value_checks(False):
                profiles._TILES_CACHE.clear()
                call = lambda: ops.moe_experts(xb, rw, idx, *ws, 10.0, None, torch.bfloat16, shared)  # noqa: E731
                got = call().float()
                times = kernel_times(call, args.calls)
            base = got if base is None else base
            us = sum(times.values())
            label = ("profile moe_experts in words" if stages is None
                     else f"moe_experts, qgmma ring {stages}, {per_sm} an SM")
            diff = float((got - base).norm() / base.norm())
            rows.append({"tokens": n, "variant": label + " (routed + shared)", "us": us, "floor_us": pfloor,
                         "of_floor": pfloor / us, "kernels_us": times, "experts_touched": touched,
                         "rel_diff_from_profile": diff})
            print(f"tokens {n}  {label + ' (routed + shared)':44s} {us:8.1f} us  floor {pfloor:6.1f} us  "
                  f"{100 * pfloor / us:5.1f}%  diff {diff:.2g}", flush=True)
        profiles._TILES_CACHE.clear()
    write_json(args.out, {"device": torch.cuda.get_device_name(), "copy_bytes_per_s": bw, "check_rel_err": err,
                          "rows": rows})


if __name__ == "__main__":
    main()
