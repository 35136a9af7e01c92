"""The bf16 warpgroup MMA's rate by tile shape on this GPU: how fast ``wgmma`` runs at the narrow N and the
operand placements the sparse attention's MMAs use, against the dense bf16 GEMM measured in the same run.

    python benchmarks/wgmma_rate.py --out F [--cases NAME ...]

One program an SM, each a loop of MMAs over operands that stay in shared memory (or A in registers), the
accumulator waited for every trip as the attention waits for each K block's product. A case is
``(warpgroups over M, warpgroups over N, N, K, A in registers)``: with two warpgroups over N they share A
and each takes half of N (the attention's score MMA of ``tiles.attention.ws``, the block's rows split
between the warpgroups); over M each has its own 64 rows of A and both read all of B (the traffic of the
split scores, each warpgroup half of D); the value MMA takes A (the probabilities) from registers. Each row
gives the time a trip, the rate against the bf16 GEMM's and the shared-memory bytes a trip (A and B as
each warpgroup's MMAs read them) over the time.
"""
from __future__ import annotations

import argparse

import torch

from flashrt.bench.common import Ceilings, bench_ms
from results_io import write_json

# name: (warpgroups stacked over M, warpgroups side by side over N, N of the whole tile, K a trip, A in registers,
# B stored [K, N] as the attention's rows are for the value MMA, else [N, K])
CASES = {
    "score, default ws (2 WG over N, N 32, K 512)": (1, 2, 32, 512, False),
    "score, split scores (2 WG over M, N 32, K 256)": (2, 1, 32, 256, False),
    "score, 64-row blocks (2 WG over N, N 64, K 512)": (1, 2, 64, 512, False),
    "score, 64-row blocks split (2 WG over M, N 64, K 256)": (2, 1, 64, 256, False),
    "score, one WG (N 16, K 512)": (1, 1, 16, 512, False),
    "score, one WG (N 32, K 512)": (1, 1, 32, 512, False),
    "score, one WG (N 64, K 512)": (1, 1, 64, 512, False),
    "score, one WG, A in registers (N 32, K 256)": (1, 1, 32, 256, True),
    "value (2 WG over N, N 512, K 32, A in registers)": (1, 2, 512, 32, True, True),
    "value, 64-row blocks (2 WG over N, N 512, K 64, A in registers)": (1, 2, 512, 64, True, True),
    "value, B stored [N, K] (2 WG over N, N 512, K 32, A in registers)": (1, 2, 512, 32, True),
    "GEMM-like (2 WG over M, N 256, K 64)": (2, 1, 256, 64, False),
}

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    @gluon.jit
    def _rate_kernel(a_ptr, b_ptr, out_ptr, iters, WGM: gl.constexpr, WGN: gl.constexpr, N: gl.constexpr,
                     K: gl.constexpr, A_REGS: gl.constexpr, B_KN: gl.constexpr, num_warps: gl.constexpr):
        """``iters`` trips of ``acc += A @ B.T`` (A [64 * WGM, K], B [N, K], bf16 in shared memory; B_KN: B
        stored transposed, [K, N]), each waited for; the accumulator's sum to ``out[program]`` so nothing is
        optimized away."""
        M: gl.constexpr = 64 * WGM
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4 * WGM, WGN],
                                                        instr_shape=[16, N // WGN, 16])
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        rm = gl.arange(0, M, gl.SliceLayout(1, ld))
        rn = gl.arange(0, N, gl.SliceLayout(1, ld))
        ck = gl.arange(0, K, gl.SliceLayout(0, ld))
        a_smem = gl.allocate_shared_memory(gl.bfloat16, [M, K],
                                           gl.NVMMASharedLayout.get_default_for([M, K], gl.bfloat16),
                                           gl.load(a_ptr + rm[:, None] * K + ck[None, :]))
        if B_KN:
            rk = gl.arange(0, K, gl.SliceLayout(1, ld))
            cn = gl.arange(0, N, gl.SliceLayout(0, ld))
            b_kn = gl.allocate_shared_memory(gl.bfloat16, [K, N],
                                             gl.NVMMASharedLayout.get_default_for([K, N], gl.bfloat16),
                                             gl.load(b_ptr + cn[None, :] * K + rk[:, None]))
        else:
            b_smem = gl.allocate_shared_memory(gl.bfloat16, [N, K],
                                               gl.NVMMASharedLayout.get_default_for([N, K], gl.bfloat16),
                                               gl.load(b_ptr + rn[:, None] * K + ck[None, :]))
            b_kn = b_smem.permute((1, 0))
        fence_async_shared()
        gl.thread_barrier()
        acc = gl.zeros([M, N], gl.float32, acc_l)
        if A_REGS:
            a = a_smem.load(gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2))
        else:
            a = a_smem
        for _ in range(iters):
            acc = warpgroup_mma(a, b_kn, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.store(out_ptr + gl.program_id(0), gl.sum(gl.sum(acc, axis=1), axis=0))

    AVAILABLE = True
except (ImportError, AttributeError):
    AVAILABLE = False


def iters_for(M: int, N: int, K: int) -> int:
    """Trips that keep a program busy about a millisecond at the MMA's full rate (~1,000 MACs a clock a
    warpgroup), at least 64."""
    return max(64, int(2e9 // (M * N * K)))


def run_case(name: str, spec: tuple, ceil: Ceilings, sms: int) -> dict:
    wgm, wgn, n, k, a_regs, b_kn = (*spec, False)[:6]
    m = 64 * wgm
    a = torch.randn(m, k, device="cuda").to(torch.bfloat16) * 0.05
    b = torch.randn(n, k, device="cuda").to(torch.bfloat16) * 0.05
    out = torch.empty(sms, device="cuda")
    iters = iters_for(m, n, k)

    def launch():
        _rate_kernel[(sms,)](a, b, out, iters, wgm, wgn, n, k, a_regs, b_kn, num_warps=4 * wgm * wgn)

    launch()
    torch.cuda.synchronize()
    want = (a.float() @ b.float().t()).sum() * iters
    got = out[0].item()
    ms = bench_ms(launch, warmup=3, rep=20, graph=False).plain
    flops = 2.0 * m * n * k * iters * sms
    # shared bytes a trip: each warpgroup reads its A rows (or all of A when they share it, none from
    # registers) and its columns of B
    a_bytes = 0 if a_regs else wgm * wgn * 64 * k * 2
    b_bytes = wgm * n * k * 2
    trip_s = ms * 1e-3 / iters
    return {"case": name, "warpgroups_m": wgm, "warpgroups_n": wgn, "N": n, "K": k, "a_in_registers": a_regs,
            "b_stored_k_by_n": b_kn,
            "hgmma_a_trip_a_warpgroup": k // 16, "iters": iters, "ms": ms, "trip_ns": trip_s * 1e9,
            "tflops": flops / (ms * 1e-3) / 1e12, "of_bf16_gemm": flops / (ms * 1e-3) / ceil.bf16_flops,
            "shared_bytes_a_trip": a_bytes + b_bytes,
            "shared_bytes_per_ns_an_sm": (a_bytes + b_bytes) / (trip_s * 1e9),
            "sum_rel_err": abs(got - want.item()) / max(abs(want.item()), 1e-6)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the rows here (JSON)")
    ap.add_argument("--cases", nargs="*", default=None, help=f"a subset of: {', '.join(CASES)}")
    args = ap.parse_args()
    unknown = [c for c in args.cases or () if c not in CASES]
    if unknown:
        ap.error(f"--cases: expected names among {sorted(CASES)}, got {unknown}")
    if not (torch.cuda.is_available() and AVAILABLE):
        raise SystemExit("wgmma_rate: needs an sm_90 GPU (compute capability 9.0) and a Triton with Gluon")
    if torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit(f"wgmma_rate: expected an sm_90 GPU, got {torch.cuda.get_device_name()}")
    ceil = Ceilings.measure()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for name in args.cases or CASES:
        r = run_case(name, CASES[name], ceil, sms)
        rows.append(r)
        print(f"{name:62s} {r['trip_ns']:8.1f} ns a trip  {r['tflops']:6.1f} TFLOPS  {100 * r['of_bf16_gemm']:5.1f}% "
              f"of the GEMM  {r['shared_bytes_per_ns_an_sm']:6.1f} B/ns shared  (sum rel err {r['sum_rel_err']:.1e})")
    write_json(args.out, {"device": torch.cuda.get_device_name(), "sms": sms, "bf16_gemm_flops": ceil.bf16_flops,
                          "rows": rows})


if __name__ == "__main__":
    main()
