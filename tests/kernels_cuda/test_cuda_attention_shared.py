"""A batch-1 KV segment (the HKCP device page pool) is shared by every row: the kernel must read
it with batch stride 0, exactly as the reference does."""
import torch

from flashrt import ops
from kernel_check import DEVICE, rel_err, requires_kernels, run_both


@requires_kernels
def test_batch_one_segment_is_shared(rng):
    B, S, H, D, T = 3, 2, 16, 64, 40
    q = torch.randn(B, S, H, D, generator=rng).to(DEVICE, torch.bfloat16)
    ring = ops.quantize(torch.randn(B, 8, D, generator=rng).to(DEVICE), "fp8")
    pool = ops.quantize(torch.randn(1, T, D, generator=rng).to(DEVICE), "fp4_b16")
    idx = torch.randint(-1, 8 + T, (B, S, 12), generator=rng, dtype=torch.int32).to(DEVICE)
    got, want = run_both("sparse_attention", q, (ring, pool), idx, torch.zeros(H, device=DEVICE), D ** -0.5)
    assert rel_err(got, want) < 2e-2
