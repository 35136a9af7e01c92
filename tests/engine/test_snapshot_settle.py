"""A snapshot's host tensors arrive by one packed copy (engine/snapshot.py): the packing keeps
every tensor (dtype, shape, bytes) at its aligned offset, and a snapshot whose copy went to
page-locked memory moves out of it once the copy is done, without waiting when asked not to."""
import torch

from flashrt.engine.snapshot import RowSnapshot, _layout, _to_host, _views


class _Copy:
    """Stands in for the CUDA event of the copy: done after ``polls`` queries."""

    def __init__(self, polls: int):
        self.polls, self.waited = polls, False

    def query(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def synchronize(self):
        self.waited = True


def _parts(rng):
    return {"ring.data": torch.randint(0, 256, (5, 33), generator=rng, dtype=torch.uint8),
            "start": torch.randint(-9, 9, (), generator=rng),
            "kv": torch.randn(3, 7, generator=rng),
            "history": torch.randint(0, 99, (6,), generator=rng, dtype=torch.int64),
            "empty": torch.zeros(0, 16, dtype=torch.uint8)}


def test_packing_keeps_every_tensor_at_an_aligned_offset(rng):
    parts = _parts(rng)
    snap = _to_host(parts, torch.device("cpu"))
    assert snap.ready is None and snap.pinned is None
    for name, x in parts.items():
        got = snap.tensors[name]
        assert got.dtype == x.dtype and got.shape == x.shape and torch.equal(got, x)
        assert got.data_ptr() != x.data_ptr() or x.numel() == 0  # a copy: the state writes on
        assert (got.data_ptr() - snap.tensors["ring.data"].data_ptr()) % 8 == 0


def test_an_unsettled_snapshot_moves_out_of_its_buffer_once_the_copy_is_done(rng):
    parts = _parts(rng)
    packed = _to_host(parts, torch.device("cpu"))
    buf = packed.tensors["ring.data"].untyped_storage()
    layout, _ = _layout(parts)  # the layout _to_host packed by
    flat = torch.empty(0, dtype=torch.uint8).set_(buf)
    cold = {"cold.main": torch.arange(4)}
    snap = RowSnapshot(7, {**_views(flat, layout), **cold}, _Copy(polls=2), (flat, layout))
    assert not snap.settle() and not snap.settle()  # the copy is still in flight: no wait
    assert snap.settle() and snap.ready is None and snap.pinned is None
    for name, x in parts.items():
        assert torch.equal(snap.host[name], x) and snap.host[name].untyped_storage().data_ptr() != buf.data_ptr()
    assert snap.host["cold.main"] is cold["cold.main"]  # parts that were on the host already stay
    waited = RowSnapshot(7, _views(flat, layout), _Copy(polls=5), (flat, layout))
    assert torch.equal(waited.tensors["kv"], parts["kv"]) and waited.ready is None  # reading waits
