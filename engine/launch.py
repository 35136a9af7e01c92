"""Start the ranks of a multi-device run on this host, or join the ones ``torchrun`` started.

:func:`launch` runs ``target(rank, *args, report=...)`` on every rank inside a process group (gloo on
CPU, nccl on CUDA, hccl on Ascend: :mod:`flashrt.distributed`) and returns every rank's result.
Started here, each rank is a spawned process on ``127.0.0.1`` (one device each: ``cuda:LOCAL_RANK``
/ ``npu:LOCAL_RANK``, or the CPU); under ``torchrun`` (``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``
set) this process is one rank and runs ``target`` itself.

A rank that dies or fails ends the run: the launcher stops every other rank and raises
:class:`RankError` naming it (a killed rank by its signal, a rank that stopped answering by the
collective timeout its peers hit, with the last step each rank reported).
"""
from __future__ import annotations

import collections
import os
import queue as queue_mod
import signal
import socket
import time
import traceback

import torch
import torch.multiprocessing as mp
from multiprocessing.connection import wait as wait_readable

from flashrt import distributed
from flashrt.errors import CollectiveError, FlashrtError


class RankError(FlashrtError):
    """A rank of a multi-device run died, failed or stopped answering; names the rank."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def rank_device(kind: str, local_rank: int) -> torch.device:
    """The device of one local rank: ``cuda:i`` / ``npu:i``, or the CPU."""
    if kind == "cpu":
        return torch.device("cpu")
    module = torch.cuda if kind == "cuda" else getattr(torch, kind, None)  # torch.npu once torch_npu is loaded
    count = module.device_count() if module is not None else 0
    if local_rank >= count:
        raise ValueError(f"device: rank {local_rank} needs {kind}:{local_rank}, torch sees {count} {kind} device(s)")
    module.set_device(local_rank)
    return torch.device(kind, local_rank)


class _RankPipes:
    """The launcher's end of one event pipe per rank, read as one queue (``get(timeout)``).

    A pipe per rank rather than one shared queue: a shared ``multiprocessing.Queue`` has one write
    lock for all writers, so a rank stopped while its feeder thread holds that lock would keep every
    other rank's events, its collective-timeout error included, from ever arriving."""

    def __init__(self, readers):
        self.open, self.ready = list(readers), collections.deque()

    def get(self, timeout: float):
        if not self.ready and self.open:
            for reader in wait_readable(self.open, timeout):
                try:
                    self.ready.append(reader.recv())
                except (EOFError, OSError):  # the rank closed its end (exited)
                    self.open.remove(reader)
        elif not self.ready:
            time.sleep(timeout)
        if not self.ready:
            raise queue_mod.Empty
        return self.ready.popleft()


def _entry(rank, world, port, kind, pipe, target, args, timeout_s):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    report = lambda phase, done, total=None: pipe.send(("progress", rank, phase, done))  # noqa: E731
    try:
        device = rank_device(kind, rank)
        distributed.init(device, rank=rank, world_size=world, timeout_s=timeout_s)
        result = target(rank, device, *args, report=report)
        pipe.send(("done", rank, result))
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the launcher, by rank
        collective = isinstance(exc, CollectiveError) or isinstance(exc.__cause__, CollectiveError)
        pipe.send(("error", rank, f"{type(exc).__name__}: {exc}", collective, traceback.format_exc()))
    finally:
        try:
            distributed.shutdown()
        except Exception:  # noqa: BLE001 - the group may be broken already
            pass


def launch(target, world: int, args: tuple = (), *, device: str = "cpu", timeout_s: float = 600.0,
           on_event=None) -> list:
    """Run ``target(rank, device, *args, report=report)`` on ``world`` ranks; every rank's result, by rank.

    ``timeout_s``: the collective timeout (a rank waiting longer for its peers fails).
    ``on_event(event, pids)``: called with each event a rank sends (``("progress", rank, phase, step)``,
    ``("done", rank, result)``, ...) and the ranks' process ids. Under ``torchrun`` only this
    process's rank runs; the list holds its result alone."""
    if under_torchrun():
        rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        if int(os.environ["WORLD_SIZE"]) != world:
            raise ValueError(f"world: torchrun started {os.environ['WORLD_SIZE']} ranks, the layout needs {world}")
        dev = rank_device(device, local)
        distributed.init(dev, timeout_s=timeout_s)
        try:
            return [target(rank, dev, *args, report=lambda *a, **k: None)]
        finally:
            distributed.shutdown()
    ctx = mp.get_context("spawn")
    port = free_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
    procs = [ctx.Process(target=_entry, args=(r, world, port, device, pipes[r][1], target, args, timeout_s), daemon=True)
             for r in range(world)]
    for p, (_, writer) in zip(procs, pipes):
        p.start()
        writer.close()  # the rank holds its end: the pipe reads EOF once the rank exits
    try:
        return _watch(procs, _RankPipes([reader for reader, _ in pipes]), timeout_s, on_event)
    finally:
        _stop(procs)
        for reader, _ in pipes:
            reader.close()


def _watch(procs, events, timeout_s: float, on_event, grace_s: float = 3.0) -> list:
    """Collect results until every rank is done; on the first failure name the rank and raise."""
    world, results, last, exited = len(procs), {}, {}, {}
    pids = [p.pid for p in procs]
    while len(results) < world:
        try:
            event = events.get(timeout=0.2)
        except queue_mod.Empty:
            event = None
        if event is not None:
            if on_event is not None:
                on_event(event, pids)
            kind, rank = event[0], event[1]
            if kind == "progress":
                last[rank] = f"{event[2]} {event[3]}"
            elif kind == "done":
                results[rank] = event[2]
            elif kind == "error":
                raise _blame(procs, events, last, rank, event[2], event[3], timeout_s, grace_s)
            continue
        for r, p in enumerate(procs):  # gone without a result (its last events get a second to arrive)
            if r not in results and p.exitcode is not None:
                if time.monotonic() - exited.setdefault(r, time.monotonic()) > 1.0:
                    raise _blame(procs, events, last, r, None, False, timeout_s, grace_s)
    return [results[r] for r in range(world)]


def _died(p) -> str:
    code = p.exitcode
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


def _blame(procs, events, last, rank, message, collective: bool, timeout_s: float, grace_s: float) -> RankError:
    """The error that names the rank at fault: a rank that died, else one that stopped answering
    (a peer's collective timed out while it reported no failure), else the rank that failed."""
    deadline = time.monotonic() + grace_s  # let the other ranks' failures arrive (a death shows first as a peer's error)
    errors = {rank: message} if message is not None else {}
    while time.monotonic() < deadline and len(errors) < len(procs):
        try:
            event = events.get(timeout=0.2)
        except queue_mod.Empty:
            continue
        if event[0] == "error":
            errors[event[1]] = event[2]
        elif event[0] == "progress":
            last[event[1]] = f"{event[2]} {event[3]}"
    where = lambda r: f" (last step: {last[r]})" if r in last else " (before its first step)"  # noqa: E731
    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in errors]
    if dead:
        r = dead[0]
        return RankError(f"rank {r} {_died(procs[r])}{where(r)}; every rank was stopped", r)
    silent = [r for r in range(len(procs)) if r not in errors]
    if collective and silent:
        r = silent[0]
        return RankError(f"rank {r} stopped answering{where(r)}: rank {rank} gave up on it after the "
                         f"{timeout_s:g} s collective timeout; every rank was stopped", r)
    return RankError(f"rank {rank} failed{where(rank)}: {message}", rank)


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGCONT)  # a stopped process acts on SIGTERM only once continued
            p.terminate()
    end = time.monotonic() + 5.0
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
