"""``flashrt tune --speculative MODEL``: refresh the speculative cost table of the written profile.

On top of (or, with ``--no-kernels``, instead of) the tile sweep of :mod:`flashrt.tune`, times a
plain decode step, the DSpark draft and verify steps of ``k = 1 .. block_size`` drafts of MODEL
(``tiny``, ``small`` or a checkpoint directory) at each batch size, CUDA-graph replays on a GPU
(:mod:`flashrt.engine.spec_costs`), and writes the ratios as the profile's ``speculative_costs``,
which the adaptive choice of ``k`` (``draft_tokens="auto"``) reads. Batch sizes: ``--speculative-batches``,
else those of the active profile's table, else 1, 8 and 64.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from flashrt import profiles, tune

DEFAULT_BATCHES = (1, 8, 64)


def batches_for(profile, given) -> list[int]:
    """The batch sizes to time: ``given``, else the profile table's, else :data:`DEFAULT_BATCHES`."""
    chosen = list(given) if given else sorted(profile.speculative_costs) or list(DEFAULT_BATCHES)
    bad = [b for b in chosen if not isinstance(b, int) or b < 1]
    if bad:
        raise ValueError(f"--speculative-batches: expected batch sizes >= 1, got {bad}")
    return sorted(set(chosen))


def speculative_costs(model_name: str, batches, device=None, prompt: int = 64, steps: int = 5, progress=None):
    """(``speculative_costs`` table, comment lines) measured for ``model_name`` on ``device``."""
    import torch

    from flashrt.engine import spec_costs
    from flashrt.engine.run import load_model

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = load_model(model_name, dev, quiet=True)
    if model.drafts is None or not model.cfg.dspark_block_size:
        raise ValueError(f"--speculative: {model_name} has no DSpark draft layers (dspark_block_size = 0)")
    table, rows = spec_costs.cost_table(model, batches, prompt, steps, progress)
    how = "CUDA-graph replays" if rows[0]["graphs"] else "eager static steps"
    notes = [f"speculative_costs: {model_name} on {dev.type}, {how}, prompt {prompt}, median of {steps}"]
    notes += [f"  batch {r['batch']}: decode {r['decode_ms']:.3f} ms, draft {r['draft_ms']:.3f} ms, verify "
              + ", ".join(f"k={k} {ms:.3f} ms" for k, ms in r["verify_ms"].items()) for r in rows]
    return table, notes


def cmd(args) -> int:
    if args.no_kernels and args.speculative is None:
        raise ValueError("--no-kernels: expected --speculative MODEL too (nothing would be tuned)")
    if args.speculative is None:
        return tune.cmd(args)
    if not 0 < args.budget < float("inf"):
        raise ValueError(f"--budget: expected seconds > 0, got {args.budget}")
    from flashrt.progress import Progress

    out = tune.out_file(args.out)
    out.check()  # before the timing: a path it may not write fails now
    base, results = profiles.active_profile(), []
    if not args.no_kernels:
        base, results = tune.tune(args.kernels, progress=Progress("tuning"), budget=args.budget)
    batches = batches_for(base, args.speculative_batches)
    with profiles.using(base):
        table, notes = speculative_costs(args.speculative, batches, args.device, progress=Progress("speculative"))
    # a profile file is named for its profile: a user file of the same name overrides a shipped one
    tuned = dataclasses.replace(base, speculative_costs=table, name=Path(args.out).stem)
    profiles.profile_from_mapping(tuned.to_dict(), args.out)  # the table passes the profile's checks
    written = tune.write_profile(tuned, results, out, notes)
    for r in results:
        print(tune.describe(r))
    print("\n".join(notes))
    print(f"wrote {written}")
    return 0


def add_tune(sub) -> None:
    from flashrt.argtypes import device, nonempty, positive_int

    p = tune.add_parser(sub)
    p.add_argument("--speculative", default=None, metavar="MODEL", type=nonempty("model"),
                   help="also time plain decode, draft and verify steps of MODEL (tiny, small or a checkpoint "
                        "directory) and write the profile's speculative_costs")
    p.add_argument("--speculative-batches", type=positive_int, nargs="+", default=None, metavar="B",
                   help="batch sizes for --speculative (default: the profile table's, else 1 8 64)")
    p.add_argument("--device", type=device, default=None, help="device for --speculative (default: cuda if present)")
    p.add_argument("--no-kernels", action="store_true", help="skip the tile sweep (with --speculative)")
    p.set_defaults(func=cmd)
