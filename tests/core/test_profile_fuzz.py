"""Fuzzing profile YAML (hypothesis) over the non-tile keys: no traceback, no invalid value loaded.

The shipped cpu profile gets some keys replaced by drawn values (or removed, or an unknown key
added); the rules below, written out from what the runtime can use, decide whether the file is
valid. An invalid file must fail to load with a ProfileError naming one of its bad keys, and
``flashrt plan --profile FILE`` must exit 2 with one error line; a valid one must load with the
drawn values and plan must succeed. Damaged YAML text loads or fails with a ProfileError, never
another exception, and whatever loads satisfies the rules.
"""
from __future__ import annotations

import io
import math
import re
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from flashrt import profiles
from flashrt.cli import commands
from flashrt.errors import ProfileError
from flashrt.hwconfigs import profile_files

FUZZ = settings(max_examples=40, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
BASE_TEXT = Path(profile_files()["cpu"]).read_text().replace("name: cpu", "name: fuzz")
BASE = yaml.safe_load(BASE_TEXT)
GIB_MAX, TTL_HOURS_MAX = 2.0**20, 24 * 365 * 10


def number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def within(v, low, high, low_open) -> bool:
    return number(v) and math.isfinite(v) and (v > low if low_open else v >= low) and v <= high


def regex(v) -> bool:
    if v is None:
        return True
    if not isinstance(v, str):
        return False
    try:
        re.compile(v)
    except re.error:
        return False
    return True


def one_of(*names):
    return lambda v: isinstance(v, str) and v in names


STORAGE, COMPUTE = one_of("fp4", "fp8", "int8", "bf16"), one_of("fp8", "int8", "bf16", "fp16", "fp32")
FRACTION = lambda v: within(v, 0, 1, True)  # noqa: E731
RULES = {  # non-tile key -> whether a value is one the runtime can use
    "backend": lambda v: isinstance(v, str), "description": lambda v: isinstance(v, str),
    "match_device_type": one_of("cpu", "cuda", "npu"), "kv_main_dtype": STORAGE, "kv_window_dtype": STORAGE,
    "weight_dtype": STORAGE, "kv_window_compute_dtype": COMPUTE, "compute_dtype": COMPUTE,
    "hkcp_hot_fraction": FRACTION, "hkcp_warm_fraction": FRACTION, "memory_utilization": FRACTION,
    "hkcp_cold_host_gib": lambda v: within(v, 0, GIB_MAX, False),
    "hkcp_persistent_disk_gib": lambda v: within(v, 0, GIB_MAX, True) and v * 2**30 >= 1,
    "hkcp_page_entries": lambda v: type(v) is int and 1 <= v <= 65536 and v & (v - 1) == 0,
    "hkcp_prefix_ttl_hours": lambda v: within(v, 0, TTL_HOURS_MAX, True),
    "hkcp_window_pool_ttl_minutes": lambda v: within(v, 0, TTL_HOURS_MAX * 60, True),
    "engram_placement": one_of("device", "host", "host_pinned"),
    "engram_prefetch_depth": lambda v: type(v) is int and 0 <= v <= 1024,
    "serve_max_step_tokens": lambda v: type(v) is int and 1 <= v <= 2**20,
    "device_memory_gib": lambda v: v is None or within(v, 0, GIB_MAX, True),
    "match_name": regex, "match_soc": regex,
    "match_capability": lambda v: isinstance(v, list) and all(isinstance(c, str) and re.fullmatch(r"\d+\.\d+", c)
                                                               for c in v),
    "match_min_memory_gib": lambda v: v is None or within(v, 0, GIB_MAX, False),
    "match_max_memory_gib": lambda v: v is None or within(v, 0, GIB_MAX, False),
}
REQUIRED = {k for k in RULES if k in BASE and k not in ("description", "match_name", "match_capability",
                                                           "match_soc", "match_min_memory_gib",
                                                           "match_max_memory_gib")}


def bad_keys(d: dict) -> set[str]:
    """The keys of ``d`` an honest loader must reject (the name and tiles are left valid)."""
    bad = {k for k, v in d.items() if k in RULES and not RULES[k](v)}
    bad |= {k for k in d if k not in RULES and k not in ("name", "tiles")}  # unknown keys
    bad |= {k for k in REQUIRED if k not in d}  # missing keys
    hot, warm = d.get("hkcp_hot_fraction"), d.get("hkcp_warm_fraction")
    if not bad & {"hkcp_hot_fraction", "hkcp_warm_fraction"} and hot + warm > 1:
        bad.add("hkcp_warm_fraction")
    low, high = d.get("match_min_memory_gib"), d.get("match_max_memory_gib")
    if not bad & {"match_min_memory_gib", "match_max_memory_gib"} and None not in (low, high) and high < low:
        bad.add("match_max_memory_gib")
    return bad


SPECIAL = st.sampled_from([math.nan, math.inf, -math.inf, 0, 0.0, -0.0, 1, 1.0, 0.5, 2**30, 5e-324, 1e300, -1, 64,
                           48, 65536, 131072, 87600, 87601, 1e-12])
ANY = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(), st.text(max_size=8),
                st.lists(st.integers(0, 9), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
TARGETED = {
    "match_name": st.sampled_from([None, "H100", "(", "[a-", "A100|H100", "*x"]),
    "match_soc": st.sampled_from([None, "Ascend910B", ")"]),
    "match_capability": st.lists(st.sampled_from(["9.0", "8.9", "sm_90", "9", "10.0"]), max_size=3),
    "engram_placement": st.sampled_from(["device", "host", "host_pinned", "gpu", "HOST"]),
    "match_device_type": st.sampled_from(["cpu", "cuda", "npu", "tpu"]),
}


def value_for(key: str):
    return st.one_of(TARGETED.get(key, SPECIAL), SPECIAL, st.floats(-10.0, 2e6), ANY)


@st.composite
def mutated(draw) -> dict:
    d = dict(BASE)
    for key in draw(st.lists(st.sampled_from(sorted(RULES)), min_size=1, max_size=3, unique=True)):
        d[key] = draw(value_for(key))
    if draw(st.integers(0, 9)) == 0:
        del d[draw(st.sampled_from(sorted(REQUIRED)))]
    if draw(st.integers(0, 9)) == 0:
        d["kv_dtype"] = "fp4"
    return d


def plan_with(path) -> tuple[object, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err), profiles.using(profiles.active_profile()):
        try:
            code = commands.main(["plan", "--model", "tiny", "--context", "64", "--profile", str(path)])
        except SystemExit as exc:
            code = exc.code
        except BaseException as exc:  # noqa: BLE001 (escaping main: a traceback for the user)
            code = f"escaped main: {type(exc).__name__}: {exc}"
    return code, err.getvalue()


@pytest.fixture(autouse=True)
def _env(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHRT_PROFILE_DIR", str(tmp_path / "user-profiles"))
    monkeypatch.delenv("FLASHRT_PROFILE", raising=False)


@FUZZ
@given(data=mutated())
def test_fuzz_profile_values(data, tmp_path):
    path = tmp_path / "fuzz.yaml"
    path.write_text(yaml.safe_dump(data))
    bad = bad_keys(data)
    event("invalid" if bad else "valid")
    code, err = plan_with(path)
    assert "Traceback" not in err, err
    if bad:
        with pytest.raises(ProfileError) as info:
            profiles.load_profile_file(path)
        msg = str(info.value)
        assert any(f"key {k}" in msg or f"key {k!r}" in msg for k in bad), (sorted(bad), msg)
        assert code == 2 and "error: --profile: " in err.strip().splitlines()[-1], (code, err)
    else:
        p = profiles.load_profile_file(path)
        for key, value in data.items():
            if key in RULES:
                got = list(getattr(p, key)) if key == "match_capability" else getattr(p, key)
                assert got == value, (key, got, value)
        assert code == 0, (data, err)


@FUZZ
@given(cut=st.integers(0, len(BASE_TEXT)), span=st.integers(0, 12), insert=st.text(max_size=6))
def test_fuzz_damaged_profile_text(cut, span, insert, tmp_path):
    path = tmp_path / "fuzz.yaml"
    path.write_text(BASE_TEXT[:cut] + insert + BASE_TEXT[cut + span:])
    try:
        p = profiles.load_profile_file(path)
    except ProfileError:
        return
    d = p.to_dict()
    d["match_capability"] = list(d["match_capability"])
    assert not bad_keys({k: v for k, v in d.items() if k in RULES} | {"name": p.name}), d
