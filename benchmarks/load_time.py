"""Loading a built-in model: seconds for the whole load, with the NaN / Inf check of every weight
and without it, in one process (the checkpoint made first if it is missing).

    python benchmarks/load_time.py [--model small] [--device cuda] [--repeats 3] [--out F]

Each repeat loads the model with the check and then without it (``flashrt.load(...,
check_finite=False)``), after one untimed load that brings the files into the page cache; medians
of the repeats. ``check_share``: the check's part of the checked load, ``(checked - unchecked) /
checked``. On a GPU the time includes the copies to the device and ends after a synchronize. The
profile (``FLASHRT_PROFILE`` or the one selected for the device) decides the load-time layouts.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import flashrt
from flashrt.engine.run import BUILTIN, builtin_checkpoint
from results_io import write_json


def timed_load(path, device: torch.device, check: bool) -> tuple[float, str]:
    """Seconds of one load, and the name of the profile it loaded under."""
    t0 = time.perf_counter()
    model = flashrt.load(path, device=device, check_finite=check)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    name = model.profile.name
    del model
    return seconds, name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small", choices=sorted(BUILTIN))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats: expected at least 1, got {args.repeats}")
    device = torch.device(args.device)
    path = builtin_checkpoint(args.model, 0, True)
    _, profile = timed_load(path, device, True)  # page cache, imports, the device's context
    runs = {True: [], False: []}
    for _ in range(args.repeats):
        for check in (True, False):
            runs[check].append(timed_load(path, device, check)[0])
    checked, unchecked = statistics.median(runs[True]), statistics.median(runs[False])
    result = {"model": args.model, "device": str(device), "profile": profile, "cpu_threads": torch.get_num_threads(),
              "command": "python benchmarks/load_time.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()
                                                                     if k != "out" and v is not None),
              "checked_s": checked, "unchecked_s": unchecked, "check_share": (checked - unchecked) / checked,
              "runs": {"checked": runs[True], "unchecked": runs[False]}}
    print(f"{args.model} on {device} ({profile} profile): {checked:.2f} s checked, {unchecked:.2f} s unchecked "
          f"(the check {100 * result['check_share']:.0f}% of the load)")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
