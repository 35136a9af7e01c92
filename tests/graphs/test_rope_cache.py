"""The step context's rotary factors (graphs/context.py ``RopeCache``), made per call from the
positions, against rows of the precomputed table (``flashrt.rope_table``) at the same positions."""
import pytest
import torch

import flashrt
from flashrt.graphs.config import shipped_config
from flashrt.graphs.context import RopeCache


@pytest.mark.parametrize("model", ["tiny", "small"])
def test_factors_are_the_table_rows_bit_for_bit(model, rng):
    cfg = shipped_config(model)
    cache = RopeCache(cfg, "cpu")
    pos = torch.randint(0, 4096, (3, 5), generator=rng)
    yarn = (cfg.original_seq_len, cfg.rope_factor, cfg.beta_fast, cfg.beta_slow) if cfg.original_seq_len > 0 else None
    for compressed, base, y in ((False, cfg.rope_theta, None), (True, cfg.compress_rope_theta, yarn)):
        table = flashrt.rope_table(cfg.rope_head_dim, 4096, base, y)
        got = cache.factors(compressed, pos)
        assert got.dtype == torch.complex64 and got.shape == (3, 5, cfg.rope_head_dim // 2)
        assert torch.equal(torch.view_as_real(got), torch.view_as_real(table[pos]))
