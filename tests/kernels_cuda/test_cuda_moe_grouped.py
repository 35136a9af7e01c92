"""``moe_experts`` as bf16 grouped GEMMs (``tiles.moe.grouped_min_rows``, kernels_cuda/moe_grouped.py)
against the kernels' path and the reference on fresh random inputs: routed fp4_w / fp8_w experts,
a shared expert of either format or none, ``add`` and ``out_dtype``, unused experts, repeated
slots; the threshold, the stacks' byte cap and the dtype that select the path."""
import pytest
import torch

import flashrt
from flashrt import formats, ops
from kernel_check import DEVICE, GPU, launches, pinned_tiles, rel_err, requires_kernels  # noqa: F401

pytestmark = requires_kernels
moe = pytest.importorskip("flashrt.kernels_cuda.moe")

GROUPED = dict(grouped_min_rows=1)


def _weights(rng, fmt, E, I, D):
    return [formats.quantize(torch.randn(*s, generator=rng) * 0.25, fmt).to(DEVICE)
            for s in ((E, I, D), (E, I, D), (E, D, I))]


def _case(rng, n, E, k, D, I, routed="fp4_w", shared_fmt="fp8_w", xdt=torch.bfloat16):
    x = (torch.randn(n, D, generator=rng) * 3.0).to(DEVICE, xdt)
    idx = torch.randint(0, E - 1, (n, k), generator=rng, dtype=torch.int32).to(DEVICE)  # expert E-1 unused
    rw = torch.rand(n, k, generator=rng).to(DEVICE)
    shared = None if shared_fmt is None else tuple(_weights(rng, shared_fmt, 1, I, D))
    return (x, rw, idx, *_weights(rng, routed, E, I, D), 10.0), shared


def _cuda(args, **kw):
    with flashrt.use_backend("cuda"):
        return ops.moe_experts(*args, **kw)


@pytest.mark.parametrize("routed,shared_fmt", [("fp4_w", "fp8_w"), ("fp4_w", None), ("fp8_w", "fp4_w")])
@pytest.mark.parametrize("with_add", [False, True])
def test_grouped_equals_the_kernels(rng, launches, routed, shared_fmt, with_add):
    n, E, k, D, I = 9, 5, 3, 96, 64
    args, shared = _case(rng, n, E, k, D, I, routed, shared_fmt)
    add = (torch.randn(n, D, generator=rng) * 2.0).to(DEVICE) if with_add else None
    with pinned_tiles(moe=GROUPED):
        got = _cuda(args, add=add, out_dtype=torch.bfloat16, shared=shared)
    assert "_moe_up_kernel" not in launches and launches.count("_moe_combine_kernel") == 1
    with pinned_tiles():
        kernels = _cuda(args, add=add, out_dtype=torch.bfloat16, shared=shared)
    with flashrt.use_backend("reference"):
        want = ops.moe_experts(*args, add=add, out_dtype=torch.bfloat16, shared=shared)
    assert got.dtype == torch.bfloat16 and got.shape == (n, D)
    assert rel_err(got, kernels) < 2e-3 and rel_err(got, want) < 2e-3


def test_the_threshold_and_dtype_pick_the_path(rng, launches):
    """Mean pair rows per expert under the threshold, or fp32 x: the kernels run; ``launch_path`` (what
    ``flashrt tune`` reads) names the launch taken each time."""
    args, shared = _case(rng, 4, 4, 2, 64, 32)  # 2 pair rows per expert
    stacks = 3 * (4 + 1) * 32 * 64 * 2  # W1, W3, W2 of 4 experts + the shared one, bf16
    for tiles, grouped in ((dict(grouped_min_rows=3), False), (dict(grouped_min_rows=2), True),
                           (dict(grouped_min_rows=2, grouped_max_bytes=stacks - 1), False),  # over the byte cap
                           (dict(grouped_min_rows=2, grouped_max_bytes=stacks), True)):
        launches.clear()
        with pinned_tiles(moe=tiles):
            _cuda(args, shared=shared)
            path = moe.launch_path(*args, shared=shared)
        assert ("_moe_up_kernel" not in launches) == grouped and (path == "grouped") == grouped, (tiles, path)
    launches.clear()
    fp32 = (args[0].float(), *args[1:])
    with pinned_tiles(moe=GROUPED):
        got = _cuda(fp32, shared=shared)
    assert "_moe_up_kernel" in launches
    with flashrt.use_backend("reference"):
        assert rel_err(got, ops.moe_experts(*fp32, shared=shared)) < 2e-3


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a GPU")
@pytest.mark.parametrize("n", [512, 4096])
def test_grouped_prefill_shapes_gpu(rng, n):
    """small's experts (32 of 512 x 1024, top-4) with an fp8 shared expert over a prefill chunk."""
    args, shared = _case(rng, n, 32, 4, 1024, 512)
    with pinned_tiles(moe=GROUPED):
        got = _cuda(args, out_dtype=torch.bfloat16, shared=shared)
    with pinned_tiles():
        kernels = _cuda(args, out_dtype=torch.bfloat16, shared=shared)
    with flashrt.use_backend("reference"):
        want = ops.moe_experts(*args, out_dtype=torch.bfloat16, shared=shared)
    assert rel_err(got, kernels) < 2e-3 and rel_err(got, want) < 2e-3


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a GPU")
def test_grouped_path_never_syncs_the_host(rng):
    """A captured prefill cannot read device values back: the grouped path runs with torch's sync
    debug mode raising on any synchronizing call, and captures into a CUDA graph that replays it."""
    args, shared = _case(rng, 1024, 32, 4, 1024, 512)
    with pinned_tiles(moe=GROUPED):
        want = _cuda(args, out_dtype=torch.bfloat16, shared=shared)
        torch.cuda.synchronize()
        with flashrt.value_checks(False):  # the op's index-range check syncs: off, as in every capture
            torch.cuda.set_sync_debug_mode("error")
            try:
                _cuda(args, out_dtype=torch.bfloat16, shared=shared)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                got = _cuda(args, out_dtype=torch.bfloat16, shared=shared)
            graph.replay()
    assert torch.equal(got, want)


@pytest.mark.parametrize("limit", [10.0, 0.0])
def test_the_swiglu_launch_equals_the_torch_composition(rng, limit):
    """``moe_grouped.swiglu_fp8``: gate ‖ up sums in bf16 (some past the clamp), fp32 row weights
    -> silu(min(g, L)) * clamp(u, -L, L) * w rounded to bf16, then fp8 per 32 and back (the
    reference's formats), computed independently with torch; rows and columns past the tile edges."""
    from flashrt.kernels_cuda import moe_grouped

    rows, I = int(torch.randint(1, 40, (1,), generator=rng)), 32 * int(torch.randint(1, 9, (1,), generator=rng))
    gu = (torch.randn(rows, 2 * I, generator=rng) * 6.0).to(torch.bfloat16)
    rw = torch.rand(rows, generator=rng)
    got = moe_grouped.swiglu_fp8(gu.to(DEVICE), rw.to(DEVICE), limit, dict(BLOCK_R=16, BLOCK_C=64, num_warps=4)).cpu()
    g, u = gu[:, :I].float(), gu[:, I:].float()
    if limit > 0:
        g, u = g.clamp_max(limit), u.clamp(-limit, limit)
    h = (g / (1.0 + torch.exp(-g)) * u * rw[:, None]).to(torch.bfloat16)
    want = formats.dequantize(formats.quantize(h.float(), "fp8"), torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, I)
    # exp differs between the kernel and torch in the last fp32 bit: a rare h one bf16 step apart
    # can move its fp8 code by one step (or its block's scale), nothing more
    off = (got.float() - want.float()).abs()
    assert float((off > 0).float().mean()) < 0.01
    assert bool((off <= want.float().abs() * 2 ** -3 + 1e-30).all())
