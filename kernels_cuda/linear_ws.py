"""Warp-specialized fp8 GEMM with per-32 block scales for sm_90, written in Gluon: ``linear`` of an
``fp8_w`` weight at many rows (``tiles.linear.ws_gemm``).

``out[m, n] = sum over 32-wide K slices j of (xq[m, j] . w[n, j]) * sx[m, j] * sw[n // 32, j]``: the
activations quantized to E4M3 with a UE8M0 scale per 32 (``linear.act_quant``), the weight's E4M3
bytes with a UE8M0 scale per 32 x 32 tile. Hopper has no block-scaled MMA, so every slice's product
is taken by an fp8 warpgroup MMA of its own into a fresh accumulator and added to the running sum
times its scales (the plain kernel's ``PROMOTE`` path, in the same order of operations).

One program per ``BLOCK_M x BLOCK_N`` output tile (grouped along M, as the plain kernel), two
partitions over a ring of ``STAGES`` slices:

- a **producer** (``PRODUCER_WARPS`` warps) copies each slice's activation and weight rows into the
  ring with asynchronous copies (``cp.async``), ``STAGES - 1`` slices ahead of the one it signals
  ready (an mbarrier);
- the **consumers** (the default partition, 8 warps: two warpgroups of 64 rows) run the slice's MMA,
  wait for it, apply the scales into the fp32 sum, and release the slot; while one warpgroup
  scales, the other's MMA can run (``OVERLAP``: its own next MMA too).

The interpreter does not run Gluon: the launcher (:mod:`.linear`) takes this kernel only on an sm_90
device, where the tile enables it.
"""
from __future__ import annotations

from flashrt.kernels_cuda.attention_ws import AVAILABLE
from flashrt.kernels_cuda.codecs import e8m0_to_f32

if AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    from flashrt.kernels_cuda.attention_ws import _async_load, _sync

    @gluon.jit
    def _copy_tile(dst, base, rows, n_rows, stride, k0, K, NW: gl.constexpr):
        """Start the asynchronous copy of bytes ``[k0, k0 + 32)`` of rows ``rows`` (< ``n_rows``) of a
        row-major byte matrix into ``dst`` [len(rows), 32]; rows or columns past the ends are zeros."""
        R: gl.constexpr = dst.shape[0]
        L: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [NW, 1], [1, 0])
        r = rows + gl.arange(0, R, gl.SliceLayout(1, L))
        c = k0 + gl.arange(0, 32, gl.SliceLayout(0, L))
        _async_load(dst, base + r.to(gl.int64)[:, None] * stride + c[None, :],
                    mask=(r < n_rows)[:, None] & (c < K)[None, :])

    @gluon.jit
    def _gemm_producer(a_bufs, b_bufs, ready, empty, x_ptr, w_ptr, m0, n0, M, N, K, stride_xm, stride_wn,
                       STAGES: gl.constexpr, NW: gl.constexpr):
        """Copy every K slice of this tile's activation and weight rows into the ring."""
        n = gl.cdiv(K, 32)
        for j in range(n + STAGES - 1):
            if j < n:  # slice j into slot j % STAGES, once the consumers released it
                s = j % STAGES
                mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
                _copy_tile(a_bufs.index(s), x_ptr, m0, M, stride_xm, j * 32, K, NW)
                _copy_tile(b_bufs.index(s), w_ptr, n0, N, stride_wn, j * 32, K, NW)
            async_copy.commit_group()
            i = j - (STAGES - 1)  # the slice signalled ready this trip
            if i >= 0:
                async_copy.wait_group(STAGES - 1)
                fence_async_shared()  # the copies are read by the MMAs (async proxy)
                _sync()  # every thread's copies of slice i have landed
                mbarrier.arrive(ready.index(i % STAGES), count=1)

    @gluon.jit
    def _gemm_consumer(a_bufs, b_bufs, ready, empty, sx_ptr, sw_ptr, m0, n0, M, N, K, stride_sxm, stride_swn,
                       stride_swk, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                       OVERLAP: gl.constexpr, num_warps: gl.constexpr):
        """The scaled sum of every K slice's MMA -> (fp32 [BLOCK_M, BLOCK_N],). OVERLAP: the next slice's
        MMA is issued before this slice's product is scaled into the sum (it runs meanwhile)."""
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
        zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
        rows = m0 + gl.arange(0, BLOCK_M, gl.SliceLayout(1, layout))
        cols = n0 + gl.arange(0, BLOCK_N, gl.SliceLayout(0, layout))
        sx_rows = sx_ptr + rows.to(gl.int64) * stride_sxm
        sw_cols = sw_ptr + (cols // 32).to(gl.int64) * stride_swn
        row_ok, col_ok = rows < M, cols < N
        n = gl.cdiv(K, 32)
        if OVERLAP:  # (the loop carries the next slice's product as a pending MMA)
            mbarrier.wait(ready.index(0), 0)
            part = warpgroup_mma(a_bufs.index(0), b_bufs.index(0).permute((1, 0)), zero, use_acc=False,
                                 is_async=True)
        for j in range(n):
            s = j % STAGES
            # the slice's scales, loaded while its copies land: zero past the ends (their products are zeros)
            sa = e8m0_to_f32(gl.load(sx_rows + j, mask=row_ok, other=0).to(gl.int32))
            sb = e8m0_to_f32(gl.load(sw_cols + j * stride_swk, mask=col_ok, other=0).to(gl.int32))
            if OVERLAP:
                now = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
                _sync()  # both warpgroups' MMAs have read the slot
                mbarrier.arrive(empty.index(s), count=1)
                # the next slice's product (the last trip repeats its own slice's: its slot holds it still)
                nxt = gl.minimum(j + 1, n - 1)
                mbarrier.wait(ready.index(nxt % STAGES), (nxt // STAGES) & 1)
                part = warpgroup_mma(a_bufs.index(nxt % STAGES), b_bufs.index(nxt % STAGES).permute((1, 0)), zero,
                                     use_acc=False, is_async=True)
            else:
                mbarrier.wait(ready.index(s), (j // STAGES) & 1)
                now = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), zero, use_acc=False,
                                    is_async=True)
                now = warpgroup_mma_wait(num_outstanding=0, deps=(now,))
                _sync()  # both warpgroups' MMAs have read the slot
                mbarrier.arrive(empty.index(s), count=1)
            acc = acc + now * (sa[:, None] * sb[None, :])
        if OVERLAP:
            warpgroup_mma_wait(num_outstanding=0, deps=(part,))
        return (acc,)  # (a partition's results are a tuple)

    @gluon.jit
    def _fp8_ws_gemm_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, out_ptr, M, N, K, stride_xm, stride_sxm, stride_wn,
                            stride_swn, stride_swk, stride_om, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                            GROUP_M: gl.constexpr, STAGES: gl.constexpr, PRODUCER_WARPS: gl.constexpr,
                            PRODUCER_REGS: gl.constexpr, OVERLAP: gl.constexpr, num_warps: gl.constexpr):
        """One program per output tile; ``x`` [M, K] E4M3 bytes with ``sx`` [M, K / 32] UE8M0, ``w`` [N, K]
        E4M3 with ``sw`` [ceil(N / 32), K / 32] UE8M0 (strides ``stride_swn``, ``stride_swk``: row or K
        major), ``out`` [M, N] in its dtype."""
        pid = gl.program_id(0)
        tiles_m, tiles_n = gl.cdiv(M, BLOCK_M), gl.cdiv(N, BLOCK_N)
        group = pid // (GROUP_M * tiles_n)  # GROUP_M row tiles walk the columns together (L2 reuse)
        first = group * GROUP_M
        size = gl.minimum(tiles_m - first, GROUP_M)
        m0 = (first + (pid % (GROUP_M * tiles_n)) % size) * BLOCK_M
        n0 = ((pid % (GROUP_M * tiles_n)) // size) * BLOCK_N
        a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, 32],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_M, 32], gl.float8e4nv))
        b_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, 32],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_N, 32], gl.float8e4nv))
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        fence_async_shared()
        acc, = gl.warp_specialize([
            (_gemm_consumer, (a_bufs, b_bufs, ready, empty, sx_ptr, sw_ptr, m0, n0, M, N, K, stride_sxm, stride_swn,
                              stride_swk, BLOCK_M, BLOCK_N, STAGES, OVERLAP, num_warps)),
            (_gemm_producer, (a_bufs, b_bufs, ready, empty, x_ptr, w_ptr, m0, n0, M, N, K, stride_xm, stride_wn,
                              STAGES, PRODUCER_WARPS)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])
        layout: gl.constexpr = acc.type.layout
        rows = m0 + gl.arange(0, BLOCK_M, gl.SliceLayout(1, layout))
        cols = n0 + gl.arange(0, BLOCK_N, gl.SliceLayout(0, layout))
        gl.store(out_ptr + rows.to(gl.int64)[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(rows < M)[:, None] & (cols < N)[None, :])
