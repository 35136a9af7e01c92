"""Plans (``flashrt.jit_plans``): what a run records, merged into the plan file whole and once,
read back as the variants Triton would compile; bad files and entries skipped, never fatal.
(That a plan compiles to the cache keys the launches use: tests/core/test_jit_parallel.py.)"""
from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from flashrt import jit_plans
from flashrt.jit_parallel import portable_options
from flashrt.jit_targets import ARCHS

triton = pytest.importorskip("triton")
ARCH = ARCHS["sm_90"]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHRT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(jit_plans, "SHIPPED", tmp_path / "shipped")


def _data(block: int, dtype: str = "bf16") -> str:
    """Specialization data as Triton serializes it (``serialize_specialization_data``)."""
    return json.dumps({"name": "k", "signature": {"x_ptr": "*bf16", "n": "i32", "BLOCK": "constexpr",
                                                  "DT": "constexpr", "T": ["constexpr", "constexpr"]},
                       "constant_keys": [[2], [3]], "constant_vals": [block, dtype],
                       "attrs_keys": [[0], [1]], "attrs_vals": [[["tt.divisibility", 16]], []],
                       "options": {"num_warps": 4, "supported_fp8_dtypes": ["fp8e5"],
                                   "extern_libs": [["libdevice", "/elsewhere/libdevice.10.bc"]]},
                       "key": "ignored"})


def _entry(block: int) -> dict:
    return {"module": "flashrt.kernels_cuda.norm_rope", "name": "_rms_norm_kernel", "data": _data(block)}


def test_an_entry_decodes_as_triton_preloads_it():
    spec = jit_plans.decode(_entry(64), ARCH)
    assert spec.cc == 90 and spec.name == "_rms_norm_kernel" and spec.families == ("plan",)
    assert spec.constexprs[(2,)] == 64 and spec.constexprs[(3,)] == triton.language.bfloat16
    assert spec.attrs == {(0,): [["tt.divisibility", 16]], (1,): []}
    assert spec.signature["T"] == ("constexpr", "constexpr")
    assert spec.options == {"num_warps": 4, "supported_fp8_dtypes": ("fp8e5",)}  # libdevice: this machine's


def test_save_merges_new_entries_first_once_and_whole():
    blocks = random.sample(range(1, 1000), 6)
    assert jit_plans.save(ARCH, "h200", "small", [_entry(b) for b in blocks[:4]]) == 4
    assert jit_plans.save(ARCH, "h200", "small", [_entry(b) for b in blocks[2:]]) == 2  # two known
    path = jit_plans.plan_paths(ARCH, "h200", "small")[0]
    assert path.parent.name == f"triton-{triton.__version__}" and path.name == "sm_90-h200-small.json"
    assert not [p for p in path.parent.iterdir() if p != path]  # no temporary file left
    got = [s.constexprs[(2,)] for s in jit_plans.load(ARCH, "h200", "small")]
    assert got == blocks[4:] + blocks[:4]  # the newest run's first
    assert jit_plans.load(ARCH, "h200", "tiny") == [] and jit_plans.save(ARCH, "h200", "small", []) == 0


def test_save_last_puts_the_new_entries_after_the_plan_s():
    """A server's warm-up variants (``last``) go after what runs recorded, each once."""
    blocks = random.sample(range(1, 1000), 7)
    assert jit_plans.save(ARCH, "h200", "small", [_entry(b) for b in blocks[:4]]) == 4
    assert jit_plans.save(ARCH, "h200", "small", [_entry(b) for b in blocks[2:]], last=True) == 3
    assert [s.constexprs[(2,)] for s in jit_plans.load(ARCH, "h200", "small")] == blocks


def test_the_shipped_plan_is_read_too_and_a_variant_listed_twice_is_one(tmp_path):
    jit_plans.save(ARCH, "h200", "small", [_entry(16)])
    shipped = jit_plans.plan_paths(ARCH, "h200", "small")[1]
    shipped.parent.mkdir(parents=True)
    shipped.write_text(json.dumps({"entries": [_entry(16), _entry(32)]}))
    assert [s.constexprs[(2,)] for s in jit_plans.load(ARCH, "h200", "small")] == [16, 32]


def test_a_profile_reads_the_plans_of_the_profiles_it_extends_after_its_own():
    """A lineage (``Profile.lineage``: the profile, then its bases): each name's cache and shipped
    plans in turn, a variant listed by two of them once; saving writes the profile's own plan."""
    own, base = random.sample(range(1, 1000), 2)
    jit_plans.save(ARCH, "h100", "small", [_entry(own)])
    shipped = jit_plans.plan_paths(ARCH, "h200", "small")[1]
    shipped.parent.mkdir(parents=True)
    shipped.write_text(json.dumps({"entries": [_entry(base), _entry(own)]}))
    paths = jit_plans.plan_paths(ARCH, ("h100", "h200"), "small")
    assert [p.name for p in paths] == ["sm_90-h100-small.json"] * 2 + ["sm_90-h200-small.json"] * 2
    assert paths[:2] == jit_plans.plan_paths(ARCH, "h100", "small") and paths[3] == shipped
    assert [s.constexprs[(2,)] for s in jit_plans.load(ARCH, ("h100", "h200"), "small")] == [own, base]
    assert [s.constexprs[(2,)] for s in jit_plans.load(ARCH, "h100", "small")] == [own]


def test_one_variant_under_two_keys_or_libdevice_paths_is_one_entry():
    """Triton's ``key`` text (which lists a launch's keyword options such as ``launch_pdl``) and the
    recording machine's libdevice path do not change what compiles: such entries are one; a
    different option or constexpr is another."""
    block = random.randrange(1, 1000)
    data = json.loads(_data(block))
    twin = dict(data, key=f"launch_pdl {random.random()}")
    twin["options"] = dict(data["options"], extern_libs=[["libdevice", "/other/machine/libdevice.10.bc"]])
    other = dict(data, options=dict(data["options"], num_warps=8))
    entries = [{**_entry(block), "data": json.dumps(d)} for d in (data, twin, other)]
    assert jit_plans.entry_key(entries[0]) == jit_plans.entry_key(entries[1]) != jit_plans.entry_key(entries[2])
    assert jit_plans.save(ARCH, "h200", "small", entries[:1]) == 1
    assert jit_plans.save(ARCH, "h200", "small", entries[1:]) == 1  # only the num_warps=8 one is new
    assert sorted(s.options["num_warps"] for s in jit_plans.load(ARCH, "h200", "small")) == [4, 8]


def test_a_bad_file_or_entry_is_skipped_with_a_warning(caplog):
    path = jit_plans.plan_paths(ARCH, "h200", "small")[0]
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert jit_plans.load(ARCH, "h200", "small") == []
    bad = {"module": "m", "name": "k", "data": json.dumps({"signature": {}})}  # no constants
    path.write_text(json.dumps({"entries": [bad, {"module": "m"}, 7, _entry(8)]}))
    assert [s.constexprs[(2,)] for s in jit_plans.load(ARCH, "h200", "small")] == [8]
    assert "ignoring the plan" in caplog.text and "skipping a plan entry of m.k" in caplog.text
    assert jit_plans.save(ARCH, "h200", "small", [_entry(9)]) == 1  # a bad file is replaced, never fatal


def test_the_recorder_keeps_every_variant_once_and_chains_the_hook_it_found(monkeypatch):
    calls = []
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", lambda **kw: calls.append(kw["key"]))
    previous = triton.knobs.runtime.jit_post_compile_hook
    recorder = jit_plans.Recorder()

    def kernel():
        pass
    jit_fn = SimpleNamespace(fn=kernel, __module__="flashrt.kernels_cuda.quant")
    for key, data in (("a", _data(16)), ("b", _data(32)), ("a", _data(16))):
        triton.knobs.runtime.jit_post_compile_hook(key=key, fn=SimpleNamespace(jit_function=jit_fn),
                                                   compile={"specialization_data": data})
    assert calls == ["a", "b", "a"]
    assert recorder.entries() == [{"module": "flashrt.kernels_cuda.quant", "name": kernel.__qualname__, "data": d}
                                  for d in (_data(16), _data(32))]
    recorder.close()
    assert triton.knobs.runtime.jit_post_compile_hook is previous


def test_portable_options_keep_a_kernel_s_own_extern_libs():
    own = {"extern_libs": (("libdevice", "/a"), ("mine", "/b")), "num_warps": 8}
    assert portable_options(own) == own
    assert portable_options({"extern_libs": (("libdevice", "/a"),), "num_warps": 8}) == {"num_warps": 8}


def test_every_shipped_plan_names_kernels_as_they_are_now():
    """A shipped plan goes stale when a kernel's parameters change (its variants then compile for
    nothing): regenerate it (tools/jit_coverage.py --plan-out core/jit_plans) when this fails."""
    import importlib
    import inspect
    from pathlib import Path

    import flashrt

    from flashrt import profiles

    shipped = sorted((Path(flashrt.__file__).parent / "jit_plans").glob("*/*.json"))
    assert shipped, "no shipped plan"
    for path in shipped:
        entries = jit_plans.read_entries(path)
        assert entries, path
        # launches carry launch_pdl exactly when the plan's profile enables it (an sm_90 plan)
        pdl = bool(profiles.load_profile(json.loads(path.read_text())["profile"]).tiles.get("pdl", {}).get("enabled"))
        for entry in entries:
            assert json.loads(entry["data"])["options"].get("launch_pdl", False) is pdl, (path.name, entry["name"])
            spec = jit_plans.decode(entry, ARCH)
            kernel = getattr(importlib.import_module(spec.module), spec.name)
            params = list(inspect.signature(getattr(kernel, "fn", kernel)).parameters)
            assert list(spec.signature) == params, (path.name, spec.name)
            assert all(k[0] < len(params) for k in (*spec.constexprs, *spec.attrs)), (path.name, spec.name)


def _ship_plan():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "ship_plan.py"
    spec = importlib.util.spec_from_file_location("ship_plan", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("drop_rest", [False, True])
def test_ship_plan_puts_the_recording_first_in_its_order(tmp_path, monkeypatch, drop_rest):
    """tools/ship_plan.py: the recorded entries in their order (once each), then the shipped
    entries the recording lacks unless dropped; the recorded header names the file's plan."""
    ship_plan = _ship_plan()
    monkeypatch.setattr(ship_plan, "matches_code", lambda entry: True)  # the entries' signature is made up
    blocks = random.sample(range(1, 1000), 9)
    recorded_blocks, old_blocks = blocks[:5] + blocks[:1], blocks[3:]  # blocks 3 and 4 in both
    recorded = tmp_path / "rec" / "triton-9.9.9" / "sm_90-h200-small.json"
    recorded.parent.mkdir(parents=True)
    recorded.write_text(jit_plans.plan_text("sm_90", "h200", "small", [_entry(b) for b in recorded_blocks]).decode())
    target = ship_plan.shipped_path(recorded, None, tmp_path / "ship")
    assert target == tmp_path / "ship" / "triton-9.9.9" / "sm_90-h200-small.json"
    target.parent.mkdir(parents=True)
    target.write_text(jit_plans.plan_text("sm_90", "h200", "small", [_entry(b) for b in old_blocks]).decode())
    report = ship_plan.ship(recorded, target, drop_rest)
    got = [json.loads(e["data"])["constant_vals"][0] for e in jit_plans.read_entries(target)]
    rest = [] if drop_rest else blocks[5:]
    assert got == blocks[:5] + rest
    assert report["recorded"] == 5 and report["kept"] == len(rest) and report["dropped"] == 4 - len(rest)
    assert json.loads(target.read_text())["model"] == "small"
    assert ship_plan.shipped_path(recorded, "3.6.0", tmp_path).parent.name == "triton-3.6.0"
    with pytest.raises(ValueError, match="--triton"):
        ship_plan.shipped_path(tmp_path / "x.json", None)
    (tmp_path / "empty.json").write_text("{}")
    with pytest.raises(ValueError, match="RECORDED: expected a plan file with entries"):
        ship_plan.ship(tmp_path / "empty.json", target)


def _ship_blocks(ship_plan, tmp_path, recorded_blocks, old_blocks, *args, **kwargs):
    """``ship_plan.ship`` of a recording of ``recorded_blocks`` into a shipped plan of ``old_blocks``
    (an entry a block): (its report, the blocks of the plan written)."""
    recorded = tmp_path / "triton-9.9.9" / "sm_90-h200-small.json"
    recorded.parent.mkdir(parents=True)
    recorded.write_text(jit_plans.plan_text("sm_90", "h200", "small", [_entry(b) for b in recorded_blocks]).decode())
    target = tmp_path / "ship" / "sm_90-h200-small.json"
    target.parent.mkdir(parents=True)
    target.write_text(jit_plans.plan_text("sm_90", "h200", "small", [_entry(b) for b in old_blocks]).decode())
    report = ship_plan.ship(recorded, target, *args, **kwargs)
    return report, [json.loads(e["data"])["constant_vals"][0] for e in jit_plans.read_entries(target)]


@pytest.mark.parametrize("drop_rest", [False, True])
def test_ship_plan_after_keeps_the_shipped_order_first(tmp_path, monkeypatch, drop_rest):
    """``--after`` (a server's recording): the shipped entries first in their order, then the
    recorded ones they lack in the recording's order; with ``drop_rest`` only the shipped entries the
    recording has stay."""
    ship_plan = _ship_plan()
    monkeypatch.setattr(ship_plan, "matches_code", lambda entry: True)
    blocks = random.sample(range(1, 1000), 8)
    old_blocks, recorded_blocks = blocks[:5], blocks[5:] + blocks[3:5] + blocks[5:6]  # blocks 3, 4 in both
    report, got = _ship_blocks(ship_plan, tmp_path, recorded_blocks, old_blocks, drop_rest, after=True)
    kept = blocks[3:5] if drop_rest else blocks[:5]
    assert got == kept + blocks[5:]
    assert report["recorded"] == 5 and report["kept"] == len(kept) - 2 and report["dropped"] == 3 - (len(kept) - 2)


def test_ship_plan_beside_puts_each_new_entry_after_its_recorded_predecessor(tmp_path, monkeypatch):
    """``--beside``: the shipped order kept; a new entry right after the latest entry the recording has
    before it that is placed (shipped, or new and placed already), first where there is none."""
    ship_plan = _ship_plan()
    monkeypatch.setattr(ship_plan, "matches_code", lambda entry: True)
    b = random.sample(range(1, 1000), 8)
    old_blocks = [b[0], b[1], b[2], b[3]]
    recorded_blocks = [b[4], b[2], b[5], b[6], b[0], b[7]]  # b4 before anything shipped, b5-b6 after b2, b7 after b0
    report, got = _ship_blocks(ship_plan, tmp_path, recorded_blocks, old_blocks, beside=True)
    assert got == [b[4], b[0], b[7], b[1], b[2], b[5], b[6], b[3]]
    assert report["recorded"] == 6 and report["kept"] == 2 and report["dropped"] == 0


def test_ship_plan_sets_an_option_in_every_entry(tmp_path, monkeypatch):
    """``--option launch_pdl=true``: every entry, recorded or kept, compiles with the option set; an
    old entry that then equals a recorded one is listed once; a malformed option is named."""
    ship_plan = _ship_plan()
    monkeypatch.setattr(ship_plan, "matches_code", lambda entry: True)
    blocks = random.sample(range(1, 1000), 4)

    def entry(block, pdl):
        return ship_plan.with_options(_entry(block), {"launch_pdl": pdl})

    recorded = tmp_path / "triton-9.9.9" / "sm_90-h200-small.json"
    recorded.parent.mkdir(parents=True)
    recorded.write_text(jit_plans.plan_text("sm_90", "h200", "small", [entry(blocks[0], False)]).decode())
    target = tmp_path / "ship" / "sm_90-h200-small.json"
    target.parent.mkdir(parents=True)
    old = [entry(blocks[0], True), entry(blocks[1], False), entry(blocks[1], True), _entry(blocks[2])]
    target.write_text(jit_plans.plan_text("sm_90", "h200", "small", old).decode())
    report = ship_plan.ship(recorded, target, options={"launch_pdl": True})
    got = [json.loads(e["data"]) for e in jit_plans.read_entries(target)]
    assert [d["constant_vals"][0] for d in got] == blocks[:3]
    assert all(d["options"]["launch_pdl"] is True and d["options"]["num_warps"] == 4 for d in got)
    assert report["recorded"] == 1 and report["kept"] == 2 and report["dropped"] == 1
    assert ship_plan.parse_option("launch_pdl=true") == ("launch_pdl", True)
    for bad in ("launch_pdl", "=1", "launch_pdl=yes"):
        with pytest.raises(ValueError, match=f"--option: expected NAME=JSON .*got {bad!r}"):
            ship_plan.parse_option(bad)


def test_ship_plan_drops_entries_the_code_no_longer_has(tmp_path):
    """Shipped entries whose kernel is gone or whose parameters changed since they were recorded
    are not carried over; an entry naming the kernel's parameters as they are is."""
    import inspect

    from flashrt.kernels_cuda import norm_rope

    ship_plan = _ship_plan()
    params = list(inspect.signature(norm_rope._rms_norm_kernel.fn).parameters)
    block = random.randrange(1, 1000)

    def entry(name, names):
        data = json.dumps({"name": name, "signature": {p: "i32" for p in names}, "constant_keys": [],
                           "constant_vals": [block], "attrs_keys": [], "attrs_vals": [], "options": {}})
        return {"module": "flashrt.kernels_cuda.norm_rope", "name": name, "data": data}

    current, renamed, extra = entry("_rms_norm_kernel", params), entry("_rms_norm_kernel", params[:-1] + ["X"]), \
        entry("_rms_norm_kernel", params + ["NEW"])
    gone = entry("_no_such_kernel", params)
    assert ship_plan.matches_code(current)
    assert not any(ship_plan.matches_code(e) for e in (renamed, extra, gone))
    recorded = tmp_path / "triton-9.9.9" / "sm_90-h200-small.json"
    recorded.parent.mkdir(parents=True)
    recorded.write_text(jit_plans.plan_text("sm_90", "h200", "small", [_entry(7)]).decode())
    target = tmp_path / "ship" / "sm_90-h200-small.json"
    target.parent.mkdir(parents=True)
    target.write_text(jit_plans.plan_text("sm_90", "h200", "small", [renamed, current, gone, extra]).decode())
    report = ship_plan.ship(recorded, target)
    assert [e["data"] for e in jit_plans.read_entries(target)] == [_entry(7)["data"], current["data"]]
    assert report["recorded"] == 1 and report["kept"] == 1 and report["dropped"] == 3


def test_ship_plan_fills_in_a_trailing_constexpr_added_with_a_default(monkeypatch):
    """An entry recorded before its kernel gained a trailing constexpr with a default gets that
    parameter at its default (the variant a launch leaving it out compiles); one missing a parameter
    elsewhere, or a parameter without a default, stays as it was (and is then dropped)."""
    import sys
    import types

    import triton.language as tl

    ship_plan = _ship_plan()
    default = random.choice([False, True, random.randrange(1, 64)])

    def kernel(x_ptr, n, BLOCK: tl.constexpr, MODE: tl.constexpr, NEW: tl.constexpr = default):
        pass

    module = types.ModuleType("plan_test_kernels")
    module.kernel = kernel
    monkeypatch.setitem(sys.modules, module.__name__, module)
    block = random.randrange(1, 1000)

    def entry(signature):
        data = {"name": "kernel", "signature": signature, "constant_keys": [[2]], "constant_vals": [block],
                "attrs_keys": [], "attrs_vals": [], "options": {}}
        return {"module": module.__name__, "name": "kernel", "data": json.dumps(data)}

    old = entry({"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr", "MODE": "constexpr"})
    filled = ship_plan.with_defaults(old)
    data = json.loads(filled["data"])
    assert list(data["signature"]) == ["x_ptr", "n", "BLOCK", "MODE", "NEW"] and data["signature"]["NEW"] == "constexpr"
    assert data["constant_keys"] == [[2], [4]] and data["constant_vals"] == [block, default]
    assert ship_plan.matches_code(filled) and not ship_plan.matches_code(old)
    assert ship_plan.with_defaults(filled) == filled
    gap = entry({"x_ptr": "*fp32", "BLOCK": "constexpr", "MODE": "constexpr"})  # a parameter missing in the middle
    assert ship_plan.with_defaults(gap) == gap
    no_default = entry({"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"})  # MODE has no default
    assert ship_plan.with_defaults(no_default) == no_default


def test_ship_plan_drops_the_shipped_entries_with_the_bits_named(tmp_path, monkeypatch):
    """``--drop-bits BLOCK=MASK``: a shipped entry the recording lacks goes where its integer constexpr
    has a bit of the mask; recorded entries stay whatever their bits; a malformed mask is named."""
    ship_plan = _ship_plan()
    monkeypatch.setattr(ship_plan, "matches_code", lambda entry: True)
    mask = 1 << random.randrange(2, 9)
    old_blocks = [mask | 1, 2 * mask + 1, mask | 3, 4 * mask]  # the first and third carry the bit
    recorded_blocks = [mask | 3, 8 * mask + 1]
    report, got = _ship_blocks(ship_plan, tmp_path, recorded_blocks, old_blocks, beside=True,
                               drop_bits={"BLOCK": mask})
    assert got == [old_blocks[1], mask | 3, 8 * mask + 1, old_blocks[3]]
    assert report["recorded"] == 2 and report["kept"] == 2 and report["dropped"] == 1
    assert ship_plan.parse_bits("E2M1=0x40") == ("E2M1", 64)
    with pytest.raises(ValueError, match="--drop-bits: expected NAME=MASK"):
        ship_plan.parse_bits("E2M1=words")
