"""``sample`` (kernels_cuda/sample.py): the split argmax against ``torch.argmax`` on fresh random
logits of odd widths and batches, with ties placed across tiles and slices, NaN, -inf-only and
bf16 rows; Gumbel-max rows against the reference with the same generator seed; one launch a
greedy call; the plain-torch switch gives the same."""
import pytest
import torch

import flashrt
from flashrt import ops
from flashrt.kernels_cuda import sample as sample_kernels
from kernel_check import DEVICE, launches, pinned_tiles, requires_kernels  # noqa: F401 (launches: a fixture)

pytestmark = requires_kernels
SMALL = dict(BLOCK=64, waves=1)  # small tiles: several tiles a slice and several slices a row


def _logits(rng, B, V, dtype=torch.float32):
    x = torch.randn(B, V, generator=rng) * 3
    for b in range(B):  # a tie: the row's maximum again at a later column (often another tile / slice)
        hi = int(x[b].argmax())
        later = int(torch.randint(hi, V, (1,), generator=rng))
        x[b, later] = x[b, hi]
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("B,V", [(1, 1), (1, 1000), (3, 4097), (5, 257), (2, 130), (64, 300)])
@pytest.mark.parametrize("tiles", [{}, SMALL])
def test_greedy_is_torch_argmax(rng, launches, B, V, tiles):
    x = _logits(rng, B, V)
    with flashrt.use_backend("cuda"), pinned_tiles(sample={"argmax": tiles}):
        got = ops.sample(x, 0.0)
    assert launches == ["_argmax_kernel"]
    assert got.dtype == torch.int64 and got.shape == (B,)
    assert torch.equal(got.cpu(), x.cpu().argmax(-1))


def test_nan_inf_and_bf16_rows(rng, launches):
    V = 700
    x = _logits(rng, 6, V)
    x[0, 650] = float("nan")  # NaN ranks first, wherever the maximum is
    x[0, 651] = float("nan")
    x[1, :] = float("-inf")  # all -inf: column 0
    x[2, 3] = float("inf")
    x[2, 600] = float("inf")
    x[3, :] = 0.0  # all equal: column 0
    x[4, 699] = 1e9  # the last column
    with flashrt.use_backend("cuda"), pinned_tiles(sample={"argmax": SMALL}):
        got = ops.sample(x, 0.0)
        got_bf16 = ops.sample(x.to(torch.bfloat16), 0.0)
    assert torch.equal(got.cpu(), x.cpu().argmax(-1))
    assert got.tolist()[:5] == [650, 0, 3, 0, 699]
    assert torch.equal(got_bf16.cpu(), x.to(torch.bfloat16).float().cpu().argmax(-1))


def test_gumbel_rows_match_the_reference(rng):
    x = _logits(rng, 4, 513)
    temperature = torch.tensor([0.0, 0.7, 1.0, 0.0], device=DEVICE)
    seed = int(torch.randint(0, 2 ** 31, (1,), generator=rng))
    out = []
    for backend in ("cuda", "reference"):
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        with flashrt.use_backend(backend), pinned_tiles(sample={"argmax": SMALL}):
            out.append(ops.sample(x, temperature, gen).cpu())
    assert torch.equal(out[0], out[1])
    assert out[0][0] == x[0].cpu().argmax() and out[0][3] == x[3].cpu().argmax()


def test_counters_are_left_at_zero_and_the_switch_gives_the_same(rng, launches):
    x = _logits(rng, 3, 900)
    with flashrt.use_backend("cuda"), pinned_tiles(sample={"argmax": SMALL}):
        first = ops.sample(x, 0.0)
        second = ops.sample(x, 0.0)  # the same counters, reset by the first launch's last programs
        with pinned_tiles(sample={"argmax": {"in_kernel": False}}):
            plain = ops.sample(x, 0.0)
    assert launches == ["_argmax_kernel", "_argmax_kernel"]
    assert torch.equal(first, second) and torch.equal(first, plain)
    from flashrt.kernels_cuda import splitk
    assert int(splitk.counters(x.device)[:3].abs().sum()) == 0


def test_plan_splits_rows_over_slices():
    t, slices, per = sample_kernels._plan(1, 129280, torch.device("cpu"))
    assert per % t["BLOCK"] == 0 and (slices - 1) * per < 129280 <= slices * per
    assert 1 < slices <= sample_kernels.MAX_SLICES
