"""Profile tiles against the kernel families' declarations: checked when the profile loads, every
error naming the file and the key; shipped profiles hold only what differs from the defaults; the
obsolete dtype keys; a fuzz test over tile YAML (no traceback, no invalid value accepted)."""
import dataclasses
import logging
import math

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashrt import dispatch, profiles, tile_checks
from flashrt.errors import ProfileError
from kernel_check import requires_kernels
from profile_helpers import _clean_profiles, shipped_data as data  # noqa: F401 (autouse fixture)

SHIPPED = ("cpu", "a100", "h100", "h200", "rtx4090", "ascend910b")
pytestmark = requires_kernels  # the families that declare tiles are the cuda backend's


def families() -> dict:
    return {f.name: f for f in dispatch.families()["cuda"] if f.tiles}


def load(tmp_path, tiles: dict, base: str = "h200", **keys):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data(base) | {"name": "p", "tiles": tiles} | keys))
    return profiles.load_profile_file(path)


def error(tmp_path, tiles: dict, **keys) -> str:
    with pytest.raises(ProfileError) as info:
        load(tmp_path, tiles, **keys)
    assert str(tmp_path / "p.yaml") in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("tiles, key, expected", [
    ({"attention": {"attention": {"H_BLOCK": 48}}}, "tiles.attention.attention.H_BLOCK", "a power of two, >= 16"),
    ({"attention": {"attention": {"K_BLOCK": 8}}}, "tiles.attention.attention.K_BLOCK", ">= 16"),
    ({"attention": {"combine": {"num_warps": 64}}}, "tiles.attention.combine.num_warps", "in [1, 32]"),
    ({"attention": {"combine": {"num_warps": 3}}}, "tiles.attention.combine.num_warps", "a power of two"),
    ({"attention": {"attention": {"num_stages": 0}}}, "tiles.attention.attention.num_stages", "in [1, 8]"),
    ({"attention": {"attention": {"D_SPLIT": 3}}}, "tiles.attention.attention.D_SPLIT", "one of 1, 2"),
    ({"attention": {"attention_fp32": {"precision": "fp64"}}}, "tiles.attention.attention_fp32.precision", "one of 'ieee', 'tf32'"),
    ({"attention": {"split": {"programs": -1}}}, "tiles.attention.split.programs", ">= 0"),
    ({"attention": {"split": {"max_splits": 0}}}, "tiles.attention.split.max_splits", ">= 1"),
    ({"linear": {"linear": [[16, {"BLOCK_N": 48}], [None, {}]]}}, "tiles.linear.linear[0].BLOCK_N", ">= 32"),
    ({"linear": {"linear": [[16, {}], [8, {}], [None, {}]]}}, "tiles.linear.linear[1]", "an int limit > 16"),
    ({"linear": {"linear": [[16, {}], [64, {}]]}}, "tiles.linear.linear[1]", "the last rule's limit null"),
    ({"linear": {"split_k": 0}}, "tiles.linear.split_k", "an int, >= 1 or null"),
    ({"linear": {"fp8_mma": "yes"}}, "tiles.linear.fp8_mma", "true or false"),
    ({"linear": {"group_m": 2.5}}, "tiles.linear.group_m", "expected int"),
    ({"topk": {"select": {"radix_bits": 3}}}, "tiles.topk.select.radix_bits", "one of 1, 2, 4"),
    ({"topk": {"select": {"bits": 33}}}, "tiles.topk.select.bits", "in [1, 32]"),
    ({"quant": {"quantize": {"ELEMS": 24}}}, "tiles.quant.quantize.ELEMS", "a power of two"),
    ({"indexer": {"index_scores": {"asm_decode": "no"}}}, "tiles.indexer.index_scores.asm_decode", "expected bool"),
    ({"gemm": {"linear": {}}}, "tiles.gemm", "a kernel family of backend 'cuda'"),
    ({"linear": {"gemm": {"BLOCK_M": 16}}}, "tiles.linear.gemm", "unknown tile parameter"),
    ({"mhc": {"hc_mix": {"BLOCK_D": 1 << 30 | 1}}}, "tiles.mhc.hc_mix.BLOCK_D", "a power of two"),
])
def test_a_bad_tile_names_file_key_and_what_was_expected(tmp_path, tiles, key, expected):
    msg = error(tmp_path, tiles)
    assert f"key {key}" in msg and expected in msg, msg


def test_nan_and_infinite_tiles_are_rejected(tmp_path):
    for value in (".nan", ".inf", "-.inf"):
        path = tmp_path / "p.yaml"
        text = yaml.safe_dump(data("h200") | {"name": "p", "tiles": {}}).replace("tiles: {}", "tiles: {quant: {quantize: "
                                                                                 f"{{ELEMS: {value}}}}}}}")
        path.write_text(text)
        with pytest.raises(ProfileError, match=r"key tiles\.quant\.quantize\.ELEMS: expected int"):
            profiles.load_profile_file(path)


def test_shared_memory_is_checked_against_the_device_the_profile_names(tmp_path):
    big = {"linear": {"linear": [[None, {"BLOCK_M": 512, "BLOCK_N": 512, "BLOCK_K": 512, "num_stages": 4}]]}}
    msg = error(tmp_path, big)  # h200: sm_90, 232448 bytes per program
    assert "key tiles.linear.linear[0]: expected a tile within the device's shared memory (sm_90: 232448" in msg
    assert "needs at least 1179648" in msg  # 3 buffers of 512 x 512 fp8 + 512 x 512 fp4
    assert load(tmp_path, big, match_capability=[]).tiles["linear"]  # no device named: nothing to check against
    msg = error(tmp_path, {"attention": {"attention": {"K_BLOCK": 256, "D_SPLIT": 1}}}, match_capability=["8.9"])
    assert "sm_89: 101376 bytes per program" in msg and "needs at least 262144" in msg
    assert load(tmp_path, {"attention": {"attention": {"K_BLOCK": 64}}}, match_capability=["8.9"])


def test_family_defaults_pass_their_own_checks():
    for fam in families().values():
        tile_checks.check(fam, fam.tiles, f"tiles.{fam.name}", "defaults", ("9.0",))


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profiles_hold_only_what_differs_from_the_defaults(name):
    raw = data(name)
    assert not set(raw) & set(profiles.OBSOLETE), name
    fams = families()
    assert "tiles" in raw or raw.get("extends"), name  # tiles of its own, or its base's
    for fam, section in raw.get("tiles", {}).items():
        assert tile_checks.differences(fams[fam].tiles, section) == section, (name, fam)


@pytest.mark.parametrize("key, old, ok", [("kv_main_dtype", "fp4", True), ("kv_main_dtype", "int8", False),
                                          ("kv_window_compute_dtype", "bf16", True),
                                          ("kv_window_compute_dtype", "fp64", False)])
def test_obsolete_dtype_keys(tmp_path, caplog, key, old, ok):
    """Nothing reads them: the value the runtime has anyway loads with a warning, any other is an error."""
    if not ok:
        msg = error(tmp_path, {}, **{key: old})
        assert f"key {key}: expected" in msg and "obsolete" in msg and repr(old) in msg
        return
    with caplog.at_level(logging.WARNING, logger="flashrt"):
        assert not hasattr(load(tmp_path, {}, **{key: old}), key)
    assert any(f"key {key} is obsolete and ignored" in r.getMessage() for r in caplog.records)


def test_a_broken_user_profile_is_reported_not_fatal(tmp_path, monkeypatch, caplog):
    user = tmp_path / "user-profiles"
    user.mkdir()
    (user / "mine.yaml").write_text(yaml.safe_dump(data("cpu") | {"name": "mine", "match_device_type": "cuda",
                                                                  "tiles": {"quant": {"quantize": {"ELEMS": 3}}}}))
    with caplog.at_level(logging.WARNING, logger="flashrt"):
        profile, why = profiles.select_profile("cpu")
    assert profile.name == "cpu" and why.startswith("auto: ")
    assert any("mine.yaml: key tiles.quant.quantize.ELEMS" in r.getMessage() for r in caplog.records)
    with pytest.raises(ProfileError, match=r"mine\.yaml: key tiles\.quant\.quantize\.ELEMS"):
        profiles.load_profile("mine")


# ---- fuzz: random tile sections are either rejected (ProfileError) or valid by an oracle -----------

SCALARS = st.one_of(st.integers(-2**40, 2**40), st.sampled_from([0, 1, 2, 3, 4, 16, 24, 32, 48, 64, 4096, 2**30]),
                    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
                    st.sampled_from(["ieee", "tf32x3", "bf16x3", "x", ""]), st.lists(st.integers(0, 64), max_size=2))


def _params(defaults: dict):
    names = st.one_of(st.sampled_from(sorted(defaults)), st.text("abcXYZ_", min_size=1, max_size=5))
    return st.dictionaries(names, SCALARS, max_size=3)


@st.composite
def tile_sections(draw):
    fams = families()
    fam = fams[draw(st.sampled_from(sorted(fams)))]
    entry = draw(st.one_of(st.sampled_from(sorted(fam.tiles)), st.text("abc", min_size=1, max_size=4)))
    default = fam.tiles.get(entry)
    if isinstance(default, dict):
        value = draw(st.one_of(_params(default), SCALARS))
    elif isinstance(default, (list, tuple)):
        limits = st.one_of(st.none(), st.integers(-4, 5000), st.booleans())
        rule = st.tuples(limits, _params(default[0][1])).map(list)
        value = draw(st.one_of(st.lists(rule, max_size=3), SCALARS))
    else:
        value = draw(SCALARS)
    return fam, entry, value


def _declared(fam, entry, param):
    checks = {**tile_checks.COMMON, **fam.tile_checks}
    keys = [entry] if param is None else [f"{entry}.{param}", f"*.{param}"]
    return next((checks[k] for k in keys if k in checks), None)


def _valid_scalar(fam, entry, param, value, default) -> bool:
    """An oracle written from the declarations' meaning (not from the checker's code)."""
    tile = _declared(fam, entry, param)
    kind = (tile.kind if tile else None) or type(default)
    if value is None:
        return bool(tile and tile.nullable) or (tile is None and default is None)
    if tile is None and kind is str:
        return value == default
    if tile and tile.choices:
        return value in tile.choices and type(value) is type(tile.choices[0])
    if kind in (bool, str):
        return type(value) is kind
    if type(value) is not int:
        return False
    tile = tile or tile_checks.Tile()
    low, high = tile.low, math.inf if tile.high is None else tile.high
    power = value > 0 and bin(value).count("1") == 1
    return low <= value <= high and value % tile.multiple == 0 and (power or not tile.pow2)


def _valid(fam, entry, value) -> bool:
    default = fam.tiles.get(entry, KeyError)
    if default is KeyError:
        return False
    if isinstance(default, dict):
        return isinstance(value, dict) and all(k in default and _valid_scalar(fam, entry, k, v, default[k])
                                               for k, v in value.items())
    if isinstance(default, (list, tuple)):
        if not isinstance(value, list) or not value or not all(
                isinstance(r, list) and len(r) == 2 and isinstance(r[1], dict) for r in value):
            return False
        limits = [limit for limit, _ in value]
        ints = [x for x in limits[:-1] if type(x) is int]
        if limits[-1] is not None or len(ints) != len(limits) - 1 or ints != sorted(set(ints)) or min(ints, default=1) < 1:
            return False
        known = default[0][1]
        return all(k in known and _valid_scalar(fam, entry, k, v, known[k]) for _, p in value for k, v in p.items())
    return _valid_scalar(fam, entry, None, value, default)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(section=tile_sections())
def test_fuzz_profile_tiles_no_traceback_no_silent_acceptance(tmp_path, section):
    fam, entry, value = section
    tiles = {fam.name: {entry: value}}
    base = data("cpu") | {"name": "p", "backend": "cuda", "tiles": tiles}  # no device named: no smem check
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(base))
    try:
        loaded = profiles.load_profile_file(path)
    except ProfileError as exc:
        assert str(path) in str(exc) and f"key tiles.{fam.name}" in str(exc), exc
        assert not _valid(fam, entry, value), f"rejected a valid tile: {tiles}: {exc}"
        return
    assert _valid(fam, entry, value), f"accepted an invalid tile: {tiles}"
    with profiles.using(loaded):  # and the kernels read it back merged over the defaults
        merged = profiles.tiles(fam.name, fam.tiles)[entry]
    assert merged == ({**fam.tiles[entry], **value} if isinstance(value, dict) else
                      tuple((limit, dict(p)) for limit, p in value) if isinstance(value, list) else value)
