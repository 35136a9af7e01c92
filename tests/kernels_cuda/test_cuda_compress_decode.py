"""``compress_decode`` on the CUDA backend (kernels_cuda/compress.py): one launch for a compressor's
decode step (the slot writes, the pool, the cast, the norm, the entry), against the reference and
against the kernels it replaces (``compress_pool`` and ``rms_norm`` with their torch glue, what
the switch off runs): bit for bit under the interpreter, where the sums run in one order; on a GPU
the norm's row sum is laid out differently (one row a program, not a block of rows), so there
the latents agree to one rounding of their dtype. States it does not serve in one program run
those steps."""
import pytest
import torch

import flashrt
from flashrt import ops
from kernel_check import DEVICE, GPU, launches, pinned_tiles, rel_err, requires_kernels  # noqa: F401 (launches: a fixture)

pytestmark = requires_kernels
compress = pytest.importorskip("flashrt.kernels_cuda.compress")


def _case(rng, B, r, D):
    f = lambda *s, k=1.0: (torch.randn(*s, generator=rng) * k).to(DEVICE)
    positions = torch.randint(0, 6 * r, (B,), generator=rng).to(DEVICE)
    return f(B, D), f(B, D, k=4.0), f(B, r, D), f(B, r, D, k=4.0), positions, \
        (torch.randn(D, generator=rng) + 1.0).to(DEVICE, torch.bfloat16)


def _run(args, dtype, **tiles):
    kv, score, kv_state, score_state, positions, weight = args
    states = kv_state.clone(), score_state.clone()
    with pinned_tiles(compress=tiles):
        out = compress.compress_decode(kv, score, *states, positions, weight, 1e-6, dtype)
    return out, states


@pytest.mark.parametrize("B,r,D,dtype", [(1, 2, 64, torch.bfloat16), (3, 4, 512, torch.bfloat16),
                                         (2, 8, 128, torch.float32), (5, 3, 32, torch.float16)])
def test_one_launch_bit_identical_to_the_unfused_kernels(rng, launches, B, r, D, dtype):
    args = _case(rng, B, r, D)
    (latent, entry, mask), states = _run(args, dtype)
    assert launches == ["_compress_decode_kernel"]
    launches.clear()
    (latent2, entry2, mask2), states2 = _run(args, dtype, compress_decode={"in_kernel": False})
    assert launches == ["_compress_pool_kernel", "_rms_norm_kernel"]
    assert torch.equal(latent, latent2) if not GPU else rel_err(latent, latent2) <= 2.0 ** -7
    assert torch.equal(entry, entry2) and torch.equal(mask, mask2)
    assert all(torch.equal(a, b) for a, b in zip(states, states2))
    with flashrt.use_backend("reference"):
        ref_states = args[2].clone(), args[3].clone()
        want = ops.compress_decode(args[0], args[1], *ref_states, args[4], args[5], 1e-6, dtype)
    assert latent.dtype == dtype and rel_err(latent, want[0]) < (1e-2 if dtype != torch.float32 else 1e-5)
    assert torch.equal(entry, want[1]) and torch.equal(mask, want[2])
    assert all(torch.equal(a, b) for a, b in zip(states, ref_states))


@pytest.mark.parametrize("B,r,D", [(3, 4, 64), (2, 2, 128)])
def test_column_slices_of_one_output_in_one_launch(rng, launches, B, r, D):
    """kv and score as the two halves of one [B, 2D] GEMM output (the compressor's fused wkv and
    wgate): read through their row stride, no copy launch, the bits of contiguous inputs."""
    args = _case(rng, B, r, D)
    both = torch.cat([args[0], args[1]], dim=1)
    kv, score = both.split((D, D), dim=1)
    assert not kv.is_contiguous()
    (latent, entry, mask), states = _run((kv, score, *args[2:]), torch.bfloat16)
    assert launches == ["_compress_decode_kernel"]
    (want, want_entry, want_mask), want_states = _run(args, torch.bfloat16)
    assert torch.equal(latent, want) and torch.equal(entry, want_entry) and torch.equal(mask, want_mask)
    assert all(torch.equal(a, b) for a, b in zip(states, want_states))


def test_states_it_does_not_hold_run_the_steps(rng, launches):
    args = _case(rng, 2, 4, 96)  # 96 channels: not a power of two
    (latent, entry, mask), states = _run(args, torch.bfloat16)
    assert launches == ["_compress_pool_kernel", "_rms_norm_kernel"]
    with flashrt.use_backend("reference"):
        ref_states = args[2].clone(), args[3].clone()
        want = ops.compress_decode(args[0], args[1], *ref_states, args[4], args[5], 1e-6, torch.bfloat16)
    assert rel_err(latent, want[0]) < 1e-2 and torch.equal(entry, want[1]) and torch.equal(mask, want[2])
    assert all(torch.equal(a, b) for a, b in zip(states, ref_states))
