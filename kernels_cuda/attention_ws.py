"""Warp-specialized sparse MQA attention for sm_90, written in Gluon (``triton.experimental.gluon``).

The same op and arguments as ``_sparse_attention_kernel`` (:mod:`.attention_kernel`) for its most
common launch: bf16 q, ``D`` = 512, 64 heads a program, KV segments in ``fp8`` / ``fp4_b16``. One
program per (query, 64 heads, K split), two partitions working on a ring of K blocks:

- a **producer** (``PRODUCER_WARPS`` warps) gathers each block's stored rows with asynchronous
  copies (``cp.async``, ``RAW_STAGES - 1`` blocks ahead of the one it decodes), decodes them to bf16
  into a shared ring of ``STAGES`` slots and signals the slot ready (an mbarrier);
- the **consumers** (the default partition, 8 warps, two warpgroups) take a ready slot, compute
  the scores with one warpgroup MMA whose 64 rows are the heads and whose columns (the block's
  rows) are split between the two warpgroups (no score MMA runs twice), run the online softmax,
  and accumulate ``p @ kv`` with each warpgroup owning half of the 512 output columns; then they
  release the slot (``OVERLAP``: the next block's score MMA is issued before this block's softmax).

The plain Triton kernel keeps one chain (gather, decode, MMA) a block per program; here the
gathers of later blocks overlap the MMAs of earlier ones. Split-K partials and the final
normalization follow the plain kernel (``_finish``, ``_combine_kernel``), so the outputs merge the
same way. Chosen by ``tiles.attention.ws`` (on in the h200 profile from 8 queries: docs/performance.md).
"""
from __future__ import annotations

import triton.language as tl

from flashrt.kernels_cuda.attention_kernel import LOG2E, _finish, locate_paths
from flashrt.kernels_cuda.codecs import e2m1_ordered_bf16, e2m1_x16384, e4m3_cvt, e8m0_bf16, e8m0_to_f32
from flashrt.kernels_cuda.codecs_e4m3 import e4m3_pairs_bf16
from flashrt.kernels_cuda.pdl import wait_inputs

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_init, warpgroup_mma_wait)
    # a barrier of the calling partition's warps (Triton 3.6 names it thread_barrier, later ones barrier)
    _sync = getattr(gl, "thread_barrier", None) or gl.barrier
    # the asynchronous global -> shared copy (Triton 3.6: async_copy_global_to_shared; later: async_load)
    _async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    AVAILABLE = True
except (ImportError, AttributeError):  # a Triton without Gluon: the plain kernel serves every launch
    AVAILABLE = False

H_BLOCK = 64  # heads a program: the M of one warpgroup MMA
_H = tl.constexpr(H_BLOCK)
# PACKED: the producer stores the rows' values times 2**-63 (one bf16 multiply a register fewer in the fp4
# decode: the scale holds 2**63 of its 2**126 re-bias); the scores' scale and the output take the 2**63 back,
# exactly (powers of two), so the outputs are the same
_UP63 = tl.constexpr(2.0 ** 63)


if AVAILABLE:
    @gluon.constexpr_function
    def _per(fmt):
        """Elements a stored byte holds (fp4: two)."""
        return 2 if fmt >= 2 else 1

    @gluon.constexpr_function
    def _block(fmt):
        """Elements a scale byte covers."""
        return 16 if fmt == 2 else 32

    @gluon.constexpr_function
    def _raw_shape(stages, rows, width, present):
        """A raw ring's shape, one byte where the path is absent (its buffer is never touched)."""
        return [stages, rows, width] if present else [1, 1, 16]

    @gluon.constexpr_function
    def _copy_layout(VEC, NW, DOWN):
        """A raw slot's copy layout [K_BLOCK, bytes]: 8 rows x 4 column vectors of ``VEC`` bytes a warp,
        ``DOWN`` warps along the rows and the rest along the columns (:func:`_warps_down`). Every width
        shares the rows' distribution (its row slice is :func:`_rows_layout` for any ``VEC``), so one index
        load a block serves every copy, with no exchange through shared memory."""
        return gl.BlockedLayout([1, VEC], [8, 4], [DOWN, NW // DOWN], [1, 0])

    @gluon.constexpr_function
    def _warps_down(NW, K_BLOCK, BY_ROWS):
        """The producer's warps along a block's rows in :func:`_copy_layout`. By default up to 4 warps
        along the columns and the rest along the rows (8 warps: two row halves, so the 256-byte fp4 rows
        are not copied twice): every warp then locates all of a block's rows, 4 a thread. BY_ROWS
        (``tiles.attention.ws.rows_by_warp``): as many along the rows as there are 8-row groups, so a
        thread locates one row of 32 (the same bytes copied to the same places)."""
        return min(NW, K_BLOCK // 8) if BY_ROWS else NW // min(NW, 4)

    @gluon.constexpr_function
    def _rows_layout(NW, DOWN):
        """The layout of a block's row indices and pointers in the producer."""
        return gl.SliceLayout(1, _copy_layout(16, NW, DOWN))

    @gluon.jit
    def _copy_rows(dst, rows, hit, WIDTH: gl.constexpr, NW: gl.constexpr, DOWN: gl.constexpr):
        """Start the asynchronous copy of ``WIDTH`` bytes of each ``hit`` row (``rows``: byte pointers
        [K_BLOCK] in :func:`_rows_layout`) into ``dst`` [K_BLOCK, WIDTH]; rows not hit are filled with
        zeros. 16-byte copies for the data rows (256 or 512 bytes), 4-byte ones for the scale rows (16 or
        32 bytes; where a row is narrower than the column vectors of its warps, the copies past it repeat
        a vector)."""
        VEC: gl.constexpr = 16 if WIDTH >= 256 else 4
        L: gl.constexpr = _copy_layout(VEC, NW, DOWN)
        r = gl.convert_layout(rows, gl.SliceLayout(1, L))  # the same registers: no data moves
        h = gl.convert_layout(hit, gl.SliceLayout(1, L))
        c = gl.arange(0, WIDTH, gl.SliceLayout(0, L))
        _async_load(dst, r[:, None] + c[None, :], mask=h[:, None])

    @gluon.jit
    def _block_rows(kb, bs, idx_ptr, idx1_ptr, K, K0, TWO_PARTS: gl.constexpr, K_BLOCK: gl.constexpr,
                    layout: gl.constexpr):
        """The indices of K block ``kb`` of query ``bs`` ([K_BLOCK] in ``layout``; -1 past K)."""
        offs = kb * K_BLOCK + gl.arange(0, K_BLOCK, layout)
        row0 = idx_ptr + bs * K0
        if TWO_PARTS:  # the window's indices [0, K0), then the picks
            row1 = idx1_ptr + bs * (K - K0) - K0
            return gl.load(gl.where(offs < K0, row0 + offs, row1 + offs), mask=offs < K, other=-1)
        return gl.load(row0 + offs, mask=offs < K, other=-1)

    @gluon.jit
    def _locate_paths(idx, b, seg, ROLE1: gl.constexpr, ROLE2: gl.constexpr, ROLE3: gl.constexpr):
        """Per dequant path: (data row pointers, scale row pointers, hit) of the rows ``idx``."""
        (d0, s0, o0, so0, sb0, st0, ssb0, sst0, start0, len0,
         d1, s1, o1, so1, sb1, st1, ssb1, sst1, start1, len1,
         d2, s2, o2, so2, sb2, st2, ssb2, sst2, start2, len2,
         o3, so3, sb3, st3, ssb3, sst3, start3, len3) = seg
        r0, q0, h0, r1, q1, h1, r2, q2, h2 = locate_paths(
            idx, b, o0, so0, sb0, st0, ssb0, sst0, start0, len0, o1, so1, sb1, st1, ssb1, sst1, start1, len1,
            o2, so2, sb2, st2, ssb2, sst2, start2, len2, o3, so3, sb3, st3, ssb3, sst3, start3, len3,
            ROLE1, ROLE2, ROLE3)
        return (d0 + r0, s0 + q0, h0), (d1 + r1, s1 + q1, h1), (d2 + r2, s2 + q2, h2)

    @gluon.jit
    def _issue(path, data, scale, FMT: gl.constexpr, D: gl.constexpr, NW: gl.constexpr, DOWN: gl.constexpr):
        """Copy one path's rows of a block (data and scale bytes) into its raw slot."""
        rows, srows, hit = path
        _copy_rows(data, rows, hit, D // _per(FMT), NW, DOWN)
        _copy_rows(scale, srows, hit, D // _block(FMT), NW, DOWN)

    @gluon.constexpr_function
    def _decoded_layout(CW, NW):
        """The layout of a decoded chunk [K_BLOCK, CW]: 16 consecutive elements a thread."""
        return gl.BlockedLayout([1, 16], [32 * 16 // CW, CW // 16], [NW, 1], [1, 0])

    @gluon.jit
    def _load_chunk(data, scale, c, FMT: gl.constexpr, CW: gl.constexpr, K_BLOCK: gl.constexpr, NW: gl.constexpr):
        """The stored bytes and scale bytes of columns ``[c * CW, (c + 1) * CW)`` of a raw slot, in the
        layouts :func:`_decode_values` takes."""
        BPB: gl.constexpr = _block(FMT) // _per(FMT)  # stored bytes a scale covers
        NB: gl.constexpr = CW // _block(FMT)
        L3: gl.constexpr = _chunk_layout(FMT, CW, NW)
        L2: gl.constexpr = gl.BlockedLayout([1, 16 // _per(FMT)], [32 * 16 // CW, CW // 16], [NW, 1], [1, 0])
        x = data.slice(c * NB * BPB, NB * BPB, dim=1).load(L2)  # the same bytes a thread as L3 below
        x = gl.convert_layout(gl.reshape(x, [K_BLOCK, NB, BPB]), L3)
        u = scale.slice(c * NB, NB, dim=1).load(gl.SliceLayout(2, L3))
        return x, u

    @gluon.constexpr_function
    def _chunk_layout(FMT, CW, NW):
        """A chunk's bytes [K_BLOCK, CW / scale block, bytes a scale covers]: 16 consecutive elements a
        thread whatever the format, so the paths' values add up in one layout."""
        return gl.BlockedLayout([1, 1, 16 // _per(FMT)], [32 * 16 // CW, CW // _block(FMT), _block(FMT) // 16],
                                [NW, 1, 1], [2, 1, 0])

    @gluon.jit
    def _decode_chunk(data, scale, c, FMT: gl.constexpr, CW: gl.constexpr, K_BLOCK: gl.constexpr, NW: gl.constexpr,
                      PACKED: gl.constexpr):
        """bf16 [K_BLOCK, CW] values of columns ``[c * CW, (c + 1) * CW)`` of a raw slot (:func:`_load_chunk`,
        :func:`_decode_values`)."""
        x, u = _load_chunk(data, scale, c, FMT, CW, K_BLOCK, NW)
        return _decode_values(x, u, FMT, CW, K_BLOCK, NW, PACKED)

    @gluon.jit
    def _decode_values(x, u, FMT: gl.constexpr, CW: gl.constexpr, K_BLOCK: gl.constexpr, NW: gl.constexpr,
                       PACKED: gl.constexpr):
        """bf16 [K_BLOCK, CW] values of a chunk's bytes ``x`` and scale bytes ``u`` (zeros where
        the rows were not copied: a zero code times any scale). PACKED: fp4_b16 codes decoded eight a
        call in packed bf16 registers (:func:`.codecs.e2m1_ordered_bf16`; the same values: every
        product of an E2M1 code and an E4M3 scale is exact in bf16), fp8 bytes four a call
        (:func:`.codecs_e4m3.e4m3_pairs_bf16` by the UE8M0 scale as bf16: the product rounded once, as the
        fp32 path rounds it; the stores never hold the NaN codes, which it would read as +-480); both times
        2**-63 (:data:`_UP63`)."""
        BPB: gl.constexpr = _block(FMT) // _per(FMT)  # stored bytes a scale covers
        NB: gl.constexpr = CW // _block(FMT)
        if FMT == 1 and PACKED:  # E4M3 times a UE8M0 scale, four bytes a call, times 2**-63
            s = gl.broadcast(gl.expand_dims(e8m0_bf16(u.to(gl.int32)), 2), x)[0]
            v = e4m3_pairs_bf16(x, s, False, True)
        elif FMT == 1:  # E4M3 times a UE8M0 scale
            v = e4m3_cvt(x) * gl.expand_dims(e8m0_to_f32(u.to(gl.int32)), 2)
        elif PACKED:
            # the E4M3 scale times 2**63 (exact in bf16) holds half the decode's 2**126: the values times 2**-63
            s = gl.broadcast(gl.expand_dims((e4m3_cvt(u).to(gl.float32) * _UP63).to(gl.bfloat16), 2), x)[0]
            first, second = e2m1_ordered_bf16(x, s, True)  # codes 0-3 / 4-7 of each thread's four bytes
            v = gl.permute(gl.reshape(gl.join(first, second), [K_BLOCK, NB, BPB // 4, 4, 2]), [0, 1, 2, 4, 3])
        else:  # E2M1 (element 2i the low nibble) times an E4M3 scale
            s = gl.expand_dims(e4m3_cvt(u) * 16384.0, 2)
            p = x.to(gl.int32)
            v = gl.join(e2m1_x16384(p & 15).to(gl.float32) * s, e2m1_x16384(p >> 4).to(gl.float32) * s)
        # each path's values in one layout: the same registers a thread, relabelled (no data moves)
        return gl.convert_layout(gl.reshape(v, [K_BLOCK, CW]).to(gl.bfloat16), _decoded_layout(CW, NW),
                                 assert_trivial=True)

    @gluon.jit
    def _decode_sum(slot, raws, hits, rs, c, FMT0: gl.constexpr, FMT1: gl.constexpr, FMT2: gl.constexpr,
                    OWN1: gl.constexpr, OWN2: gl.constexpr, CW: gl.constexpr, K_BLOCK: gl.constexpr,
                    NW: gl.constexpr, PACKED: gl.constexpr):
        """Chunk ``c`` of a block whose rows lie on several paths: the paths' values added in bf16,
        exactly (a row is stored on one path and is zeros on the others); a path no row hits is skipped."""
        data0, scale0, data1, scale1, data2, scale2 = raws
        h0, h1, h2 = hits
        v = gl.zeros([K_BLOCK, CW], gl.bfloat16, _decoded_layout(CW, NW))
        if h0:
            v += _decode_chunk(data0.index(rs), scale0.index(rs), c, FMT0, CW, K_BLOCK, NW, PACKED)
        if OWN1:
            if h1:
                v += _decode_chunk(data1.index(rs), scale1.index(rs), c, FMT1, CW, K_BLOCK, NW, PACKED)
        if OWN2:
            if h2:
                v += _decode_chunk(data2.index(rs), scale2.index(rs), c, FMT2, CW, K_BLOCK, NW, PACKED)
        slot.slice(c * CW, CW, dim=1).store(v)

    @gluon.jit
    def _decode_path(slot, data, scale, FMT: gl.constexpr, D: gl.constexpr, CW: gl.constexpr,
                     K_BLOCK: gl.constexpr, NW: gl.constexpr, PACKED: gl.constexpr, AHEAD: gl.constexpr = False):
        """Store one path's decoded raw slot (``data``, ``scale``) into the bf16 ``slot``, ``CW`` columns
        at a time. AHEAD: each chunk's bytes are loaded before the chunk ahead of it is stored, so its
        shared loads need not wait for those stores (the compiler cannot tell the raw ring and the bf16
        ring apart and keeps every load after the stores before it in the code)."""
        if AHEAD:
            x, u = _load_chunk(data, scale, 0, FMT, CW, K_BLOCK, NW)
            for c in gl.static_range(D // CW):
                if c + 1 < D // CW:
                    x_next, u_next = _load_chunk(data, scale, c + 1, FMT, CW, K_BLOCK, NW)
                slot.slice(c * CW, CW, dim=1).store(_decode_values(x, u, FMT, CW, K_BLOCK, NW, PACKED))
                if c + 1 < D // CW:
                    x = x_next
                    u = u_next
        else:
            for c in gl.static_range(D // CW):
                slot.slice(c * CW, CW, dim=1).store(_decode_chunk(data, scale, c, FMT, CW, K_BLOCK, NW, PACKED))

    @gluon.jit
    def _decode(slot, raws, bits, rs, FMT0: gl.constexpr, FMT1: gl.constexpr, FMT2: gl.constexpr,
                OWN1: gl.constexpr, OWN2: gl.constexpr, D: gl.constexpr, CW: gl.constexpr, K_BLOCK: gl.constexpr,
                NW: gl.constexpr, PACKED: gl.constexpr, AHEAD: gl.constexpr):
        """Decode raw slot ``rs`` of every path into the bf16 ``slot`` [K_BLOCK, D]; ``bits``: the paths
        the block's rows hit (bit p: path p). A block on one path (the common case: the window's blocks,
        then the picks') stores that path's values as they are; a block on several adds them up
        (:func:`_decode_sum`); a block on none stores zeros (its scores are masked; the value MMA still
        reads finite numbers)."""
        data0, scale0, data1, scale1, data2, scale2 = raws
        if OWN1 or OWN2:
            if bits == 1:
                _decode_path(slot, data0.index(rs), scale0.index(rs), FMT0, D, CW, K_BLOCK, NW, PACKED, AHEAD)
            if OWN1:
                if bits == 2:
                    _decode_path(slot, data1.index(rs), scale1.index(rs), FMT1, D, CW, K_BLOCK, NW, PACKED, AHEAD)
            if OWN2:
                if bits == 4:
                    _decode_path(slot, data2.index(rs), scale2.index(rs), FMT2, D, CW, K_BLOCK, NW, PACKED, AHEAD)
            if bits == 0:
                for c in gl.static_range(D // CW):
                    slot.slice(c * CW, CW, dim=1).store(gl.zeros([K_BLOCK, CW], gl.bfloat16, _decoded_layout(CW, NW)))
            if (bits & (bits - 1)) != 0:  # several paths
                hits = ((bits & 1) != 0, (bits & 2) != 0, (bits & 4) != 0)
                for c in gl.static_range(D // CW):
                    _decode_sum(slot, raws, hits, rs, c, FMT0, FMT1, FMT2, OWN1, OWN2, CW, K_BLOCK, NW, PACKED)
        else:  # one path: rows not hit were copied as zeros
            _decode_path(slot, data0.index(rs), scale0.index(rs), FMT0, D, CW, K_BLOCK, NW, PACKED, AHEAD)

    @gluon.constexpr_function
    def _warp_rows_layout(K_BLOCK, NW):
        """A block's row indices with every warp holding all of them (lanes along the rows, the warps
        copies of each other): reductions over the rows stay within a warp."""
        return gl.BlockedLayout([max(1, K_BLOCK // 32)], [32], [NW], [0])

    @gluon.jit
    def _path_bits(p0, p1, p2, OWN1: gl.constexpr, OWN2: gl.constexpr):
        """The paths a block's rows hit (bit p: path p) from :func:`_locate_paths`'s hit flags, the paths
        this launch has (path 0, and 1 / 2 where they are their own)."""
        bits = _any(p0[2])
        if OWN1:
            bits = bits | (_any(p1[2]) << 1)
        if OWN2:
            bits = bits | (_any(p2[2]) << 2)
        return bits

    @gluon.jit
    def _any(hit):
        """Whether any row of a block is hit (a scalar)."""
        return gl.max(hit.to(gl.int32), axis=0)

    @gluon.jit
    def _producer(kv_smem, ready, empty, data0, scale0, data1, scale1, data2, scale2, idx_ptr, idx1_ptr, bs, b,
                  lo, n, K, K0, seg, FMT0: gl.constexpr, FMT1: gl.constexpr, FMT2: gl.constexpr,
                  ROLE1: gl.constexpr, ROLE2: gl.constexpr, ROLE3: gl.constexpr, TWO_PARTS: gl.constexpr,
                  D: gl.constexpr, CW: gl.constexpr, K_BLOCK: gl.constexpr, STAGES: gl.constexpr,
                  RAW_STAGES: gl.constexpr, NW: gl.constexpr, PACKED: gl.constexpr, BY_ROWS: gl.constexpr,
                  AHEAD: gl.constexpr):
        """Gather and decode every K block of this program into the bf16 ring (see the module doc). The
        indices of a block are loaded a trip before its copies start, and the paths its rows hit are
        kept (3 bits a block in ``hist``) until its decode, so the decode reads no index again."""
        raws = (data0, scale0, data1, scale1, data2, scale2)
        OWN1: gl.constexpr = ROLE1 == 1
        OWN2: gl.constexpr = ROLE2 == 2
        DOWN: gl.constexpr = _warps_down(NW, K_BLOCK, BY_ROWS)
        RL: gl.constexpr = _rows_layout(NW, DOWN)
        idx_next = _block_rows(lo, bs, idx_ptr, idx1_ptr, K, K0, TWO_PARTS, K_BLOCK, RL)
        # with the rows split over the warps, the paths a block hits come from a copy of its indices that
        # each warp holds whole (a reduction across the warps would take a barrier and shared memory)
        WL: gl.constexpr = _warp_rows_layout(K_BLOCK, NW)  # (used only with BY_ROWS)
        if BY_ROWS:
            widx_next = _block_rows(lo, bs, idx_ptr, idx1_ptr, K, K0, TWO_PARTS, K_BLOCK, WL)
        KEEP: gl.constexpr = (1 << (3 * RAW_STAGES)) - 1
        hist = n * 0  # the hit bits of the blocks whose copies are in flight, the newest lowest
        for j in range(n + RAW_STAGES - 1):
            hist = (hist << 3) & KEEP
            if j < n:  # start the copies of block j into raw slot j % RAW_STAGES
                rs = j % RAW_STAGES
                idx = idx_next
                idx_next = _block_rows(lo + j + 1, bs, idx_ptr, idx1_ptr, K, K0, TWO_PARTS, K_BLOCK, RL)
                if BY_ROWS:
                    widx = widx_next
                    widx_next = _block_rows(lo + j + 1, bs, idx_ptr, idx1_ptr, K, K0, TWO_PARTS, K_BLOCK, WL)
                p0, p1, p2 = _locate_paths(idx, b, seg, ROLE1, ROLE2, ROLE3)
                _issue(p0, data0.index(rs), scale0.index(rs), FMT0, D, NW, DOWN)
                if OWN1:
                    _issue(p1, data1.index(rs), scale1.index(rs), FMT1, D, NW, DOWN)
                if OWN2:
                    _issue(p2, data2.index(rs), scale2.index(rs), FMT2, D, NW, DOWN)
                if BY_ROWS:  # (of the pointers _locate_paths makes here only the hit flags are used)
                    w0, w1, w2 = _locate_paths(widx, b, seg, ROLE1, ROLE2, ROLE3)
                    hist = hist | _path_bits(w0, w1, w2, OWN1, OWN2)
                else:
                    hist = hist | _path_bits(p0, p1, p2, OWN1, OWN2)
            async_copy.commit_group()
            i = j - (RAW_STAGES - 1)  # the block decoded this trip
            if i >= 0:
                async_copy.wait_group(RAW_STAGES - 1)
                _sync()  # every thread's copies of block i have landed
                bits = (hist >> (3 * (RAW_STAGES - 1))) & 7
                st = i % STAGES
                mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1)  # the consumers released the slot
                _decode(kv_smem.index(st), raws, bits, i % RAW_STAGES, FMT0, FMT1, FMT2, OWN1, OWN2, D, CW, K_BLOCK,
                        NW, PACKED, AHEAD)
                fence_async_shared()  # the decoded slot is read by the MMAs (async proxy)
                _sync()  # every thread's stores done; the raw slot free for its next copy
                mbarrier.arrive(ready.index(st), count=1)

    @gluon.constexpr_function
    def _mma_layout(n, num_warps):
        """The accumulator layout of a warpgroup MMA of 64 rows and ``n`` columns, the columns split
        between the warpgroups."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                         instr_shape=[16, n // (num_warps // 4), 16])

    @gluon.jit
    def _softmax_step(s, idx, m_i, l_i, qk_scale):
        """One K block of the online softmax (base 2) over raw scores ``s`` [64, K_BLOCK], the slots of
        ``idx`` < 0 masked -> (p, the rescale of the earlier blocks, m, l)."""
        s = gl.where((idx >= 0)[None, :], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[:, None])
        return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)

    @gluon.jit
    def _load_q(q_ptr, bs, H, D: gl.constexpr, num_warps: gl.constexpr, COL0: gl.constexpr = 0,
                W: gl.constexpr = 0):
        """q [64, W] (W 0: D) of query ``bs``'s head block ``program_id(1)``, columns from COL0 (rows past
        H zeros)."""
        WIDTH: gl.constexpr = D if W == 0 else W
        QL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        h_q = gl.program_id(1) * _H + gl.arange(0, _H, gl.SliceLayout(1, QL))
        d_q = COL0 + gl.arange(0, WIDTH, gl.SliceLayout(0, QL))
        return gl.load(q_ptr + (bs * H + h_q)[:, None] * D + d_q[None, :], mask=(h_q < H)[:, None], other=0.0)

    @gluon.jit
    def _fill_q(dst, q_ptr, bs, H, D: gl.constexpr, num_warps: gl.constexpr, COL0: gl.constexpr = 0,
                W: gl.constexpr = 0):
        """Store q's columns ``[COL0, COL0 + W)`` (W 0: all of D) into ``dst`` for the calling partition's MMAs:
        the stores fenced for the async proxy and every warp's part in before any MMA reads it."""
        dst.store(_load_q(q_ptr, bs, H, D, num_warps, COL0, W))
        fence_async_shared()
        _sync()

    @gluon.jit
    def _consumer(q_smem, kv_smem, ready, empty, idx_ptr, idx1_ptr, bs, lo, n, K, K0, qk_scale, q_ptr, H,
                  out_ptr, pacc_ptr, pml_ptr, sink_ptr, split, TWO_PARTS: gl.constexpr, D: gl.constexpr,
                  K_BLOCK: gl.constexpr, STAGES: gl.constexpr, OVERLAP: gl.constexpr, PV_PARTS: gl.constexpr,
                  LOAD_Q: gl.constexpr, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr, PACKED: gl.constexpr,
                  STAGED: gl.constexpr, num_warps: gl.constexpr):
        """Scores, online softmax and ``p @ kv`` over the ring's blocks -> (acc, acc2, m, l) (base 2); STAGED:
        the partition also stores the output (or split partials) through q's shared memory, which no MMA
        reads once every warp is past the loop (:func:`_store_output`).
        OVERLAP: the next block's score MMA is issued before this block's softmax (it runs meanwhile);
        a slot is released once the value MMA that read it is waited for, at the next block.
        PV_PARTS 2: the output columns in two accumulators (``acc``: columns [0, D / 2), ``acc2``: the
        rest), each a value MMA of half the width a warpgroup, so no instruction needs the 158 registers
        a thread of one 256-wide accumulator (the ceiling of a 16-warp launch is 128); with 1, ``acc2``
        is ``acc``. LOAD_Q: q is stored into ``q_smem`` here first."""
        if LOAD_Q:
            _fill_q(q_smem, q_ptr, bs, H, D, num_warps)
        s_layout: gl.constexpr = _mma_layout(K_BLOCK, num_warps)
        o_layout: gl.constexpr = _mma_layout(D // PV_PARTS, num_warps)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        HALF: gl.constexpr = D // 2
        acc = gl.zeros([_H, D // PV_PARTS], gl.float32, o_layout)
        if PV_PARTS == 2:
            acc2 = gl.zeros([_H, HALF], gl.float32, o_layout)
        m_i = gl.full([_H], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([_H], gl.float32, gl.SliceLayout(1, s_layout))
        s0 = gl.zeros([_H, K_BLOCK], gl.float32, s_layout)
        if OVERLAP:  # (the loop carries both accumulators as pending MMAs)
            acc = warpgroup_mma_init(acc)
            if PV_PARTS == 2:
                acc2 = warpgroup_mma_init(acc2)
            mbarrier.wait(ready.index(0), 0)
            s = warpgroup_mma(q_smem, kv_smem.index(0).permute((1, 0)), s0, use_acc=False, is_async=True)
        IL: gl.constexpr = gl.SliceLayout(0, s_layout)
        idx_next = _block_rows(lo, bs, idx_ptr, idx1_ptr, K, K0, TWO_PARTS, K_BLOCK, IL)
        for i in range(n):
            idx = idx_next  # this block's indices (for the mask), loaded a trip before
            idx_next = _block_rows(lo + i + 1, bs, idx_ptr, idx1_ptr, K, K0, TWO_PARTS, K_BLOCK, IL)
            st = i % STAGES
            kv = kv_smem.index(st)
            if OVERLAP:
                if PV_PARTS == 2:
                    s, acc, acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(s, acc, acc2))
                else:
                    s, acc = warpgroup_mma_wait(num_outstanding=0, deps=(s, acc))  # this block's scores, the last PV
                if i > 0:
                    _sync()  # both warpgroups' value MMAs of the block before have read its slot
                    mbarrier.arrive(empty.index((i - 1) % STAGES), count=1)
                s_now = s
                # the next block's scores (the last trip repeats its own block's: a ready slot, unused)
                nxt = gl.minimum(i + 1, n - 1)
                mbarrier.wait(ready.index(nxt % STAGES), (nxt // STAGES) & 1)
                s = warpgroup_mma(q_smem, kv_smem.index(nxt % STAGES).permute((1, 0)), s0, use_acc=False,
                                  is_async=True)
            else:
                mbarrier.wait(ready.index(st), (i // STAGES) & 1)
                s_now = warpgroup_mma(q_smem, kv.permute((1, 0)), s0, use_acc=False, is_async=True)
                s_now = warpgroup_mma_wait(num_outstanding=0, deps=(s_now,))
            p, alpha, m_i, l_i = _softmax_step(s_now, idx, m_i, l_i, qk_scale)
            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            pb = gl.convert_layout(p.to(gl.bfloat16), p_layout)
            if PV_PARTS == 2:
                acc = warpgroup_mma(pb, kv.slice(0, HALF, dim=1), acc * alpha_o, is_async=True)
                acc2 = warpgroup_mma(pb, kv.slice(HALF, HALF, dim=1), acc2 * alpha_o, is_async=True)
            else:
                acc = warpgroup_mma(pb, kv, acc * alpha_o, is_async=True)
            if not OVERLAP:
                if PV_PARTS == 2:
                    acc, acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc2))
                else:
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                _sync()  # both warpgroups' MMAs have read the slot
                mbarrier.arrive(empty.index(st), count=1)
        if OVERLAP:
            if PV_PARTS == 2:
                acc, acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc2))
            else:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        if PV_PARTS == 1:
            acc2 = acc
        m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_layout))
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        if STAGED:
            _sync()  # both warpgroups past their last MMAs: q's memory is free
            _store_output(acc, acc2, m_o, l_o, out_ptr, pacc_ptr, pml_ptr, sink_ptr, bs, split, H, HAS_SINK, SPLIT,
                          PACKED, D, PV_PARTS, q_smem, True, num_warps)
        return acc, acc2, m_o, l_o

    @gluon.jit
    def _store_output(acc, acc2, m_i, l_i, out_ptr, pacc_ptr, pml_ptr, sink_ptr, bs, split, H, HAS_SINK: gl.constexpr,
                      SPLIT: gl.constexpr, PACKED: gl.constexpr, D: gl.constexpr, PV_PARTS: gl.constexpr, q_smem,
                      STAGED: gl.constexpr, NW: gl.constexpr):
        """The default consumers' output columns (``acc``, and ``acc2`` with PV_PARTS 2) and, with SPLIT, the
        partials' ``(m, l)`` (:func:`_store_part`; STAGED: through q's shared memory, by the partition's
        ``NW`` warps)."""
        HALF: gl.constexpr = D // 2
        if PV_PARTS == 2:
            _store_part(acc, 0, m_i, l_i, out_ptr, pacc_ptr, sink_ptr, bs, split, H, HAS_SINK, SPLIT, PACKED, D,
                        q_smem.slice(0, HALF, dim=1), STAGED, NW)
            _store_part(acc2, HALF, m_i, l_i, out_ptr, pacc_ptr, sink_ptr, bs, split, H, HAS_SINK, SPLIT, PACKED, D,
                        q_smem.slice(HALF, HALF, dim=1), STAGED, NW)
        else:
            _store_part(acc, 0, m_i, l_i, out_ptr, pacc_ptr, sink_ptr, bs, split, H, HAS_SINK, SPLIT, PACKED, D,
                        q_smem, STAGED, NW)
        if SPLIT:
            _store_ml(m_i, l_i, pml_ptr, bs, split, H)

    @gluon.jit
    def _consumer_half(q_smem, kv_smem, xs_smem, ready, empty, sx, idx_ptr, idx1_ptr, bs, lo, n, K, K0, qk_scale,
                       out_ptr, pacc_ptr, pml_ptr, sink_ptr, split, H, q_ptr, ME: gl.constexpr,
                       TWO_PARTS: gl.constexpr, D: gl.constexpr, K_BLOCK: gl.constexpr, STAGES: gl.constexpr,
                       HAS_SINK: gl.constexpr, SPLIT: gl.constexpr, PACKED: gl.constexpr, LOAD_Q: gl.constexpr,
                       STAGED: gl.constexpr):
        """Consumer warpgroup ``ME`` (0 or 1) of ``SPLIT_SCORES``: each block's 64 x K_BLOCK scores over
        its half of D (q's and the rows' columns ``[ME * D / 2, (ME + 1) * D / 2)``: half of q read a
        block), the two halves added through ``xs_smem`` (each warpgroup stores its half, arrives on its
        ``sx`` barrier and adds the other's: the same sums in both, a + b being b + a), then the online
        softmax and ``p @ kv`` over output columns ``[ME * D / 2, ...)`` with ``p`` the value MMA's
        register operand as the scores left it; those columns stored at the end (warpgroup 0 also the
        split partials' ``(m, l)``). A half's buffer is double-buffered by the block's parity: it is
        written again two blocks later, after the other warpgroup has sent its next half, which it does
        only after reading this one. LOAD_Q: the warpgroup first stores the half of q it reads itself.
        STAGED: the output goes out through that half of q, which only this warpgroup's MMAs read
        (:func:`_store_part`)."""
        HALF: gl.constexpr = D // 2
        s_layout: gl.constexpr = _mma_layout(K_BLOCK, 4)
        o_layout: gl.constexpr = _mma_layout(HALF, 4)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        acc = gl.zeros([_H, HALF], gl.float32, o_layout)
        m_i = gl.full([_H], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([_H], gl.float32, gl.SliceLayout(1, s_layout))
        s0 = gl.zeros([_H, K_BLOCK], gl.float32, s_layout)
        IL: gl.constexpr = gl.SliceLayout(0, s_layout)
        q_half = q_smem.slice(ME * HALF, HALF, dim=1)
        if LOAD_Q:
            _fill_q(q_half, q_ptr, bs, H, D, 4, ME * HALF, HALF)
        idx_next = _block_rows(lo, bs, idx_ptr, idx1_ptr, K, K0, TWO_PARTS, K_BLOCK, IL)
        for i in range(n):
            idx = idx_next  # this block's indices (for the mask), loaded a trip before
            idx_next = _block_rows(lo + i + 1, bs, idx_ptr, idx1_ptr, K, K0, TWO_PARTS, K_BLOCK, IL)
            st = i % STAGES
            par = i % 2
            kv = kv_smem.index(st).slice(ME * HALF, HALF, dim=1)  # this warpgroup's half of the block's columns
            mbarrier.wait(ready.index(st), (i // STAGES) & 1)
            mine = warpgroup_mma(q_half, kv.permute((1, 0)), s0, use_acc=False, is_async=True)
            mine = warpgroup_mma_wait(num_outstanding=0, deps=(mine,))
            xs_smem.index(ME * 2 + par).store(mine)
            _sync()  # the warpgroup's whole half stored before it is announced
            mbarrier.arrive(sx.index(ME * 2 + par), count=1)
            mbarrier.wait(sx.index((1 - ME) * 2 + par), (i // 2) & 1)
            s_now = mine + xs_smem.index((1 - ME) * 2 + par).load(s_layout)
            p, alpha, m_i, l_i = _softmax_step(s_now, idx, m_i, l_i, qk_scale)
            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            pb = gl.convert_layout(p.to(gl.bfloat16), p_layout)
            acc = warpgroup_mma(pb, kv, acc * alpha_o, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            _sync()  # the warpgroup's MMAs have read the slot
            mbarrier.arrive(empty.index(st), count=1)
        m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_layout))
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        _store_part(acc, ME * HALF, m_o, l_o, out_ptr, pacc_ptr, sink_ptr, bs, split, H, HAS_SINK, SPLIT, PACKED, D,
                    q_half, STAGED, 4)
        if SPLIT:
            if ME == 0:
                _store_ml(m_o, l_o, pml_ptr, bs, split, H)

    @gluon.jit
    def _store_ml(m_i, l_i, pml_ptr, bs, split, H):
        """The split partials' [.., 2] = (m, l) of this program's heads."""
        h = gl.program_id(1) * _H + gl.arange(0, _H, m_i.type.layout)
        row = (split * gl.num_programs(0) + bs) * H + h
        gl.store(pml_ptr + row * 2, m_i, mask=h < H)
        gl.store(pml_ptr + row * 2 + 1, l_i, mask=h < H)

    @gluon.jit
    def _store_part(acc, col0, m_i, l_i, out_ptr, pacc_ptr, sink_ptr, bs, split, H, HAS_SINK: gl.constexpr,
                    SPLIT: gl.constexpr, PACKED: gl.constexpr, D: gl.constexpr, buf, STAGED: gl.constexpr,
                    NW: gl.constexpr):
        """Store output columns ``[col0, col0 + width)`` of this program from ``acc`` [64, width]: the
        normalized output, or with SPLIT the partial ``acc / l`` to ``pacc`` [splits, B*S, H, D]. STAGED: the
        values go through ``buf`` (bf16 [64, width] of shared memory no MMA reads any more, written and read
        by the calling partition's ``NW`` warps only) so that each thread stores 16-byte vectors of one row
        (whole 256-byte row pieces a warp) rather than the MMA layout's 4-byte pairs."""
        if PACKED:
            acc = acc * _UP63  # p @ (rows times 2**-63)
        o_layout: gl.constexpr = acc.type.layout
        h = gl.program_id(1) * _H + gl.arange(0, _H, gl.SliceLayout(1, o_layout))
        if SPLIT:  # the sink joins in the combine
            o = _finish(acc, m_i, l_i, 0.0, False).to(pacc_ptr.dtype.element_ty)
            rows = (split * gl.num_programs(0) + bs) * H
            dst = pacc_ptr
        else:
            sk = gl.load(sink_ptr + h, mask=h < H, other=0.0) * LOG2E if HAS_SINK else 0.0
            o = _finish(acc, m_i, l_i, sk, HAS_SINK).to(out_ptr.dtype.element_ty)
            rows = bs * H
            dst = out_ptr
        if STAGED:
            buf.store(o)
            _sync()  # every warp's part in before any is read back in rows
            L: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NW, 1], [1, 0])
            o = buf.load(L)
            h = gl.program_id(1) * _H + gl.arange(0, _H, gl.SliceLayout(1, L))
            d = col0 + gl.arange(0, acc.shape[1], gl.SliceLayout(0, L))
        else:
            d = col0 + gl.arange(0, acc.shape[1], gl.SliceLayout(0, o_layout))
        gl.store(dst + (rows + h)[:, None] * D + d[None, :], o, mask=(h < H)[:, None] & (d < D)[None, :])

    # K, K0 and the blocks a split reads grow with the context in decode: not specialised, as in the
    # plain kernel, so no variant compiles mid-run
    @gluon.jit(do_not_specialize=("K", "K0", "blocks_per_split"))
    def _ws_attention_kernel(
            q_ptr, idx_ptr, idx1_ptr, sink_ptr, out_ptr, pacc_ptr, pml_ptr,
            d0, s0, o0, so0, sb0, st0, ssb0, sst0, start0, len0,
            d1, s1, o1, so1, sb1, st1, ssb1, sst1, start1, len1,
            d2, s2, o2, so2, sb2, st2, ssb2, sst2, start2, len2,
            o3, so3, sb3, st3, ssb3, sst3, start3, len3,
            S, H, K, K0, blocks_per_split, qk_scale, D: gl.constexpr,
            FMT0: gl.constexpr, FMT1: gl.constexpr, FMT2: gl.constexpr, ROLE1: gl.constexpr, ROLE2: gl.constexpr,
            ROLE3: gl.constexpr, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr, TWO_PARTS: gl.constexpr,
            K_BLOCK: gl.constexpr, STAGES: gl.constexpr, RAW_STAGES: gl.constexpr, CW: gl.constexpr,
            PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr, PACKED: gl.constexpr, OVERLAP: gl.constexpr,
            num_warps: gl.constexpr, PV_PARTS: gl.constexpr = 1, Q_IN_CONSUMERS: gl.constexpr = False,
            SPLIT_SCORES: gl.constexpr = False, CONSUMER_REGS: gl.constexpr = 0, ROWS_BY_WARP: gl.constexpr = False,
            STAGED_STORES: gl.constexpr = False, DECODE_AHEAD: gl.constexpr = False):
        """One program per (query ``bs``, 64 heads, K split); arguments as ``_sparse_attention_kernel``'s.
        SPLIT: partials ``(acc / l, m, l)`` to ``pacc`` / ``pml`` for ``_combine_kernel``. PACKED: the fp4_b16
        rows decoded in packed registers (``tiles.attention.dequant``, as the plain kernel). OVERLAP: the
        consumers issue a block's score MMA before the softmax of the block before (:func:`_consumer`).
        PV_PARTS 2: the value MMA in two halves of the output columns (:func:`_consumer`).
        Q_IN_CONSUMERS: q loaded by the consumers, so the producer's first copies do not wait for it.
        SPLIT_SCORES (``num_warps`` 4): the consumer warpgroups are two partitions, each computing the
        scores over half of D and adding the other's half (:func:`_consumer_half`; the second at
        CONSUMER_REGS registers a thread). ROWS_BY_WARP: the producer's warps split a block's rows, not its
        columns, when copying (:func:`_warps_down`). STAGED_STORES: the output leaves through q's shared memory
        in 16-byte vectors a thread (:func:`_store_part`). DECODE_AHEAD: the producer loads a chunk's raw bytes
        before storing the chunk ahead of it (:func:`_decode_path`)."""
        wait_inputs()
        bs = gl.program_id(0).to(gl.int64)
        split = gl.program_id(2)
        lo = split * blocks_per_split
        n = gl.minimum(lo + blocks_per_split, gl.cdiv(K, K_BLOCK)) - lo
        OWN1: gl.constexpr = ROLE1 == 1
        OWN2: gl.constexpr = ROLE2 == 2

        # q [64, D] of this query's head block in shared memory (the A operand of the score MMA): loaded
        # here, before the partitions start, or by the consumers while the producer starts its copies
        QS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_H, D], gl.bfloat16)
        if Q_IN_CONSUMERS:
            q_smem = gl.allocate_shared_memory(gl.bfloat16, [_H, D], QS)
        else:
            q_smem = gl.allocate_shared_memory(gl.bfloat16, [_H, D], QS, _load_q(q_ptr, bs, H, D, num_warps))
        kv_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, K_BLOCK, D],
                                            gl.NVMMASharedLayout.get_default_for([K_BLOCK, D], gl.bfloat16))
        RL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])  # a slot: [K_BLOCK, bytes]
        data0 = gl.allocate_shared_memory(gl.uint8, [RAW_STAGES, K_BLOCK, D // _per(FMT0)], RL)
        scale0 = gl.allocate_shared_memory(gl.uint8, [RAW_STAGES, K_BLOCK, D // _block(FMT0)], RL)
        data1 = gl.allocate_shared_memory(gl.uint8, _raw_shape(RAW_STAGES, K_BLOCK, D // _per(FMT1), OWN1), RL)
        scale1 = gl.allocate_shared_memory(gl.uint8, _raw_shape(RAW_STAGES, K_BLOCK, D // _block(FMT1), OWN1), RL)
        data2 = gl.allocate_shared_memory(gl.uint8, _raw_shape(RAW_STAGES, K_BLOCK, D // _per(FMT2), OWN2), RL)
        scale2 = gl.allocate_shared_memory(gl.uint8, _raw_shape(RAW_STAGES, K_BLOCK, D // _block(FMT2), OWN2), RL)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2 if SPLIT_SCORES else 1)  # (each consumer partition arrives)
        fence_async_shared()  # q and the barriers' initialization, before the MMAs and the other partition

        seg = (d0, s0, o0, so0, sb0, st0, ssb0, sst0, start0, len0,
               d1, s1, o1, so1, sb1, st1, ssb1, sst1, start1, len1,
               d2, s2, o2, so2, sb2, st2, ssb2, sst2, start2, len2,
               o3, so3, sb3, st3, ssb3, sst3, start3, len3)
        qk = qk_scale * _UP63 if PACKED else qk_scale  # the scores of rows stored times 2**-63 (_UP63)
        if SPLIT_SCORES:  # two consumer partitions of a warpgroup each (the default one is warpgroup 0)
            xs_smem = gl.allocate_shared_memory(gl.float32, [4, _H, K_BLOCK], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
            sx = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(4):
                mbarrier.init(sx.index(i), count=1)
            fence_async_shared()
            gl.warp_specialize([
                (_consumer_half, (q_smem, kv_smem, xs_smem, ready, empty, sx, idx_ptr, idx1_ptr, bs, lo, n, K, K0,
                                  qk, out_ptr, pacc_ptr, pml_ptr, sink_ptr, split, H, q_ptr, 0, TWO_PARTS, D,
                                  K_BLOCK, STAGES, HAS_SINK, SPLIT, PACKED, Q_IN_CONSUMERS, STAGED_STORES)),
                (_consumer_half, (q_smem, kv_smem, xs_smem, ready, empty, sx, idx_ptr, idx1_ptr, bs, lo, n, K, K0,
                                  qk, out_ptr, pacc_ptr, pml_ptr, sink_ptr, split, H, q_ptr, 1, TWO_PARTS, D,
                                  K_BLOCK, STAGES, HAS_SINK, SPLIT, PACKED, Q_IN_CONSUMERS, STAGED_STORES)),
                (_producer, (kv_smem, ready, empty, data0, scale0, data1, scale1, data2, scale2, idx_ptr, idx1_ptr,
                             bs, bs // S, lo, n, K, K0, seg, FMT0, FMT1, FMT2, ROLE1, ROLE2, ROLE3, TWO_PARTS, D,
                             CW, K_BLOCK, STAGES, RAW_STAGES, PRODUCER_WARPS, PACKED, ROWS_BY_WARP,
                             DECODE_AHEAD)),
            ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            acc, acc2, m_i, l_i = gl.warp_specialize([
                (_consumer, (q_smem, kv_smem, ready, empty, idx_ptr, idx1_ptr, bs, lo, n, K, K0, qk, q_ptr, H,
                             out_ptr, pacc_ptr, pml_ptr, sink_ptr, split, TWO_PARTS, D, K_BLOCK, STAGES, OVERLAP,
                             PV_PARTS, Q_IN_CONSUMERS, HAS_SINK, SPLIT, PACKED, STAGED_STORES, num_warps)),
                (_producer, (kv_smem, ready, empty, data0, scale0, data1, scale1, data2, scale2, idx_ptr, idx1_ptr,
                             bs, bs // S, lo, n, K, K0, seg, FMT0, FMT1, FMT2, ROLE1, ROLE2, ROLE3, TWO_PARTS, D,
                             CW, K_BLOCK, STAGES, RAW_STAGES, PRODUCER_WARPS, PACKED, ROWS_BY_WARP,
                             DECODE_AHEAD)),
            ], [PRODUCER_WARPS], [PRODUCER_REGS])
            if not STAGED_STORES:  # (staged, the consumers have stored inside their partition)
                _store_output(acc, acc2, m_i, l_i, out_ptr, pacc_ptr, pml_ptr, sink_ptr, bs, split, H, HAS_SINK,
                              SPLIT, PACKED, D, PV_PARTS, q_smem, False, num_warps)
