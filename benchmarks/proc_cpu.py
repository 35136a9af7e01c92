"""CPU seconds of a process tree by process and thread, read from ``/proc`` (Linux): which thread of
a server saturates a core while it serves.

``snapshot(pid)`` records every thread's user + system time of ``pid`` and its descendants;
``busiest(before, after, seconds)`` gives each process's CPU seconds over the interval and its
threads' shares of the interval's wall time (1.0: a thread that ran all the time, the bound of a
thread holding Python's GIL)."""
from __future__ import annotations

import os

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # the process or thread ended meanwhile
        return None


def _children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
        text = _read(f"/proc/{pid}/task/{tid}/children")
        out += [int(c) for c in (text or "").split()]
    return out


def _cpu(stat: str) -> float:
    """utime + stime (seconds) of a ``/proc/.../stat`` line (fields after the ``(comm)``)."""
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def snapshot(pid: int) -> dict:
    """``{pid: (command, {tid: (thread name, cpu seconds)})}`` over ``pid`` and its descendants."""
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        comm = (_read(f"/proc/{p}/cmdline") or "").replace("\0", " ").strip()[:120]
        threads = {}
        for tid in os.listdir(f"/proc/{p}/task") if os.path.isdir(f"/proc/{p}/task") else []:
            stat, name = _read(f"/proc/{p}/task/{tid}/stat"), _read(f"/proc/{p}/task/{tid}/comm")
            if stat:  # the main thread marked as such (Python's own threads carry the program's name)
                threads[int(tid)] = ("main" if int(tid) == p else (name or "").strip(), _cpu(stat))
        out[p] = (comm, threads)
        todo += _children(p)
    return out


def busiest(before: dict, after: dict, seconds: float, top: int = 4) -> list[dict]:
    """Per process in ``after``: CPU seconds over the interval and its ``top`` threads' shares of ``seconds``."""
    rows = []
    for pid, (comm, threads) in after.items():
        old = before.get(pid, ("", {}))[1]
        used = {tid: (name, cpu - old.get(tid, ("", 0.0))[1]) for tid, (name, cpu) in threads.items()}
        ranked = sorted(used.items(), key=lambda kv: -kv[1][1])[:top]
        rows.append({"pid": pid, "command": comm, "cpu_s": round(sum(c for _, c in used.values()), 3),
                     "threads": [{"tid": tid, "name": name, "share": round(c / seconds, 3) if seconds else 0.0}
                                 for tid, (name, c) in ranked]})
    return sorted(rows, key=lambda r: -r["cpu_s"])
