"""``--memory-limit`` and ``--profile`` on ``run`` / ``conformance``: sizes, errors, the allocator
cap (a fake CUDA device: the total, the fraction set) and the KV budget sized from the cap."""
import json
import random
import types

import pytest
import torch

from flashrt import memory_cap, profiles
from flashrt.engine.generation import profile_kv_sizes
from flashrt.kv.sizes import device_kv_budget

from test_cli_errors import _env, assert_one_line_error, cache_dir, cli  # noqa: F401 (fixtures)

GIB = 2**30


def test_sizes_with_units_parse_to_bytes():
    rng = random.Random()
    for _ in range(200):
        unit = rng.choice(list(memory_cap.UNITS))
        value = rng.choice([rng.randint(1, 4096), round(rng.uniform(1, 512), 3)])
        text = rng.choice(["{}{}", "{} {}"]).format(value, rng.choice([unit, unit.lower(), unit.upper()]))
        assert memory_cap.parse_size(text) == int(value * memory_cap.UNITS[unit]), text
    assert memory_cap.parse_size("24GiB") == 24 * GIB and memory_cap.parse_size("80GB") == 80 * 10**9


@pytest.mark.parametrize("text", ["24", "", "GiB", "-1GiB", "0GiB", "24XB", "24 G", "nanGiB", "infGiB", "0.5B",
                                  "1e999GiB", "24GiB24"])
def test_bad_sizes_name_what_is_expected_and_what_was_given(text):
    with pytest.raises(ValueError, match=r"expected a size above 0 with a unit \(B, KB.*GiB.*\), e\.g\. 24GiB, got "
                                         + repr(text).replace("\\", "\\\\").replace(".", r"\.")):
        memory_cap.parse_size(text)


@pytest.mark.parametrize("args,needles", [
    (["run", "--memory-limit", "24"], ["--memory-limit", "with a unit", "'24'"]),
    (["conformance", "--memory-limit=-3GiB"], ["--memory-limit", "'-3GiB'"]),
    (["run", "--device", "cpu", "--memory-limit", "24GiB"], ["--memory-limit", "needs a CUDA device", "cpu"]),
    (["conformance", "--device", "cpu", "--memory-limit", "1GiB"], ["--memory-limit", "needs a CUDA device"]),
    (["run", "--memory-limit", "24GiB", "--tp", "2"], ["--memory-limit", "--tp / --ep"]),
    (["run", "--profile", "nosuch"], ["--profile", "unknown profile 'nosuch'", "rtx4090"]),
    (["conformance", "--profile", ""], ["--profile", "non-empty"]),
    (["--profile", "a100", "run", "--profile", "h100"], ["--profile", "'a100'", "'h100'", "given twice"]),
])
def test_bad_options_are_one_line_errors(args, needles):
    code, out, err = cli(*args)
    assert_one_line_error(code, err, *needles)
    assert out == ""


def test_the_profile_after_the_command_is_the_one_used(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHRT_PROFILE", "")  # main sets it for child processes: restored after the test
    out = tmp_path / "report.json"
    code, _, err = cli("conformance", "--device", "cpu", "--profile", "rtx4090", "--out", str(out))
    assert code == 0, err
    report = json.loads(out.read_text())
    assert report["profile"] == "rtx4090" and report["memory_limit_bytes"] is None
    # the kernels' tiles are the profile's over the family defaults (rtx4090.yaml against kernels_cuda)
    from flashrt.kernels_cuda import attention, linear

    paths = report["kernel_paths"]
    assert attention.TILES["attention"]["H_BLOCK"] == 64 and paths["attention"]["tiles"]["attention"]["H_BLOCK"] == 32
    assert linear.TILES["linear"][2][1]["num_stages"] == 3 and paths["linear"]["tiles"]["linear"][2][1]["num_stages"] == 2
    assert paths["linear"]["tiles"]["group_m"] == linear.TILES["group_m"]  # not in the profile: the default


def test_the_fraction_caps_the_total_and_a_limit_above_it_is_an_error():
    rng = random.Random()
    for _ in range(100):
        total = rng.randint(GIB, 200 * GIB)
        limit = rng.randint(1, total)
        assert memory_cap.memory_fraction(limit, total) * total == pytest.approx(limit, rel=1e-12)
    with pytest.raises(ValueError, match=r"--memory-limit: 200\.00 GiB is more than cuda:0 \(H\) has \(139\.80 GiB\)"):
        memory_cap.memory_fraction(200 * GIB, int(139.8 * GIB), "cuda:0 (H)")
    with pytest.raises(ValueError, match="--memory-limit: expected a positive number of bytes, got 0"):
        memory_cap.memory_fraction(0, GIB)


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA device 0 of 141 GiB as memory_cap sees it; the fractions set are recorded."""
    total, fractions = int(141 * GIB), []
    monkeypatch.setattr(memory_cap, "_CAPS", {})
    monkeypatch.setattr(memory_cap, "_cuda_index", lambda device: 0)
    monkeypatch.setattr(memory_cap, "_physical_total", lambda index: total)
    monkeypatch.setattr(memory_cap, "_set_fraction", lambda f, index: fractions.append((f, index)))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Fake H200")
    return types.SimpleNamespace(total=total, fractions=fractions)


def test_the_cap_is_set_on_the_allocator_and_is_the_memory_sized_from(fake_cuda):
    assert memory_cap.device_total("cuda:0") == fake_cuda.total and memory_cap.limit("cuda:0") is None
    got = memory_cap.apply(24 * GIB, "cuda")
    assert fake_cuda.fractions == [(24 * GIB / fake_cuda.total, 0)]
    assert got["limit_bytes"] == 24 * GIB and got["device"] == "cuda:0 (Fake H200)"
    assert memory_cap.device_total("cuda:0") == memory_cap.limit("cuda:0") == 24 * GIB
    assert memory_cap.limit("cpu") is None
    with pytest.raises(ValueError, match=r"--memory-limit: 150\.00 GiB is more than cuda:0 \(Fake H200\) has"):
        memory_cap.apply(150 * GIB, "cuda")
    memory_cap.clear("cuda")
    assert fake_cuda.fractions[-1] == (1.0, 0) and memory_cap.device_total("cuda:0") == fake_cuda.total


def test_the_kv_budget_is_sized_from_the_capped_memory(fake_cuda, monkeypatch):
    """profile_kv_sizes on a (fake) CUDA model: the profile's hot + warm share of the capped memory
    it may use, less what is allocated; computed here independently for random caps."""
    rng = random.Random()
    prof = profiles.load_profile("rtx4090")
    model = types.SimpleNamespace(profile=prof, device=torch.device("cuda", 0))
    for _ in range(20):
        cap, allocated = rng.randint(8 * GIB, 100 * GIB), rng.randint(0, 6 * GIB)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)
        memory_cap.apply(cap, "cuda")
        usable = cap * prof.memory_utilization - allocated
        want = int(usable * (prof.hkcp_hot_fraction + prof.hkcp_warm_fraction))
        assert profile_kv_sizes(model, None, None) == (want, prof.hkcp_page_entries, prof.cold_host_bytes)
        assert profile_kv_sizes(model, 12345, None)[0] == 12345  # an explicit budget wins
    memory_cap.clear("cuda")
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    full = profile_kv_sizes(model, None, None)[0]
    assert full == int(fake_cuda.total * prof.memory_utilization * (prof.hkcp_hot_fraction + prof.hkcp_warm_fraction))


def test_device_kv_budget_is_the_profile_share_of_what_is_free_and_at_least_one_byte():
    rng = random.Random()
    for _ in range(100):
        total, util = rng.randint(GIB, 200 * GIB), rng.uniform(0.5, 1.0)
        allocated, hot, warm = rng.randint(0, total // 2), rng.uniform(0, 0.5), rng.uniform(0, 0.5)
        want = max(int((total * util - allocated) * (hot + warm)), 1)
        assert device_kv_budget(total, util, allocated, hot, warm) == want
    assert device_kv_budget(GIB, 0.9, 2 * GIB, 0.2, 0.7) == 1  # the weights alone exceed the cap


def test_run_names_the_profile_given_after_the_command(monkeypatch):
    monkeypatch.setenv("FLASHRT_PROFILE", "")  # main sets it for child processes: restored after the test
    code, out, err = cli("run", "--device", "cpu", "--profile", "rtx4090", "--max-new-tokens", "2", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["profile"] == "rtx4090" and r["engram_placement"] == "device"  # CPU weights: tables stay with them
    assert r["memory"] == {"memory_limit_bytes": None, "sized_from_bytes": None, "peak_reserved_bytes": None,
                           "kv_budget_bytes": None, "page_entries": 64, "cold_tier_bytes": 64 * GIB}
    code, out, err = cli("run", "--device", "cpu", "--profile", "rtx4090", "--max-new-tokens", "2")
    assert code == 0 and "profile rtx4090 (Engram tables: device)\n" in out, err
