"""benchmarks/simulate_devices.py: the report of a simulated card, a card that fails, and the files
it may write (its CPU path end to end, with ``tiny``)."""
import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPT = BENCH / "simulate_devices.py"


@pytest.fixture(scope="module")
def sim():
    sys.path.insert(0, str(BENCH))  # the script imports results_io from its folder
    try:
        spec = importlib.util.spec_from_file_location("simulate_devices", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


def test_greedy_tokens_are_compared_position_by_position(sim):
    rng = random.Random()
    for _ in range(50):
        want = [rng.randrange(100) for _ in range(rng.randint(1, 20))]
        got = list(want)
        cut = rng.randrange(len(want) + 1)
        if cut < len(want):
            got[cut] = want[cut] + 1
        r = sim.compare_tokens(got, want)
        assert r["identical"] == (cut == len(want))
        assert r["first_difference"] == (None if cut == len(want) else cut)
        assert r["agreement"] == sum(a == b for a, b in zip(got, want)) / len(want)
    assert sim.compare_tokens([1, 2], [1, 2, 3])["first_difference"] == 2


def test_the_linear_path_of_a_card_without_fp8_tensor_cores_is_flagged(sim):
    a100 = {"match_capability": ["8.0"]}
    auto = {"linear": {"tiles": {"fp8_mma": None}}}
    forced = {"linear": {"tiles": {"fp8_mma": False}}}
    assert sim.linear_path(auto["linear"]["tiles"], True) == "fp8 tl.dot"
    assert sim.linear_path(forced["linear"]["tiles"], True).startswith("bf16 tl.dot")
    (caveat,) = sim.path_caveats(a100, auto, host_fp8=True)
    assert "fp8 tl.dot here, bf16 tl.dot" in caveat and "8.0" in caveat and "fp8_mma" in caveat
    assert sim.path_caveats(a100, forced, host_fp8=True) == []  # the profile selects the card's path
    assert sim.path_caveats({"match_capability": ["8.9"]}, auto, host_fp8=True) == []
    assert sim.path_caveats(a100, auto, host_fp8=None) == []  # CPU host: nothing to compare


def test_a_failed_step_is_recorded_and_the_rest_of_the_report_kept(sim):
    host = {"name": "H200", "profile": "h200", "fp8_tensor_cores": True}
    conformance = {"profile": "a100", "memory_limit_bytes": 1, "passed": 1, "total": 1, "kernel_paths": {},
                   "rows": [{"op": "rms_norm", "backend": "cuda", "inputs": [], "max_rel_err": 0.0,
                             "tolerance": 0.02, "pass": True, "route": []}]}
    r = sim.card_report("a100", {"engram_placement": "device"}, 80 * 2**30, host, {"error": "exit 1: OOM"},
                        {"error": "exit 1: boom"}, conformance)
    assert r["label"] == "simulated on H200 (memory cap, kernel path)" and "tested" not in r["label"]
    assert r["errors"] == {"run": "exit 1: OOM", "baseline": "exit 1: boom"}
    assert "decode" not in r and r["conformance"]["passed"] == 1


def test_the_cpu_path_end_to_end(sim, tmp_path):
    """Two cards, one whose profile does not load: both get a report, the good one complete; a
    report of an earlier run is replaced, nothing else in the folder is touched; no 'tested'."""
    out, profile_dir = tmp_path / "reports", tmp_path / "profiles"
    out.mkdir()
    profile_dir.mkdir()
    text = (BENCH.parent / "hwconfigs" / "rtx4090.yaml").read_text()
    (profile_dir / "brokencard.yaml").write_text(text.replace("name: rtx4090", "name: brokencard")
                                                 .replace("memory_utilization: 0.85", "memory_utilization: 7"))
    (out / "notes.txt").write_text("mine")
    (out / "rtx4090-simulated-on-cpu.json").write_text('{"old": true}')
    env = {**os.environ, "FLASHRT_CACHE_DIR": str(tmp_path / "cache"), "FLASHRT_PROFILE_DIR": str(profile_dir)}
    r = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--model", "tiny", "--max-new-tokens", "3",
                        "--warmup-runs", "0", "--cards", "rtx4090", "brokencard", "--out-dir", str(out)],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 1, r.stderr  # one card failed
    assert sorted(p.name for p in out.iterdir()) == ["brokencard-simulated-on-cpu.json", "notes.txt",
                                                      "rtx4090-simulated-on-cpu.json"]
    assert (out / "notes.txt").read_text() == "mine"
    good = json.loads((out / "rtx4090-simulated-on-cpu.json").read_text())
    assert good["errors"] == {} and good["label"] == "simulated on CPU (profile only, no memory cap)"
    assert good["profile"]["name"] == "rtx4090" and good["memory_limit_bytes"] is None
    assert good["settings"] == {"model": "tiny", "prompt": sim.PROMPT, "max_new_tokens": 3, "warmup_runs": 0}
    d = good["decode"]
    assert d["new_tokens"] == 3 and d["greedy_tokens"]["identical"] and d["decode_tokens_per_s"] > 0
    assert d["kv"]["cold_tier_bytes"] == 64 * 2**30 and d["engram_placement"]["profile"] == "host_pinned"
    c = good["conformance"]
    assert c["profile"] == "rtx4090" and c["passed"] == c["total"] == len(c["rows"]) > 0
    assert good["kernel_paths"]["attention"]["tiles"]["attention"]["H_BLOCK"] == 32  # the profile's tile
    bad = json.loads((out / "brokencard-simulated-on-cpu.json").read_text())
    assert "ProfileError" in bad["errors"]["setup"] and "memory_utilization" in bad["errors"]["setup"]
    assert "tested" not in json.dumps([good["label"], bad["label"]])
    assert "rtx4090: simulated on CPU" in r.stdout and "brokencard" in r.stdout
