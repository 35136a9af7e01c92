"""flashrt.distributed: the collective backend follows the device; gloo collectives on CPU."""
import socket

import pytest
import torch
import torch.multiprocessing as mp

from flashrt import distributed


def test_backend_follows_the_device():
    assert distributed.backend_for("npu") == "hccl"
    assert distributed.backend_for(torch.device("cuda", 1)) == "nccl"
    assert distributed.backend_for("cpu") == "gloo"
    with pytest.raises(ValueError, match="device"):
        distributed.backend_for("mps")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out) -> None:
    assert distributed.init("cpu", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}") == "gloo"
    try:
        t = torch.full((3,), float(rank + 1))
        distributed.all_reduce(t)
        g = distributed.all_gather(torch.tensor([rank]))
        b = distributed.broadcast(torch.tensor([rank * 10 + 7]), src=1)
        result = (t.tolist(), g.tolist(), b.tolist(), distributed.world_size())
        if isinstance(out, dict):
            out[rank] = result
        else:  # a folder: one file per rank (cheaper than a multiprocessing manager)
            (out / f"{rank}.txt").write_text(repr(result))
    finally:
        distributed.shutdown()


def test_one_process_group_of_one():
    out = {}
    _worker(0, 1, _free_port(), out)
    assert out[0] == ([1.0, 1.0, 1.0], [0], [7], 1)


def test_two_processes_over_gloo(tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), tmp_path), nprocs=2, join=True)
    for rank in (0, 1):
        assert (tmp_path / f"{rank}.txt").read_text() == repr(([3.0, 3.0, 3.0], [0, 1], [17], 2))
