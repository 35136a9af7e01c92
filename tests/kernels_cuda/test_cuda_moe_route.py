"""``moe_route`` on the CUDA backend (kernels_cuda/moe_route.py) against the float64 loops of
tests/ops/test_moe.py and the reference backend: every score function, bias or none, normalised or
not, ties to the lower expert, and the calls it declines."""
import math

import pytest
import torch

import flashrt
from flashrt import ops
from kernel_check import DEVICE, GPU, requires_kernels, run_both
from test_moe import _check_route, _scores64

pytestmark = requires_kernels
mr = pytest.importorskip("flashrt.kernels_cuda.moe_route")


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("norm_topk", [False, True])
def test_moe_route_matches_float64(score_func, with_bias, norm_topk, rng):
    for N, D, E, topk, route_scale in ((5, 64, 8, 3, 2.5), (1, 32, 5, 1, 1.0), (19, 96, 12, 12, 0.7),
                                       (3, 64, 40, 6, 1.5), (1, 64, 40, 6, 1.5)):  # one token: a one-row program
        x = torch.randn(N, D, generator=rng).to(torch.bfloat16)
        weight = (torch.randn(E, D, generator=rng) / math.sqrt(D)).to(torch.bfloat16)
        bias = torch.randn(E, generator=rng) * 0.3 if with_bias else None
        args = (x.to(DEVICE), weight.to(DEVICE), None if bias is None else bias.to(DEVICE), topk, score_func,
                norm_topk, route_scale)
        assert mr.FAMILY.serves("moe_route", *args) is None
        with flashrt.use_backend("cuda"):
            w_op, i_op = ops.moe_route(*args)
        s64 = _scores64(x, weight, score_func)
        key64 = s64 + (bias.double().numpy() if with_bias else 0)
        _check_route(w_op.cpu(), i_op.cpu(), s64, key64, topk, norm_topk, route_scale)
        (w_c, i_c), (w_r, i_r) = run_both("moe_route", *args)
        assert torch.equal(i_c, i_r) or (i_c != i_r).sum() <= 2  # only a near-tie may swap a pick
        same = (i_c == i_r).all(dim=1)
        torch.testing.assert_close(w_c[same], w_r[same], rtol=2e-6, atol=1e-7)


def test_ties_go_to_the_lower_expert():
    x = torch.ones(2, 32, dtype=torch.bfloat16, device=DEVICE)
    weight = torch.zeros(6, 32, dtype=torch.bfloat16, device=DEVICE)  # every score equal
    with flashrt.use_backend("cuda"):
        w, i = ops.moe_route(x, weight, None, 3, "sigmoid", True, 1.0)
        assert i.tolist() == [[0, 1, 2]] * 2 and torch.allclose(w, torch.full_like(w, 1 / 3))
        bias = torch.tensor([0.0, -1.0, 0.0, 0.0, 2.0, 0.0], device=DEVICE)  # the bias picks, does not scale
        w, i = ops.moe_route(x, weight, bias, 2, "sigmoid", False, 3.0)
        assert i.tolist() == [[4, 0]] * 2 and torch.allclose(w, torch.full_like(w, 1.5))


def test_declined_calls(rng):
    x = torch.randn(3, 32, generator=rng).to(torch.bfloat16).to(DEVICE)
    w32 = torch.randn(8, 32, generator=rng).to(DEVICE)  # an fp32 gate (gate_temp != 1): reference
    assert "weight: dtype torch.float32 is not served" in mr.FAMILY.serves("moe_route", x, w32, None, 2, "softmax", True, 1.0)
    assert mr.FAMILY.serves("moe_route", x, w32.bfloat16(), None, 17, "softmax", True, 1.0) == "topk = 17: served in [1, 16]"
    got = ops.moe_route(x, w32, None, 2, "softmax", True, 1.0)  # automatic choice: still served
    assert got[1].shape == (3, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("N", [1, 8, 64, 2048])
def test_moe_route_realistic(rng, N):
    """The released gate: 384 experts, top-6, sqrtsoftplus, bias, normalised, x 4096 wide."""
    x = torch.randn(N, 4096, generator=rng).to(torch.bfloat16).to(DEVICE)
    weight = (torch.randn(384, 4096, generator=rng) * 4096 ** -0.5).to(torch.bfloat16).to(DEVICE)
    bias = (torch.randn(384, generator=rng) * 0.1).to(DEVICE)
    (w_c, i_c), (w_r, i_r) = run_both("moe_route", x, weight, bias, 6, "sqrtsoftplus", True, 2.5)
    assert (i_c != i_r).any(dim=1).float().mean() < 0.01  # near-ties only
    same = (i_c == i_r).all(dim=1)
    torch.testing.assert_close(w_c[same], w_r[same], rtol=1e-5, atol=1e-6)
