"""Hardware profiles: schema checks, loading, user overrides, explicit choice, auto-selection, tiles."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flashrt import profiles
from flashrt.errors import ProfileError
from flashrt.hwconfigs import profile_files
from flashrt.profile_match import DeviceFacts
from profile_helpers import _clean_profiles, shipped_data  # noqa: F401 (autouse fixture)

SHIPPED = ("cpu", "a100", "h100", "h200", "rtx4090", "ascend910b")


def write_profile(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_profile_loads_and_validates(name):
    assert name in profile_files()
    p = profiles.load_profile(name)
    assert p.name == name and p.source == profile_files()[name]
    assert p.description and (p.tiles or p.backend == "ascend") and all(p.tiles.values())
    assert 0 < p.memory_utilization <= 1 and p.hkcp_page_entries & (p.hkcp_page_entries - 1) == 0
    assert profiles.profile_from_mapping(p.to_dict(), p.source) == p  # what a tuner writes back reads the same
    assert set(p.to_dict()) >= set(shipped_data(name))


def test_shipped_profiles_say_what_the_issue_asks():
    p = {name: profiles.load_profile(name) for name in SHIPPED}
    assert sorted(profile_files()) == sorted(SHIPPED)
    for name in ("a100", "h100", "h200", "rtx4090"):  # FP8 window KV (sm_80 dequantizes in registers)
        assert p[name].kv_window_dtype == "fp8" and p[name].compute_dtype == "bf16"
    assert p["ascend910b"].kv_window_dtype == "int8" and "fp8" not in (p["ascend910b"].weight_dtype,)
    for name in ("a100", "h100", "h200"):  # 80 GB+ cards
        assert p[name].engram_placement == "device" and p[name].device_memory_gib >= 80
    assert p["rtx4090"].engram_placement == "host_pinned" and p["rtx4090"].engram_prefetch_depth > 0
    assert p["cpu"].engram_placement == "host" and p["cpu"].backend == "reference"
    assert {p[n].backend for n in ("a100", "h100", "h200", "rtx4090")} == {"cuda"}
    assert p["ascend910b"].backend == "ascend"
    assert "linear" in p["h200"].tiles and "linear" in p["rtx4090"].tiles  # tuned GEMM tiles differ per device
    assert p["ascend910b"].tiles == {}  # the torch_npu adapters take no tile parameters


def _error(tmp_path, data, name="bad") -> str:
    path = write_profile(tmp_path / f"{name}.yaml", data)
    with pytest.raises(ProfileError) as info:
        profiles.load_profile_file(path)
    assert str(path) in str(info.value)
    return str(info.value)


def test_unknown_key_names_file_and_key(tmp_path):
    msg = _error(tmp_path, shipped_data("h200") | {"name": "bad", "kv_dtype": "fp4"})
    assert "unknown key 'kv_dtype'" in msg and "kv_window_dtype" in msg  # lists the known keys


@pytest.mark.parametrize("key, value, expected, found", [
    ("memory_utilization", "high", "expected float", "found str 'high'"),
    ("hkcp_page_entries", 64.0, "expected int", "found float 64.0"),
    ("hkcp_page_entries", True, "expected int", "found bool True"),
    ("engram_placement", "gpu", "expected one of 'device', 'host', 'host_pinned'", "found str 'gpu'"),
    ("kv_window_dtype", "fp16", "expected one of 'fp4', 'fp8', 'int8', 'bf16'", "found str 'fp16'"),
    ("match_capability", "9.0", "expected tuple[str, ...]", "found str"),
    ("match_capability", [9.0], "key match_capability[0]: expected str", "found float 9.0"),
    ("tiles", ["attention"], "key tiles: expected dict[str, dict[str, dict[str, bool | int", "found list"),
    ("tiles", {"attention": 64}, "key tiles.attention: expected dict[str, dict[str, bool", "found int 64"),
    ("tiles", {"attention": {"attention": {"H_BLOCK": [64]}}},
     "key tiles.attention.attention.H_BLOCK: expected bool | int | float | str | null", "found list [64]"),
    ("tiles", {"linear": {"linear": [[16, {"BLOCK_M": 16}, 3]]}},
     "key tiles.linear.linear[0]: expected tuple[int | null, dict[str, bool | int | float | str | null]]", "found list"),
    ("tiles", {"linear": {"linear": [["all", {"BLOCK_M": 16}]]}}, "key tiles.linear.linear[0][0]", "found str 'all'"),
    ("device_memory_gib", "141 GB", "expected float | null", "found str"),
    ("memory_utilization", None, "expected float", "found null"),
])
def test_wrong_type_names_file_key_expected_and_found(tmp_path, key, value, expected, found):
    msg = _error(tmp_path, shipped_data("h200") | {"name": "bad", key: value})
    assert f"key {key}" in msg and expected in msg and found in msg, msg


@pytest.mark.parametrize("key, value, expected", [
    ("memory_utilization", 1.5, "a fraction in (0, 1]"),
    ("hkcp_page_entries", 48, "a power of two"),
    ("hkcp_warm_fraction", 0.9, "hot + warm fractions <= 1"),
    ("engram_prefetch_depth", -1, "an integer >= 0"),
    ("sparse_max_queries", 0, "an integer >= 1 and <= 64"),
    ("sparse_max_queries", 65, "an integer >= 1 and <= 64"),
    ("match_name", "H2(00", "a regular expression"),
    ("match_capability", ["sm_90"], 'capabilities like "9.0"'),
    ("name", "h300", "expected 'bad' (the file name)"),
])
def test_bad_values_name_file_and_key(tmp_path, key, value, expected):
    msg = _error(tmp_path, shipped_data("h200") | {"name": "bad", key: value})
    assert f"key {key}" in msg and expected in msg, msg


def test_missing_key_and_non_mapping(tmp_path):
    data = shipped_data("cpu") | {"name": "bad"}
    del data["weight_dtype"]
    assert "missing key weight_dtype: expected one of 'fp4', 'fp8', 'int8', 'bf16'" in _error(tmp_path, data)
    assert "expected a mapping" in _error(tmp_path, ["a", "b"])


def test_bad_yaml_and_duplicate_key_name_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("name: broken\ntiles: {attention: [1, 2}\n")
    with pytest.raises(ProfileError, match=r"broken\.yaml: invalid YAML \(line 2"):
        profiles.load_profile_file(path)
    path.write_text(Path(profile_files()["cpu"]).read_text().replace("name: cpu", "name: broken")
                    + "memory_utilization: 0.7\n")
    with pytest.raises(ProfileError, match=r"broken\.yaml: invalid YAML \(line \d+.*duplicate key 'memory_utilization'"):
        profiles.load_profile_file(path)
    with pytest.raises(ProfileError, match="nothere.yaml: cannot read"):
        profiles.load_profile_file(tmp_path / "nothere.yaml")


def test_a_profile_takes_the_keys_of_the_one_it_extends(tmp_path):
    """``extends``: every key of the base the profile does not set, except the base's name,
    description and match keys; each ``tiles.<family>.<entry>`` it sets replaces the base's; a
    chain of bases reads nearest first, and the lineage names them in that order."""
    user = Path(os.environ["FLASHRT_PROFILE_DIR"])
    base = shipped_data("h200") | {"name": "base", "memory_utilization": 0.5, "description": "the base"}
    prefill = {"min_queries": 256, "max_heads": 16, "num_warps": 4}
    base["tiles"] = {"attention": {"prefill": prefill, "ws": {"enabled": False}},
                     "mhc": {"hc_coefficients": {"FMA_T": 1}}}
    write_profile(user / "base.yaml", base)
    write_profile(user / "mid.yaml", {"name": "mid", "extends": "base", "match_device_type": "cuda",
                                      "hkcp_cold_host_gib": 8, "tiles": {"attention": {"ws": {"enabled": True}}}})
    write_profile(user / "leaf.yaml", {"name": "leaf", "extends": "mid", "match_device_type": "cuda",
                                       "match_name": "LEAF", "memory_utilization": 0.7})
    leaf, mid = profiles.load_profile("leaf"), profiles.load_profile("mid")
    assert leaf.lineage == ("leaf", "mid", "base") and mid.lineage == ("mid", "base") and leaf.extends == "mid"
    assert leaf.memory_utilization == 0.7 and mid.memory_utilization == 0.5  # set, inherited
    assert leaf.hkcp_cold_host_gib == 8 and leaf.weight_dtype == base["weight_dtype"]
    assert leaf.tiles == {"attention": {"prefill": prefill, "ws": {"enabled": True}},
                          "mhc": {"hc_coefficients": {"FMA_T": 1}}}
    assert leaf.match_name == "LEAF" and mid.match_name is None and mid.match_min_memory_gib is None
    assert mid.description == "" and leaf.name == "leaf"
    assert profiles.profile_from_mapping(leaf.to_dict(), leaf.source) == leaf  # a tuner's write-back reads the same


@pytest.mark.parametrize("files,message", [
    ({"a": "nothere"}, "a.yaml: key extends: expected the name of a profile (a, a100, "),
    ({"a": "a"}, "a.yaml: key extends: 'a' extends itself through a -> a"),
    ({"a": "b", "b": "a"}, "key extends: 'a' extends itself through a -> b -> a"),
    ({"a": 7}, "a.yaml: key extends: expected the name of a profile"),
])
def test_a_bad_base_names_the_file_and_the_key(files, message):
    user = Path(os.environ["FLASHRT_PROFILE_DIR"])
    for name, base in files.items():
        write_profile(user / f"{name}.yaml", shipped_data("h100") | {"name": name, "extends": base})
    with pytest.raises(ProfileError) as exc:
        profiles.load_profile("a")
    assert message in str(exc.value)


def test_a_bad_key_taken_from_the_base_names_the_base():
    user = Path(os.environ["FLASHRT_PROFILE_DIR"])
    write_profile(user / "base.yaml", shipped_data("h200") | {"name": "base", "memory_utilization": 1.5})
    write_profile(user / "leaf.yaml", {"name": "leaf", "extends": "base", "match_device_type": "cuda"})
    with pytest.raises(ProfileError) as exc:
        profiles.load_profile("leaf")
    msg = str(exc.value)
    assert "leaf.yaml: key memory_utilization" in msg and f"come from base ({user / 'base.yaml'})" in msg
    write_profile(user / "leaf.yaml", {"name": "leaf", "extends": "base", "match_device_type": "cuda",
                                       "memory_utilization": 0.8})
    assert profiles.load_profile("leaf").memory_utilization == 0.8  # set here: the base's value unread


def test_the_h100_profile_is_the_h200_s_kernels_with_its_own_memory():
    h100, h200 = profiles.load_profile("h100"), profiles.load_profile("h200")
    assert h100.lineage == ("h100", "h200") and h100.tiles == h200.tiles
    assert (h100.expert_fp4, h100.expert_scales) == (h200.expert_fp4, h200.expert_scales)
    assert h100.device_memory_gib == 80 and h100.hkcp_cold_host_gib < h200.hkcp_cold_host_gib
    assert h100.serve_max_step_tokens < h200.serve_max_step_tokens
    assert h100.match_max_memory_gib == 120 and h100.match_min_memory_gib is None


def test_user_directory_overrides_shipped_and_adds(tmp_path):
    user = Path(os.environ["FLASHRT_PROFILE_DIR"])
    write_profile(user / "h200.yaml", shipped_data("h200") | {"memory_utilization": 0.5})
    write_profile(user / "mybox.yaml", shipped_data("rtx4090") | {"name": "mybox", "match_name": "RTX 4080"})
    available = profiles.available_profiles()
    assert available["h200"] == str(user / "h200.yaml") and available["mybox"] == str(user / "mybox.yaml")
    assert available["a100"] == profile_files()["a100"]
    assert profiles.load_profile("h200").memory_utilization == 0.5
    facts = DeviceFacts("cuda", "NVIDIA GeForce RTX 4080", "8.9", None, 16.0)
    assert profiles.select_profile(facts=facts)[0].name == "mybox"
    facts = DeviceFacts("cuda", "NVIDIA H200", "9.0", None, 139.8)
    assert profiles.select_profile(facts=facts)[0].memory_utilization == 0.5


def test_flashrt_profile_env_by_name_and_path_and_bad_name(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHRT_PROFILE", "a100")
    profile, why = profiles.select_profile(facts=DeviceFacts("cpu"))
    assert profile.name == "a100" and "explicit" in why and "does not match the detected device cpu" in why
    path = write_profile(tmp_path / "elsewhere" / "lab.yaml", shipped_data("h100") | {"name": "lab"})
    monkeypatch.setenv("FLASHRT_PROFILE", str(path))
    assert profiles.select_profile(facts=DeviceFacts("cpu"))[0].name == "lab"
    monkeypatch.setenv("FLASHRT_PROFILE", "h900")
    with pytest.raises(ProfileError, match=r"unknown profile 'h900': available a100, ascend910b, cpu, h100, h200"):
        profiles.select_profile(facts=DeviceFacts("cpu"))
    profiles.use_profile(None)
    with pytest.raises(ProfileError, match="h900"):
        profiles.active_profile()


H200 = DeviceFacts("cuda", "NVIDIA H200", "9.0", None, 139.8)


@pytest.mark.parametrize("facts, name, phrase", [
    (H200, "h200", "name matches /H200/, capability 9.0, memory 140 GiB"),
    (DeviceFacts("cuda", "NVIDIA H100 80GB HBM3", "9.0", None, 79.1), "h100", "name matches /H100/"),
    (DeviceFacts("cuda", "NVIDIA H100 NVL", "9.0", None, 93.6), "h100", "memory 94 GiB in [0, 120]"),
    (DeviceFacts("cuda", "NVIDIA A100-SXM4-80GB", "8.0", None, 79.2), "a100", "capability 8.0"),
    (DeviceFacts("cuda", "NVIDIA A100-PCIE-40GB", "8.0", None, 39.4), "a100", "name matches /A100/"),
    (DeviceFacts("cuda", "NVIDIA GeForce RTX 4090", "8.9", None, 23.6), "rtx4090", "capability 8.9"),
    (DeviceFacts("npu", "Ascend910B3", None, "Ascend910B3", 64.0), "ascend910b", "SoC matches /Ascend910B/"),
    (DeviceFacts("cpu"), "cpu", "device type cpu"),
    (DeviceFacts("cuda", "NVIDIA L40S", "8.9", None, 44.4), "rtx4090", "no profile matches"),
    (DeviceFacts("cuda", "NVIDIA GH200 480GB", "9.0", None, 95.0), "h100", "closest by compute capability"),
    (DeviceFacts("cuda", "NVIDIA B200", "10.0", None, 179.0), "h200", "closest by compute capability"),
    (DeviceFacts("cuda", "Tesla V100", "7.0", None, 32.0), "rtx4090", "every profile needs a higher"),
])
def test_auto_selection_from_device_facts(facts, name, phrase):
    profile, why = profiles.select_profile(facts=facts)
    assert profile.name == name and why.startswith("auto: ") and phrase in why, why
    assert facts.name in why


def test_auto_selection_fails_for_a_device_type_without_profiles():
    with pytest.raises(ProfileError, match="no profile for device type 'xpu'.*FLASHRT_PROFILE"):
        profiles.select_profile(facts=DeviceFacts("xpu", "Intel Max 1550"))


def test_detect_device_cpu_and_active_profile_is_cached(monkeypatch):
    assert profiles.detect_device("cpu") == DeviceFacts("cpu")
    calls = []
    real = profiles.select_profile
    monkeypatch.setattr(profiles, "select_profile", lambda *a, **k: calls.append(1) or real(facts=H200))
    assert profiles.active_profile().name == "h200" and profiles.active_profile().name == "h200"
    assert len(calls) == 1 and "H200" in profiles.active_selection()[1]


TILES = {  # a kernel module's defaults, shaped like kernels_cuda/linear.py's
    "gemm": {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "EXTRA": 7},
    "rules": ((16, {"BLOCK_M": 16, "num_stages": 4}), (None, {"BLOCK_M": 64, "num_stages": 3})),
    "split_k": None,
    "group_m": 8,
}


def profile_with_tiles(tiles: dict) -> profiles.Profile:
    """The h200 profile with ``tiles`` for a fake kernel family (not checked at load: no such family)."""
    import dataclasses

    return dataclasses.replace(profiles.profile_from_mapping(shipped_data("h200"), "/x/h200.yaml"), tiles=tiles)


def test_tiles_merge_the_profile_over_the_kernel_defaults():
    given = {"fake": {"gemm": {"BLOCK_N": 128}, "rules": [[None, {"BLOCK_M": 128, "num_stages": 2}]], "split_k": 4}}
    with profiles.using(profile_with_tiles(given)):
        t = profiles.tiles("fake", TILES)
        assert t == {"gemm": {"BLOCK_M": 16, "BLOCK_N": 128, "num_warps": 4, "EXTRA": 7},
                     "rules": ((None, {"BLOCK_M": 128, "num_stages": 2}),), "split_k": 4, "group_m": 8}
        assert profiles.tiles("fake", TILES) is t  # cached: cheap enough to call per launch
        assert profiles.tiles("other", TILES) == TILES  # a module the profile does not list: its defaults
        assert profiles.tiles("fake") == profiles.active_profile().tiles["fake"]
        with pytest.raises(ProfileError, match=r"h200\.yaml: key tiles\.other: missing"):
            profiles.tiles("other")
    with profiles.using("a100"):
        assert profiles.tiles("fake", TILES) == TILES
        assert profiles.tiles("attention") == profiles.load_profile("a100").tiles["attention"]


@pytest.mark.parametrize("given, message", [
    ({"gemm": {"BLOCK_K": 64}}, r"key tiles\.fake\.gemm\.BLOCK_K: unknown tile parameter; expected one of BLOCK_M"),
    ({"gemmm": {}}, r"key tiles\.fake\.gemmm: unknown tile parameter"),
    ({"gemm": 64}, r"key tiles\.fake\.gemm: expected a mapping, as the kernel's TILES, found int 64"),
    ({"rules": {"BLOCK_M": 64}}, r"key tiles\.fake\.rules: expected a non-empty list of \[limit, parameters\]"),
    ({"rules": [[None, {"BLOCK_Q": 1}]]}, r"key tiles\.fake\.rules: expected rule 0 with parameters among BLOCK_M"),
    ({"group_m": True}, r"key tiles\.fake\.group_m: expected int, found bool True"),
    ({"gemm": {"BLOCK_M": 16.5}}, r"key tiles\.fake\.gemm\.BLOCK_M: expected int, found float 16\.5"),
    ({"gemm": {"BLOCK_M": "16"}}, r"key tiles\.fake\.gemm\.BLOCK_M: expected int, found str '16'"),
])
def test_tiles_that_do_not_fit_the_kernel_name_the_key(given, message):
    with profiles.using(profile_with_tiles({"fake": given})), pytest.raises(ProfileError, match=message):
        profiles.tiles("fake", TILES)


def test_shipped_tiles_fit_every_kernel_module():
    """Profile tiles name only kernel modules and parameters that exist (else tuning would be ignored)."""
    from flashrt.kernels_cuda import FAMILIES

    modules = {fam.name: fam.tiles for fam in FAMILIES if fam.tiles}
    for name in SHIPPED:
        with profiles.using(name):
            assert set(profiles.active_profile().tiles) <= set(modules), name
            for module, defaults in modules.items():
                assert profiles.tiles(module, defaults).keys() == defaults.keys(), (name, module)


def test_doctor_prints_the_chosen_profile_and_why(monkeypatch, capsys):
    from flashrt.cli import commands as cli

    assert cli.main(["doctor"]) == 0
    profile, why = profiles.select_profile()  # cpu here, h200 on the H200, h100 (extends h200) on an H100
    bases = "".join(f", extends {b}" for b in profile.lineage[1:])
    assert f"profile: {profile.name}{bases} ({why})" in capsys.readouterr().out and why.startswith("auto: ")
    monkeypatch.setenv("FLASHRT_PROFILE", "nope")
    assert cli.main(["doctor"]) == 1
    assert "profile: error: unknown profile 'nope': available a100," in capsys.readouterr().out
    env = {k: v for k, v in os.environ.items() if k != "FLASHRT_PROFILE"}
    out = subprocess.run([sys.executable, "-m", "flashrt.cli", "--profile", "h100", "doctor", "--json"],
                         capture_output=True, text=True, env=env, cwd="/", check=True)
    chosen = json.loads(out.stdout)["profiles"]["chosen"]
    assert chosen["name"] == "h100" and "explicit profile 'h100'" in chosen["reason"]
    assert chosen["extends"] == ["h200"]
