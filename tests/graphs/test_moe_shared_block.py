"""The MoE block runs the routed experts and the shared expert in one ``moe_experts`` (``shared=``):
on the CUDA kernels (interpreter) the layer's output equals the two-op formulation (the shared
expert as its own op, its output as ``add``) bit for bit, and the reference backend's within the
experts' tolerance, on fresh random activations of the shipped ``tiny`` weights (routed ``fp4_w``,
shared ``fp8_w``)."""
import pytest
import torch

import flashrt
from flashrt import ops
from flashrt.graphs.moe import MoE, SharedRoutes
from kernel_check import DEVICE, GPU, rel_err


@pytest.fixture(scope="module")
def block_weights(cfg, weights):
    """The shipped ``tiny`` weights where the kernels run: the GPU when there is one (the CUDA
    backend serves CUDA tensors there), else the CPU for the interpreter."""
    if not GPU:
        return weights
    from flashrt.graphs.init_weights import init_weights

    return init_weights(cfg, seed=0, device=DEVICE)


def _two_ops(moe: MoE, h: torch.Tensor) -> torch.Tensor:
    x = h.reshape(-1, h.shape[-1])
    weights, indices = moe.routes(x)
    ones, first = SharedRoutes.make(x.shape[0], x.device)
    alone = ops.moe_experts(x, ones, first, *moe.shared, moe.cfg.swiglu_limit)
    return ops.moe_experts(x, weights, indices, moe.w1, moe.w3, moe.w2, moe.cfg.swiglu_limit, add=alone,
                           out_dtype=h.dtype).view(h.shape)


@pytest.mark.parametrize("tokens", [1, 5])
def test_moe_block_in_one_op_equals_two_ops_and_the_reference(cfg, block_weights, rng, tokens):
    pytest.importorskip("flashrt.kernels_cuda.moe")
    moe = MoE(cfg, 0, dict(block_weights), "layers.0.")
    assert moe.shared is not None and moe.shared[0].fmt != moe.w1.fmt  # two formats in one launch
    h = (torch.randn(1, tokens, cfg.dim, generator=rng) * 2.0).to(DEVICE, torch.bfloat16)
    with flashrt.use_backend("cuda"):
        got, two = moe.forward(h), _two_ops(moe, h)
    with flashrt.use_backend("reference"):
        want = moe.forward(h)
    assert got.dtype == h.dtype and got.shape == h.shape
    assert torch.equal(got, two)  # the shared row joins the fp32 sum where the add did
    assert rel_err(got, want) < 1e-2


def _blocks_under(cfg, block_weights, backend, key, *values) -> list:
    """The block built under the active profile with its field ``key`` set to each of ``values``."""
    import dataclasses

    from flashrt import profiles

    if backend == "cuda":
        pytest.importorskip("flashrt.kernels_cuda.moe")
    base, out = profiles.active_profile(), []
    for value in values:
        with profiles.using(dataclasses.replace(base, **{key: value})):
            out.append(MoE(cfg, 0, dict(block_weights), "layers.0."))
    return out


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_k_major_expert_scales_change_the_layout_not_the_output(cfg, block_weights, rng, backend):
    """A profile with ``expert_scales: k_major`` stores the routed and shared experts' scales K
    major (the same values; the rows contiguous at each K group); the block's output is the row
    layout's bit for bit, on the reference backend and on the CUDA kernels (interpreter)."""
    row, kmajor = _blocks_under(cfg, block_weights, backend, "expert_scales", "row", "k_major")
    for a, b in zip((row.w1, row.w3, row.w2, *row.shared), (kmajor.w1, kmajor.w3, kmajor.w2, *kmajor.shared)):
        assert torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8)) and torch.equal(a.data, b.data)
        assert a.scale.stride(-1) == 1 and b.scale.stride(-2) == 1 and b.scale.stride(-1) == b.scale.shape[-2]
    for w in (row.w1, row.w3, row.w2, kmajor.w1, *row.shared):
        assert w.scale_max == int(w.scale.view(torch.uint8).max())  # fp4_w and fp8_w: recorded at load
    h = (torch.randn(1, 3, cfg.dim, generator=rng) * 2.0).to(DEVICE, torch.bfloat16)
    with flashrt.use_backend(backend):
        got = kmajor.forward(h)
        assert torch.equal(got, row.forward(h))
    with flashrt.use_backend("reference"):
        assert rel_err(got, row.forward(h)) < 1e-2


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_words_expert_fp4_changes_the_codes_layout_not_the_output(cfg, block_weights, rng, backend):
    """A profile with ``expert_fp4: words`` stores the fp4 experts' codes in the E2M1 word layout
    (the same bytes in nibbles when put back; fp8 experts as they are) and the block's output is
    the nibbles' bit for bit, on the reference backend and on the CUDA kernels (interpreter)."""
    from flashrt import formats

    plain, words = _blocks_under(cfg, block_weights, backend, "expert_fp4", "nibbles", "words")
    pairs = list(zip((plain.w1, plain.w3, plain.w2, *plain.shared), (words.w1, words.w3, words.w2, *words.shared)))
    assert any(b.e2m1_words for _, b in pairs)
    for a, b in pairs:
        assert b.e2m1_words == (a.fmt == "fp4_w") and not a.e2m1_words
        assert torch.equal(formats.with_nibbles(b).data.view(torch.uint8), a.data.view(torch.uint8))
    h = (torch.randn(1, 3, cfg.dim, generator=rng) * 2.0).to(DEVICE, torch.bfloat16)
    with flashrt.use_backend(backend):
        assert torch.equal(words.forward(h), plain.forward(h))
