"""Profile values outside what the runtime can use (sizes, fractions, durations, match ranges) are
rejected with the key named; a broken profile file for another device is reported, not fatal."""
import json
import logging
import math
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

CPU = DeviceFacts("cpu")
H200 = DeviceFacts("cuda", "NVIDIA H200", "9.0", None, 139.8)


def load(tmp_path, data: dict, name: str = "bad") -> profiles.Profile:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return profiles.load_profile_file(path)


NAN, INF = math.nan, math.inf


@pytest.mark.parametrize("key, value, expected", [
    ("hkcp_page_entries", 2**30, "a power of two in [1, 65536]"),
    ("hkcp_page_entries", 0, "a power of two"),
    ("hkcp_page_entries", -64, "a power of two"),
    ("hkcp_hot_fraction", 0.0, "a fraction in (0, 1]"),
    ("hkcp_hot_fraction", -0.25, "a fraction in (0, 1]"),
    ("hkcp_warm_fraction", NAN, "a fraction in (0, 1]"),
    ("hkcp_warm_fraction", INF, "a fraction in (0, 1]"),
    ("memory_utilization", 0.0, "a fraction in (0, 1]"),
    ("memory_utilization", 1.01, "a fraction in (0, 1]"),
    ("memory_utilization", NAN, "a fraction in (0, 1]"),
    ("hkcp_prefix_ttl_hours", NAN, "a finite number of hours > 0"),
    ("hkcp_prefix_ttl_hours", INF, "a finite number of hours > 0"),
    ("hkcp_prefix_ttl_hours", -1.0, "a finite number of hours > 0"),
    ("hkcp_prefix_ttl_hours", 0.0, "a finite number of hours > 0"),
    ("hkcp_prefix_ttl_hours", 1e300, "a finite number of hours > 0 and <= 87600"),
    ("hkcp_window_pool_ttl_minutes", NAN, "a finite number of minutes > 0"),
    ("hkcp_window_pool_ttl_minutes", -5.0, "a finite number of minutes > 0"),
    ("hkcp_cold_host_gib", -1.0, "a finite number of GiB >= 0"),
    ("hkcp_cold_host_gib", NAN, "a finite number of GiB >= 0"),
    ("hkcp_cold_host_gib", 1e12, "a finite number of GiB >= 0 and <= 1048576"),
    ("hkcp_persistent_disk_gib", 0.0, "a finite number of GiB > 0"),
    ("hkcp_persistent_disk_gib", INF, "a finite number of GiB > 0"),
    ("device_memory_gib", 0.0, "a finite number of GiB > 0"),
    ("device_memory_gib", NAN, "a finite number of GiB > 0"),
    ("device_memory_gib", -80.0, "a finite number of GiB > 0"),
    ("match_min_memory_gib", NAN, "a finite number of GiB >= 0"),
    ("match_min_memory_gib", -1.0, "a finite number of GiB >= 0"),
    ("match_max_memory_gib", 100.0, ">= match_min_memory_gib (120.0)"),
    ("engram_prefetch_depth", 10**9, "an integer >= 0 and <= 1024"),
])
def test_impossible_values_are_rejected_with_the_key_named(tmp_path, key, value, expected):
    data = shipped_data("h200") | {"name": "bad", "match_min_memory_gib": 120.0, key: value}
    with pytest.raises(ProfileError) as info:
        load(tmp_path, data)
    msg = str(info.value)
    assert str(tmp_path / "bad.yaml") in msg and f"key {key}: expected" in msg and expected in msg, msg
    assert repr(value) in msg or (isinstance(value, float) and math.isnan(value) and "nan" in msg), msg


def test_nan_written_in_yaml_is_rejected(tmp_path):
    path = tmp_path / "bad.yaml"
    text = Path(profile_files()["cpu"]).read_text().replace("name: cpu", "name: bad")
    path.write_text(text.replace("hkcp_prefix_ttl_hours: 24", "hkcp_prefix_ttl_hours: .nan"))
    with pytest.raises(ProfileError, match=r"bad\.yaml: key hkcp_prefix_ttl_hours: expected .*found nan"):
        profiles.load_profile_file(path)


@pytest.mark.parametrize("key, value", [
    ("hkcp_page_entries", 1), ("hkcp_page_entries", 65536), ("memory_utilization", 1.0),
    ("hkcp_cold_host_gib", 0), ("hkcp_prefix_ttl_hours", 0.01), ("hkcp_window_pool_ttl_minutes", 0.5),
    ("engram_prefetch_depth", 0), ("device_memory_gib", None), ("match_max_memory_gib", 120.0),
])
def test_edge_values_that_work_are_accepted(tmp_path, key, value):
    data = shipped_data("h200") | {"name": "ok", "match_min_memory_gib": 120.0, key: value}
    assert getattr(load(tmp_path, data, "ok"), key) == value


def user_profile(name: str, data: dict) -> Path:
    path = Path(os.environ["FLASHRT_PROFILE_DIR"]) / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def test_a_broken_profile_for_another_device_is_reported_not_fatal(caplog):
    bad = user_profile("mycard", shipped_data("rtx4090") | {"name": "mycard", "hkcp_page_entries": 48})
    garbled = user_profile("garbled", "name: garbled\ntiles: {attention: [1, 2}\n")
    with caplog.at_level(logging.WARNING, logger="flashrt"):
        profile, why = profiles.select_profile(facts=CPU)
        assert profile.name == "cpu" and why.startswith("auto: ")
        assert profiles.select_profile(facts=H200)[0].name == "h200"
    warned = "\n".join(r.getMessage() for r in caplog.records)
    assert f"{bad}: key hkcp_page_entries" in warned and f"{garbled}: invalid YAML" in warned
    assert warned.count(str(bad)) == 1  # once per process
    assert set(profiles.broken_profiles()) == {str(bad), str(garbled)}
    with pytest.raises(ProfileError, match="key hkcp_page_entries"):  # chosen explicitly: an error
        profiles.load_profile("mycard")


def test_a_broken_profile_that_matches_the_device_is_an_error():
    bad = user_profile("cpu", shipped_data("cpu") | {"memory_utilization": 7.0})
    with pytest.raises(ProfileError, match=rf"{bad}: key memory_utilization.*matches this device"):
        profiles.select_profile(facts=CPU)
    assert profiles.select_profile(facts=H200)[0].name == "h200"  # another device: not affected


def test_doctor_and_run_with_a_broken_profile_for_another_device(tmp_path):
    bad = user_profile("mycard", shipped_data("h100") | {"name": "mycard", "hkcp_prefix_ttl_hours": NAN})
    env = os.environ | {"FLASHRT_CACHE_DIR": str(tmp_path / "cache")}

    def flashrt(*args):
        return subprocess.run([sys.executable, "-m", "flashrt.cli", *args], capture_output=True, text=True,
                              env=env, cwd="/")

    r = flashrt("doctor", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)["profiles"]
    assert report["chosen"]["name"] == "cpu" and "hkcp_prefix_ttl_hours" in report["broken"][str(bad)]
    r = flashrt("doctor")
    assert r.returncode == 0 and f"profile skipped: {bad}: key hkcp_prefix_ttl_hours" in r.stdout
    r = flashrt("run", "--max-new-tokens", "2", "--json")
    assert r.returncode == 0 and "Traceback" not in r.stderr and str(bad) in r.stderr
