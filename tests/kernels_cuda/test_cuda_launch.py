"""Launch plans (kernels_cuda/launch.py): cached per shape, rebuilt when the active profile changes;
the shared codecs (kernels_cuda/codecs.py) bit-exact against torch's float8 / float4 decoders;
the warmup hooks of attention.py and linear.py compile nothing without a CUDA device."""
import dataclasses

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from kernel_check import DEVICE, GPU, requires_kernels, rel_err, run_both  # noqa: E402

from flashrt import formats, profiles  # noqa: E402
from flashrt.kernels_cuda import attention, codecs, launch  # noqa: E402
from flashrt.kernels_cuda import linear as lin  # noqa: E402

pytestmark = requires_kernels


def _with_tiles(**tiles):
    """The active profile with other tile overrides: a new profile object, as a profile switch gives."""
    return dataclasses.replace(profiles.active_profile(), tiles=tiles)


def _attention_case(rng):
    B, S, H, D, T, K = 2, 1, 16, 32, 60, 48
    q = torch.randn(B, S, H, D, generator=rng).to(DEVICE)
    kv = (formats.quantize(torch.randn(B, 8, D, generator=rng), "fp8").to(DEVICE),
          formats.quantize(torch.randn(B, T - 8, D, generator=rng), "fp4_b16").to(DEVICE))
    idx = torch.randint(-1, T, (B, S, K), generator=rng, dtype=torch.int32).to(DEVICE)
    return q, kv, idx, torch.randn(H, generator=rng).to(DEVICE), D ** -0.5


def test_plan_cache_is_emptied_when_the_profile_changes():
    cache = launch.PlanCache("attention", attention.TILES)
    tiles, plan = cache.lookup("k")
    assert plan is None and cache.store("k", "plan") == "plan" and cache.lookup("k") == (tiles, "plan")
    with profiles.using(_with_tiles(attention={"combine": {"H_BLOCK": 32, "num_warps": 4}})):
        other, plan = cache.lookup("k")
        assert plan is None and other["combine"]["H_BLOCK"] == 32 and len(cache) == 0
        cache.store("k", "other plan")
    assert cache.lookup("k") == (tiles, None)  # back under the first profile: rebuilt, never the other's


def test_attention_plans_follow_the_profile(monkeypatch, rng):
    """One plan per key, reused; a profile forcing split K gets its own plan and the right result."""
    made = []
    real = attention._launch_plan
    monkeypatch.setattr(attention, "_launch_plan", lambda *a: made.append(a[1]) or real(*a))
    case = _attention_case(rng)
    forced = {"split": {"programs": 64, "min_blocks": 1, "max_splits": 4},
              "attention": {"K_BLOCK": 16}, "attention_fp32": {"K_BLOCK": 16}}
    with profiles.using(_with_tiles(attention={"split": {"programs": 1, "min_blocks": 4, "max_splits": 16}})):
        for _ in range(2):
            got, want = run_both("sparse_attention", *case)
            assert rel_err(got, want) < 1e-4
        (plan,) = attention.PLANS._plans.values()
        assert plan["splits"] == 1 and len(made) == 1
    with profiles.using(_with_tiles(attention=forced)):
        got, want = run_both("sparse_attention", *case)
        assert rel_err(got, want) < 1e-4
        assert [p["splits"] for k, p in attention.PLANS._plans.items() if k[0] != "combine"] == [3]
    assert len(made) == 2


def test_linear_plans_follow_the_profile(rng):
    x = torch.randn(3, 256, generator=rng).to(DEVICE).to(torch.bfloat16)
    w = formats.quantize(torch.randn(40, 256, generator=rng) * 0.1, "fp8_w").to(DEVICE)
    key = (3, 40, 256, torch.bfloat16, "fp8_w")
    for forced, splits in ((1, 1), (2, 2), (1, 1)):  # switching back does not reuse the 2-way plan
        with profiles.using(_with_tiles(linear={"split_k": forced, "linear": [[None, dict(
                BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)]]})):
            got, want = run_both("linear", x, w)
            assert rel_err(got, want) < 1e-3
            assert lin.PLANS.lookup(key)[1]["split"] == splits


def test_host_helpers_match_triton():
    assert all(launch.next_pow2(n) == triton.next_power_of_2(n) for n in range(0, 3000))
    assert all(launch.cdiv(a, b) == triton.cdiv(a, b) for a in range(0, 200) for b in range(1, 40))
    t = torch.zeros(4, 6)[:, ::2]
    assert launch.last_dense(t) is not t and launch.dense(t).is_contiguous()
    u = torch.zeros(4, 6)
    assert launch.dense(u) is u and launch.last_dense(u) is u


@pytest.mark.skipif(GPU, reason="checks the no-device answer")
def test_warmup_hooks_compile_nothing_without_a_device():
    profile = profiles.load_profile("h200")
    for mod in (attention, lin):
        assert "no CUDA device" in mod.FAMILY.warmup(profile)["skipped"]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
def test_warmup_hooks_compile_on_the_gpu():
    profile = profiles.load_profile("h200")
    with profiles.using(profile):
        assert attention.FAMILY.warmup(profile)["launches"] > 0 and lin.FAMILY.warmup(profile)["launches"] > 0


@triton.jit
def _decode_kernel(x_ptr, o_ptr, WHICH: tl.constexpr):
    i = tl.arange(0, 256)
    b = tl.load(x_ptr + i)
    if WHICH == 0:
        v = codecs.e4m3_to_f32(b.to(tl.int32))
    elif WHICH == 1:
        v = codecs.e4m3_cvt(b)
    elif WHICH == 2:
        v = codecs.e4m3_x256(b).to(tl.float32) * 256.0
    elif WHICH == 3:
        v = codecs.e2m1_to_f32(b.to(tl.int32) & 15)
    else:
        v = codecs.e8m0_to_f32(b.to(tl.int32))
    tl.store(o_ptr + i, v)


def _decode_all(which: int) -> torch.Tensor:
    """fp32 decode of every byte 0..255 by one of the shared codecs (a one-program kernel)."""
    x = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    out = torch.empty(256, device=DEVICE)
    _decode_kernel[(1,)](x, out, WHICH=which)
    return out.cpu()


@pytest.mark.parametrize("which", range(5))
def test_codecs_decode_every_byte_as_torch(which):
    u8 = torch.arange(256, dtype=torch.uint8)
    if which <= 2:
        want = u8.view(torch.float8_e4m3fn).float()
        if which == 2:  # the dot-operand decoder has no NaN codes: 0x7F / 0xFF read as +-480
            want = torch.where(want.isnan(), torch.where(u8 < 128, 480.0, -480.0), want)
    elif which == 3:
        want = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6]).repeat(16)
    else:
        want = u8.view(torch.float8_e8m0fnu).float()
    got = _decode_all(which)
    assert torch.equal(got.isnan(), want.isnan())
    fin = ~want.isnan()
    assert torch.equal(got[fin].view(torch.int32), want[fin].view(torch.int32))  # bits: -0.0 and subnormals too
