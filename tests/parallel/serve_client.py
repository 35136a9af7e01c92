"""A client for the ``flashrt serve --tp / --ep`` tests: HTTP calls, and a server run in this process."""
import json
import os
import threading
import time
import urllib.error
import urllib.request

import pytest

from flashrt.engine.launch import RankError
from flashrt.engine.parallel_serve_run import serve_parallel


def post(port, body, timeout=120):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def get(port, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return r.read().decode()


def wait_ready(port, limit_s=240):
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        try:
            if json.loads(get(port, "/health"))["status"] == "ok":
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError("the server did not come up")


def serve(job, client):
    """Run the server of ``job`` until it stops while ``client(pids)`` talks to it from a thread; the
    ranks' process ids and a box with its exit status (or the launcher's RankError)."""
    pids, box = [], {}

    def run_client():
        try:
            wait_ready(job.port)
            client(pids)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            box["client"] = exc
    threading.Thread(target=run_client, daemon=True).start()
    try:
        box["exit"] = serve_parallel(job, on_event=lambda event, ranks: pids.__setitem__(slice(None), ranks))
    except RankError as exc:
        box["error"] = exc
    if "client" in box:
        raise box["client"]
    return pids, box


def gone(pids):
    """Every one of ``pids`` has exited."""
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
