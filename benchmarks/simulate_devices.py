"""Smaller cards simulated on a larger one: ``flashrt run`` and ``flashrt conformance`` under each
card's profile with the device memory capped to the card's size, one report per card.

    python benchmarks/simulate_devices.py --out-dir hwconfigs/reports        # on the H200

For each card (default ``rtx4090 a100 h100``), each step its own ``flashrt`` process:

- ``flashrt run --profile CARD --memory-limit SIZE --model small --json``: a short greedy decode
  through the code path of ``flashrt run``, its tokens compared with the same prompt run on this
  device with no profile override and no cap (the baseline, run first); each is run once before
  (``--warmup-runs``) so that the decode speed reported is not the kernels' compile time;
- ``flashrt conformance --profile CARD --memory-limit SIZE``: every op against the reference.

SIZE is the card's ``device_memory_gib`` from its profile. A card's report
(``OUT_DIR/CARD-simulated-on-HOST.json``) records the profile, the cap, peak memory, the KV budget
and cold tier chosen, the backend per op family and the tiles of each kernel family, decode
tokens/s, conformance per op, the greedy-token comparison, and the label "simulated on HOST
(memory cap, kernel path)": what ran is this device's silicon under the card's profile and memory,
not the card. A step that fails is recorded with its error and the next card still runs; each
report is written when its card is done (a run stopped midway keeps the cards done). Only the
report files are written (the steps' own output goes to a temporary directory); a report of an
earlier run at the same path is replaced.

``--device cpu`` runs the same steps on the CPU (no cap: the label says so), a smoke test of the
script; its reports are named ``CARD-simulated-on-cpu.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from results_io import write_json

CARDS = ("rtx4090", "a100", "h100")
PROMPT = "The quick brown fox jumps over the lazy dog. In the beginning"


def flashrt(args: list[str], timeout: float) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``python -m flashrt.cli *args`` with no profile from the
    environment (each step names its own)."""
    env = {k: v for k, v in os.environ.items() if k != "FLASHRT_PROFILE"}
    try:
        p = subprocess.run([sys.executable, "-m", "flashrt.cli", *args], capture_output=True, text=True,
                           timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return 124, "", f"timed out after {timeout:g} s"
    return p.returncode, p.stdout, p.stderr


def step_error(code: int, err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    return f"exit {code}: " + (lines[-1] if lines else "no output")


def run_step(common: list[str], profile_args: list[str], timeout: float, warmups: int = 0) -> dict:
    """``flashrt run ... --json``: its report, or ``{"error": ...}``. ``warmups`` runs of the same
    command go first, so the kernels the profile's tiles need are compiled (Triton's cache) before
    the run whose decode speed is reported."""
    for _ in range(warmups + 1):
        code, out, err = flashrt(["run", *common, *profile_args, "--json"], timeout)
        if code != 0:
            return {"error": step_error(code, err)}
    try:
        return json.loads(out)
    except ValueError:
        return {"error": f"exit 0 but no JSON report on stdout: {out[-200:]!r}"}


def conformance_step(device: str, profile_args: list[str], tmp: Path, timeout: float) -> dict:
    """``flashrt conformance ... --out``: its report (also when some op fails), or ``{"error": ...}``."""
    out = tmp / "conformance.json"
    out.unlink(missing_ok=True)
    code, _, err = flashrt(["conformance", "--device", device, *profile_args, "--out", str(out)], timeout)
    if code not in (0, 1) or not out.exists():
        return {"error": step_error(code, err)}
    return json.loads(out.read_text())


def compare_tokens(got: list[int], want: list[int]) -> dict:
    """Greedy tokens of a simulated run against the baseline's."""
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if first is None and len(got) != len(want):
        first = min(len(got), len(want))
    same = sum(a == b for a, b in zip(got, want))
    return {"simulated": got, "baseline": want, "identical": first is None, "first_difference": first,
            "agreement": same / max(len(want), 1)}


def linear_path(tiles: dict, fp8_tensor_cores: bool | None) -> str:
    """The path of the fp8_w linear kernel under ``tiles`` on a device with or without FP8 tensor
    cores (``tiles["fp8_mma"]`` None: the device decides; ``fp8_tensor_cores`` None: unknown)."""
    forced = tiles.get("fp8_mma")
    fp8 = fp8_tensor_cores if forced is None else bool(forced)
    return "unknown" if fp8 is None else "fp8 tl.dot" if fp8 else "bf16 tl.dot (fp8 dequantized in registers)"


def path_caveats(profile: dict, kernel_paths: dict, host_fp8: bool | None) -> list[str]:
    """Where a kernel path taken here would differ on the card itself."""
    caps = [tuple(map(int, c.split("."))) for c in profile.get("match_capability") or []]
    if not caps or host_fp8 is None or "linear" not in kernel_paths:
        return []
    tiles = kernel_paths["linear"]["tiles"]
    card = linear_path(tiles, all(c >= (8, 9) for c in caps))
    here = linear_path(tiles, host_fp8)
    if card == here:
        return []
    return [f"linear fp8_w: {here} here, {card} on the card (compute capability "
            f"{'/'.join(profile['match_capability'])}); set tiles.linear.fp8_mma in the profile to run the card's path"]


def card_report(card: str, profile: dict, limit: int | None, host: dict, run: dict, baseline: dict,
                conformance: dict) -> dict:
    """One card's report from its steps' results (a step's ``{"error": ...}`` is kept as it is)."""
    label = (f"simulated on {host['name']} (memory cap, kernel path)" if limit is not None else
             f"simulated on {host['name']} (profile only, no memory cap)")
    out = {"label": label, "card": card, "profile": profile, "memory_limit_bytes": limit, "host": host,
           "errors": {k: v["error"] for k, v in (("run", run), ("baseline", baseline),
                                                  ("conformance", conformance)) if "error" in v}}
    if "error" not in run:
        mem = run["memory"]
        tiers = run["kv_tiers"] or {}
        page = tiers.get("page_bytes")
        out["decode"] = {
            "model": run["model"], "prompt_tokens": run["prompt_tokens"], "new_tokens": run["new_tokens"],
            "decode_tokens_per_s": run["decode_tokens_per_s"], "prefill_tokens_per_s": run["prefill_tokens_per_s"],
            "peak_memory_bytes": run["peak_memory_bytes"], "peak_reserved_bytes": run["memory"]["peak_reserved_bytes"],
            "peak_within_cap": None if limit is None else run["memory"]["peak_reserved_bytes"] <= limit,
            "engram_placement": {"profile": profile["engram_placement"], "model": run["engram_placement"]},
            "kv": {**mem, "device_page_limit": tiers.get("device_page_limit"), "page_bytes": page,
                   "cold_tier_pages": mem["cold_tier_bytes"] // page if page and mem["cold_tier_bytes"] else None,
                   "cold_pages_used": tiers.get("cold_pages")},
            "backend_per_op_family": run["backend_per_op_family"], "step_capture": run["step_capture"]}
        if "error" not in baseline:
            out["decode"]["greedy_tokens"] = compare_tokens(run["new_token_ids"], baseline["new_token_ids"])
            out["decode"]["baseline_decode_tokens_per_s"] = baseline["decode_tokens_per_s"]
    if "error" not in conformance:
        paths = conformance["kernel_paths"]
        out["kernel_paths"] = paths
        if "linear" in paths:
            out["linear_fp8_w_path"] = linear_path(paths["linear"]["tiles"], host["fp8_tensor_cores"])
        out["kernel_path_caveats"] = path_caveats(profile, paths, host["fp8_tensor_cores"])
        out["conformance"] = {k: conformance[k] for k in ("profile", "memory_limit_bytes", "passed", "total")}
        out["conformance"]["rows"] = [{k: r[k] for k in ("op", "backend", "inputs", "max_rel_err", "tolerance",
                                                          "pass", "route")} for r in conformance["rows"]]
    return out


def host_facts(device: str) -> dict:
    """The device the simulation runs on: its profile, name and whether it has FP8 tensor cores."""
    import torch

    from flashrt.profiles import select_profile

    prof = select_profile(device)[0]
    if torch.device(device).type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        return {"name": prof.name.upper(), "profile": prof.name, "device": torch.cuda.get_device_name(device),
                "capability": f"sm_{cap[0]}{cap[1]}", "fp8_tensor_cores": cap >= (8, 9), "torch": torch.__version__}
    return {"name": prof.name.upper(), "profile": prof.name, "device": device, "capability": None,
            "fp8_tensor_cores": None, "torch": torch.__version__}


def card_profile(card: str) -> dict:
    from flashrt.profiles import load_profile

    return load_profile(card).to_dict()


def simulate(args) -> list[Path]:
    """Run every card; returns the report paths written."""
    on_cuda = args.device.startswith("cuda")
    host = host_facts(args.device)
    common = ["--model", args.model, "--prompt", args.prompt, "--max-new-tokens", str(args.max_new_tokens),
              "--device", args.device]
    baseline = run_step(common, [], args.timeout, args.warmup_runs)
    written = []
    with tempfile.TemporaryDirectory(prefix="flashrt-simulate-") as tmp:
        for card in args.cards:
            try:
                profile = card_profile(card)
                limit = int(profile["device_memory_gib"] * 2**30) if on_cuda else None
                sim = ["--profile", card] + (["--memory-limit", f"{limit}B"] if on_cuda else [])
                run = run_step(common, sim, args.timeout, args.warmup_runs)
                conformance = conformance_step(args.device, sim, Path(tmp), args.timeout)
                report = card_report(card, profile, limit, host, run, baseline, conformance)
                report["settings"] = {k: getattr(args, k) for k in ("model", "prompt", "max_new_tokens", "warmup_runs")}
            except Exception as exc:  # a card that cannot be set up is recorded, the others still run
                report = {"label": f"simulated on {host['name']}: not run", "card": card, "host": host,
                          "errors": {"setup": f"{type(exc).__name__}: {exc}"}}
            path = Path(args.out_dir) / f"{card}-simulated-on-{host['profile']}.json"
            write_json(str(path), report)
            written.append(path)
            print(summary(path, report), flush=True)
    return written


def budget(n: int | None) -> str:
    return "unlimited" if n is None else f"{n / 2**30:.2f} GiB"


def summary(path: Path, r: dict) -> str:
    d, c = r.get("decode"), r.get("conformance")
    parts = [f"{r['card']}: {r['label']}"]
    if d:
        tok = d.get("greedy_tokens")
        parts.append(f"decode {d['decode_tokens_per_s']:,.1f} tok/s, peak {d['peak_memory_bytes'] / 2**30:.2f} GiB, "
                     f"KV budget {budget(d['kv']['kv_budget_bytes'])}"
                     + (f", greedy tokens {'identical' if tok['identical'] else 'differ'}" if tok else ""))
    if c:
        parts.append(f"conformance {c['passed']}/{c['total']}")
    parts += [f"{k} failed: {v}" for k, v in r["errors"].items()]
    return "; ".join(parts) + f" -> {path}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cards", nargs="+", default=list(CARDS), help="profiles to simulate (default: %(default)s)")
    p.add_argument("--device", default="cuda", help="the device the simulation runs on: cuda[:N] or cpu")
    p.add_argument("--model", default="small", help="model of the decode (default small; tiny for a CPU smoke test)")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--warmup-runs", type=int, default=1,
                   help="runs before the measured one of each card, compiling its kernels (default 1)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per step (default %(default)s)")
    p.add_argument("--out-dir", default="hwconfigs/reports", help="where the reports go (default: %(default)s)")
    args = p.parse_args(argv)
    from flashrt.profiles import available_profiles

    known = available_profiles()
    unknown = [c for c in args.cards if c not in known]
    if unknown:
        p.error(f"--cards: expected profile names ({', '.join(known)}), got {unknown[0]!r}")
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens: expected an integer >= 1, got {args.max_new_tokens}")
    if args.warmup_runs < 0:
        p.error(f"--warmup-runs: expected an integer >= 0, got {args.warmup_runs}")
    os.environ.pop("FLASHRT_PROFILE", None)  # the host's profile is the detected one
    written = simulate(args)
    failed = [w for w in written if json.loads(w.read_text())["errors"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
