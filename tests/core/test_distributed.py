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


def _silent_peer(rank: int, port: int, out) -> None:
    """Rank 1 joins and then never answers; rank 0 all-reduces over a sub-group (2 s timeout)."""
    import time

    distributed.init("cpu", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}", timeout_s=2)
    group = distributed.new_group([0, 1])
    if rank == 1:
        time.sleep(30)
        return
    t0 = time.monotonic()
    try:
        distributed.all_reduce(torch.ones(4), group=group)
    except distributed.CollectiveError as exc:
        waited, first = time.monotonic() - t0, str(exc)
    t1 = time.monotonic()
    try:
        distributed.all_gather(torch.ones(2))
    except distributed.CollectiveError as exc:
        again, second = time.monotonic() - t1, str(exc)
    (out / "0.txt").write_text(repr((waited, first, again, second, distributed.failure() is not None)))
    import os
    os._exit(0)  # leave without tearing the group down with a silent peer


def test_a_sub_group_gives_up_after_the_timeout_and_the_group_stays_broken(tmp_path):
    """A new group waits as long as init's timeout (torch's default for new groups is 30 min), and
    after one failure every collective raises at once."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_silent_peer, args=(r, port, tmp_path), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    procs[0].join(60)
    for p in procs:
        p.kill()
        p.join()
    waited, first, again, second, broken = eval((tmp_path / "0.txt").read_text())
    assert 1.5 <= waited < 15 and "rank 0: all_reduce failed" in first and "collective timeout" in first
    assert again < 1 and "rank 0: all_gather not run: an earlier collective failed" in second and broken
