"""The load's NaN / Inf check (graphs/finite.py) against an independent count: every value
converted to float32 and tested with ``isfinite``, on random tensors of every checked dtype with
random bad values at random places."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashrt.errors import CheckpointError
from flashrt.formats import QTensor
from flashrt.graphs.finite import FiniteCheck

FLOATS = (torch.bfloat16, torch.float16, torch.float32)
BYTES = (torch.float8_e4m3fn, torch.float8_e8m0fnu)


def _tensor(dtype, n: int, bad: list[tuple[int, int]], seed: int) -> torch.Tensor:
    """``n`` random finite values of ``dtype`` with ``bad`` = (position, kind) spoiled: kind picks
    NaN / +Inf / -Inf for floats, a NaN byte for the byte formats."""
    g = torch.Generator().manual_seed(seed)
    if dtype in FLOATS:
        t = (torch.randn(n, generator=g) * 100).to(dtype)
        for pos, kind in bad:
            t[pos] = (float("nan"), float("inf"), float("-inf"))[kind % 3]
        return t
    b = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
    if dtype == torch.float8_e4m3fn:
        b = torch.where((b & 0x7F) == 0x7F, b & 0xFE, b)  # finite bytes only
        for pos, kind in bad:
            b[pos] = (0x7F, 0xFF)[kind % 2]
    else:
        b = torch.where(b == 0xFF, 0xFE, b)
        for pos, _ in bad:
            b[pos] = 0xFF
    return b.view(dtype)


@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from(FLOATS + BYTES), n=st.integers(1, 3000), seed=st.integers(0, 2**31 - 1),
       spoils=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 5)), max_size=3))
def test_a_tensor_is_flagged_exactly_when_it_holds_a_non_finite_value(dtype, n, seed, spoils):
    t = _tensor(dtype, n, [(int(f * n), kind) for f, kind in spoils], seed)
    want = int((~torch.isfinite(t.float())).sum())
    check = FiniteCheck()
    check.add("w", t)
    if want:
        with pytest.raises(CheckpointError, match=f"tensor 'w': {want} of {n} values are NaN or Inf"):
            check.finish()
    else:
        check.finish()


def test_integer_storage_and_empty_tensors_are_not_flagged():
    check = FiniteCheck()
    check.add("fp4", torch.full((64,), 0xFF, dtype=torch.uint8))  # E2M1 codes: all finite
    check.add("empty", torch.empty(0, dtype=torch.bfloat16))
    assert check.pending == []
    check.finish()


@pytest.mark.parametrize("spoil", ["data", "scale"])
def test_a_quantized_weight_names_its_data_or_its_scale(spoil):
    data = _tensor(torch.float8_e4m3fn, 256, [(7, 0)] if spoil == "data" else [], 1)
    scale = _tensor(torch.float8_e8m0fnu, 8, [(3, 0)] if spoil == "scale" else [], 2)
    check = FiniteCheck()
    check.add("layers.0.attn.wq_a.weight", QTensor(data.view(8, 32), scale.view(8, 1), "fp8_w", (8, 32)))
    name = "layers.0.attn.wq_a." + ("weight" if spoil == "data" else "scale")
    with pytest.raises(CheckpointError, match=f"tensor '{name}': 1 of"):
        check.finish()


@pytest.mark.parametrize("batch", [1, 2, 5])
def test_flags_are_read_back_a_batch_at_a_time(batch, monkeypatch):
    """The flags are read back every ``batch`` tensors (one ``tolist`` each): a bad tensor raises
    by the end of its batch, not only at :meth:`finish`."""
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(self.numel()) or real(self))
    check = FiniteCheck(batch=batch)
    for i in range(2 * batch):
        check.add(f"good{i}", torch.randn(16))
    assert reads == [batch, batch]
    for i in range(batch - 1):
        check.add(f"good{i}", torch.randn(16))
    with pytest.raises(CheckpointError, match="tensor 'bad'"):
        check.add("bad", torch.tensor([1.0, float("nan")]))


def test_a_bad_batch_size_is_named():
    with pytest.raises(ValueError, match="batch: expected a positive int, got 0"):
        FiniteCheck(batch=0)
