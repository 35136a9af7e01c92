"""The ``flashrt`` command line."""
from __future__ import annotations

import json
import os
import platform
import sys
import traceback
from importlib import metadata

import torch

from flashrt import __version__, dispatch
from flashrt.errors import FlashrtError

from flashrt.argtypes import Parser, nonempty


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cuda_devices() -> dict:
    if not torch.cuda.is_available():
        why = "torch built without CUDA" if torch.version.cuda is None else "no CUDA device visible"
        return {"available": False, "reason": why, "devices": []}
    devices = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        devices.append({"index": i, "name": p.name, "capability": f"sm_{p.major}{p.minor}",
                        "memory_gib": round(p.total_memory / 2**30, 1), "multiprocessors": p.multi_processor_count})
    return {"available": True, "reason": "", "devices": devices}


def _npu_devices() -> dict:
    if _version("torch-npu") is None and _version("torch_npu") is None:
        return {"available": False, "reason": "torch_npu not installed", "devices": []}
    npu = getattr(torch, "npu", None)
    if npu is None or not npu.is_available():
        return {"available": False, "reason": "torch_npu installed but no NPU visible", "devices": []}
    return {"available": True, "reason": "", "devices": [{"index": i, "name": npu.get_device_name(i)}
                                                            for i in range(npu.device_count())]}


def _ascend_versions() -> dict:
    """torch_npu, CANN and SoC versions (imports torch_npu only when it is installed)."""
    from flashrt.backends.ascend import versions

    return versions()


def _probe(device: str | None) -> dict:
    """Run every op once on ``device`` through the automatic choice (the conformance cases), so the
    fallbacks it takes are seen; a summary of the conformance report."""
    from flashrt import conformance

    report = conformance.run(device)
    return {"device": report["device"], "passed": report["passed"], "total": report["total"],
            "failed": [r["op"] for r in report["rows"] if not r["pass"]]}


def doctor_report(probe: bool = False, device: str | None = None) -> dict:
    """Everything ``flashrt doctor`` prints, as a dict; ``probe`` first runs every op on ``device``."""
    from flashrt.hwconfigs import profile_files as shipped_profiles

    probed = _probe(device) if probe else None
    ascend = _ascend_versions()
    return {
        "flashrt": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {
            "torch": torch.__version__,
            "triton": _version("triton"),
            "torch_npu": _version("torch-npu") or _version("torch_npu") or ascend.get("torch_npu"),
            "cann": ascend.get("cann"),
            "npu_soc_version": ascend.get("soc_version"),
            "cuda_runtime": torch.version.cuda,
        },
        "devices": {"cpu": {"available": True, "cores": os.cpu_count()}, "cuda": _cuda_devices(), "npu": _npu_devices()},
        "backends": [s.__dict__ for s in dispatch.available()],
        "families": {name: [f.name for f in fams] for name, fams in dispatch.families().items()},
        "plugin_errors": dispatch.load_errors(),
        "probe": probed,
        "fallbacks": dispatch.fallbacks(),
        "explicit_backend": dispatch.current_choice(),
        "profiles": _profile_report(sorted(shipped_profiles())),
    }


def _profile_report(shipped: list[str]) -> dict:
    from flashrt import profiles

    try:
        profile, reason = profiles.select_profile()
        chosen = {"name": profile.name, "source": profile.source, "reason": reason,
                  "extends": list(profile.lineage[1:])}  # the profiles it takes its other keys from
        error = None
    except FlashrtError as exc:  # a bad profile is reported, not fatal: the rest of doctor still helps
        chosen, error = None, str(exc)
    return {"shipped": shipped, "available": profiles.available_profiles(),
            "user_dir": str(profiles.user_profile_dir()), "chosen": chosen, "error": error,
            "broken": profiles.broken_profiles()}


def _print_doctor(r: dict) -> None:
    v = r["versions"]
    print(f"flashrt {r['flashrt']}  python {r['python']}  ({r['platform']})")
    print("versions: " + ", ".join(f"{k} {v[k] or 'not installed'}" for k in ("torch", "triton", "torch_npu", "cann")))
    print("devices:")
    print(f"  cpu   {r['devices']['cpu']['cores']} cores")
    for kind in ("cuda", "npu"):
        d = r["devices"][kind]
        if not d["available"]:
            print(f"  {kind:5} not available ({d['reason']})")
        for dev in d["devices"]:
            extra = ", ".join(f"{k} {val}" for k, val in dev.items() if k not in ("index", "name"))
            print(f"  {kind}:{dev['index']} {dev['name']}" + (f" ({extra})" if extra else ""))
    print("backends (automatic order):")
    for b in r["backends"]:
        state = "available" if b["available"] else "unavailable"
        print(f"  {b['name']:10} {state:12} devices {','.join(b['device_types'])}; {len(b['ops'])} ops")
        if not b["available"]:
            print(f"  {'':10} why: {b['reason']}")
        if b["name"] in r["families"]:
            print(f"  {'':10} families: {', '.join(r['families'][b['name']])}")
        if b["ops"]:
            print(f"  {'':10} ops: {', '.join(b['ops'])}")
    _print_fallbacks(r)
    for name, err in r["plugin_errors"].items():
        print(f"  {name:10} failed to load: {err}")
    if r["explicit_backend"]:
        print(f"explicit backend: {r['explicit_backend']} (FLASHRT_BACKEND)")
    p = r["profiles"]
    print(f"profiles: {', '.join(p['available'])} (user profiles: {p['user_dir']})")
    if p["chosen"]:
        bases = "".join(f", extends {b}" for b in p["chosen"]["extends"])
        print(f"profile: {p['chosen']['name']}{bases} ({p['chosen']['reason']})")
    else:
        print(f"profile: error: {p['error']}")
    for error in p["broken"].values():
        print(f"profile skipped: {error}")


def _print_fallbacks(r: dict) -> None:
    if r["probe"]:
        p = r["probe"]
        failed = f"; failed: {', '.join(p['failed'])}" if p["failed"] else ""
        print(f"probe: every op once on {p['device']}: {p['passed']}/{p['total']} conform{failed}")
    if not r["fallbacks"]:
        seen = "none" if r["probe"] else "none in this process (--probe runs every op once)"
        print(f"fallbacks seen: {seen}")
        return
    print("fallbacks seen (a call one backend declines and the next serves):")
    for f in r["fallbacks"]:
        print(f"  {f['op']} on {f['device_type']}: {f['declined_by']} declines ({f['reason']}); "
              f"{f['served_by']} serves it ({f['keys']} call shapes)")


def cmd_doctor(args) -> int:
    report = doctor_report(args.probe, args.device)
    if args.json:
        json.dump(report, sys.stdout, indent=2, default=str)
        print()
    else:
        _print_doctor(report)
    return 0 if report["profiles"]["chosen"] else 1


def build_parser() -> Parser:
    parser = Parser(prog="flashrt", description="DeepSeek-V4.1-Flash inference runtime")
    parser.add_argument("--version", action="version", version=f"flashrt {__version__}")
    parser.add_argument("--profile", default=None, type=nonempty("profile"),
                        help="hardware profile name or YAML path (default: auto)")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="devices, backends and their availability, versions")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument("--probe", action="store_true",
                        help="run every op once (the conformance cases) and list the fallbacks taken")
    doctor.add_argument("--device", default=None, help="the device --probe runs on (default: cuda if present)")
    doctor.set_defaults(func=cmd_doctor)
    from .model import add_plan, add_run

    add_run(sub)
    add_plan(sub)
    from .inspect import add_inspect

    add_inspect(sub)
    from flashrt.conformance import add_parser as add_conformance

    add_conformance(sub)
    from .tune_speculative import add_tune

    add_tune(sub)
    from .jit import add_jit

    add_jit(sub)
    from .bench import add_bench

    add_bench(sub)
    from .serve import add_serve

    add_serve(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    debug = getattr(args, "debug", False) or os.environ.get("FLASHRT_DEBUG") == "1"
    try:
        _merge_profile_options(args)
        if args.profile:  # honoured by every command and inherited by child processes
            _use_profile_option(args)
        _apply_memory_limit(args)
        return args.func(args)
    except BrokenPipeError:  # `flashrt doctor | head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        return _fail(args.command, "interrupted", debug, 130)
    except (ValueError, FlashrtError) as exc:  # bad input: one clear line, no traceback
        return _fail(args.command, f"error: {exc}", debug, 2)
    except OSError as exc:  # a file that cannot be read or written, a full disk
        return _fail(args.command, f"error: {exc}", debug, 1)
    except Exception as exc:  # a bug: still one line, the traceback on request
        return _fail(args.command, f"internal error: {type(exc).__name__}: {exc} "
                     "(run again with --debug for the traceback)", debug, 1)


def _merge_profile_options(args) -> None:
    """``flashrt run --profile X`` means ``flashrt --profile X run``; two different values are an error."""
    given = getattr(args, "command_profile", None)
    if given is None:
        return
    if args.profile is not None and args.profile != given:
        raise ValueError(f"--profile: given twice with different values, {args.profile!r} before the command "
                         f"and {given!r} after it; expected one")
    args.profile = given


def _apply_memory_limit(args) -> None:
    """``--memory-limit``: cap the device memory of this process (flashrt.memory_cap) before anything loads."""
    limit = getattr(args, "memory_limit", None)
    if limit is None:
        return
    if getattr(args, "tp", 1) != 1 or getattr(args, "ep", 1) != 1:
        raise ValueError("--memory-limit: expected a single-device run, got --tp / --ep (each rank is its own "
                         "process; the cap applies to this one only)")
    from flashrt import memory_cap

    memory_cap.apply(limit, args.device)


def _use_profile_option(args) -> None:
    from flashrt import profiles

    if args.command != "doctor":  # doctor reports a bad profile; the others stop before starting
        load_profile_option(args.profile)
    os.environ["FLASHRT_PROFILE"] = args.profile
    profiles.use_profile(None)


def load_profile_option(value: str):
    """The profile a ``--profile`` option names; its error says which option it came from."""
    from flashrt import profiles
    from flashrt.errors import ProfileError

    try:
        return profiles.load_profile(value)
    except ProfileError as exc:
        raise ProfileError(f"--profile: {exc}") from None


def _fail(command: str, message: str, debug: bool, code: int) -> int:
    """Print ``flashrt COMMAND: MESSAGE`` as one line (after the traceback with --debug)."""
    if debug:
        traceback.print_exc()
    print(f"flashrt {command}: {' '.join(message.splitlines())}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
