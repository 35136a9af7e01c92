"""``flashrt run --tp / --ep``: the ranks start themselves, follow rank 0, and a dead rank is named."""
import functools
import os
import re
import signal
import time

import pytest
from parallel_text import random_text
import torch

from flashrt.cli.commands import main
from flashrt.engine import parallel_run
from flashrt.engine.launch import RankError, launch
from flashrt.engine.parallel_run import run_parallel
from flashrt.engine.run import run


def _text(rng, n=8):
    return random_text(rng, n) + " fox"


def test_run_on_two_ranks_matches_one_device(cache, rng, capsys):
    prompt = _text(rng)
    one = run("tiny", prompt, 4, quiet=True)
    assert main(["run", "--tp", "2", "--prompt", prompt, "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert f"ids {one['new_token_ids']}" in out  # rank 0 printed the same greedy tokens
    assert "parallel: tp 2 x ep 1 = 2 ranks over gloo" in out
    assert main(["run", "--tp", "3"]) == 2  # bad input: one line naming the argument, no ranks started
    assert "tp: expected a divisor of n_heads=4" in capsys.readouterr().err


def test_a_rank_killed_mid_decode_is_named(cache, rng):
    """Rank 1 is killed at its second decode step; rank 0 must not hang: the run ends well before
    the collective timeout with an error naming rank 1."""
    def kill_rank_1(event, pids):
        if event[0] == "progress" and event[1] == 1 and event[2] == "decode" and event[3] == 2:
            os.kill(pids[1], signal.SIGKILL)

    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 was killed by SIGKILL \(last step: decode 2\)") as err:
        run_parallel("tiny", _text(rng), 50, tp=1, ep=2, quiet=True, timeout_s=60, on_event=kill_rank_1)
    assert err.value.rank == 1
    assert time.monotonic() - t0 < 50  # far inside the 60 s collective timeout, start-up included


def test_a_hung_rank_ends_every_rank_within_the_timeout(cache, rng, monkeypatch, capsys):
    """Rank 1 stops (SIGSTOP: alive, silent) at its second decode step. Rank 0 gives up after the
    4 s collective timeout, the launcher names rank 1, stops every rank process (the stopped one
    included) and ``flashrt run`` exits non-zero with that error."""
    pids, stopped = [], []

    def stop_rank_1(event, ranks):
        pids[:] = ranks
        if event[0] == "progress" and event[1] == 1 and event[2] == "decode" and event[3] == 2:
            os.kill(ranks[1], signal.SIGSTOP)
            stopped.append(time.monotonic())

    monkeypatch.setattr(parallel_run, "run_parallel", functools.partial(run_parallel, on_event=stop_rank_1))
    code = main(["run", "--tp", "2", "--prompt", _text(rng), "--max-new-tokens", "40", "--collective-timeout", "4"])
    ended = time.monotonic()
    assert code == 2  # the CLI's status for a FlashrtError (RankError)
    err = capsys.readouterr().err
    assert re.search(r"rank 1 stopped answering \(last step: decode \d+\): rank 0 gave up on it after the 4 s "
                     r"collective timeout; every rank was stopped", err), err
    assert stopped and 4 <= ended - stopped[0] < 4 + 20  # the timeout, then the teardown (a busy machine)
    assert len(pids) == 2
    for pid in pids:  # no rank process is left, not even the stopped one
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


class _Gone:
    """A finished rank process, as the launcher sees it."""

    def __init__(self, exitcode):
        self.exitcode, self.pid = exitcode, 0

    def is_alive(self):
        return False


def test_the_launcher_blames_the_right_rank():
    """What the launcher concludes from its ranks' events: a rank's own failure, a rank that went
    silent while its peers timed out, a rank that died."""
    import queue

    from flashrt.engine.launch import _watch

    def outcome(procs, events):
        q = queue.Queue()
        for e in events:
            q.put(e)
        with pytest.raises(RankError) as err:
            _watch(procs, q, 7.0, None, grace_s=0.2)
        return err.value

    failed = outcome([_Gone(0), _Gone(0)], [("progress", 1, "prefill", 1),
                                            ("error", 1, "ValueError: bad shard", False, "")])
    assert failed.rank == 1 and "rank 1 failed (last step: prefill 1): ValueError: bad shard" in str(failed)
    silent = _Gone(None)  # still running, never answered
    hung = outcome([_Gone(0), silent, _Gone(0)], [("progress", 1, "decode", 3),
                                                  ("error", 0, "CollectiveError: timed out", True, ""),
                                                  ("error", 2, "CollectiveError: timed out", True, "")])
    assert hung.rank == 1 and "rank 1 stopped answering (last step: decode 3): rank 0 gave up on it after the " \
        "7 s collective timeout" in str(hung)
    dead = outcome([_Gone(0), _Gone(-9)], [("error", 0, "CollectiveError: connection closed", True, "")])
    assert dead.rank == 1 and "rank 1 was killed by SIGKILL (before its first step)" in str(dead)
