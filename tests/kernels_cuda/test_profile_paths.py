"""Each CUDA profile's kernel paths in the ``tiny`` model (every layer role): a prompt's prefill and a
decode step on the kernels under the profile's own tiles (the a100's bf16 MMA and bit decodes, the RTX
4090's narrow attention tiles), every kernel call against the reference backend on that call's own
inputs (whole-model logits of a random model are chaotic: compared op by op). The sm_90 profiles' run
with their inline PTX is ``test_ptx_interpreted.py``'s."""
import pytest
import torch

import flashrt
from flashrt import profiles
from kernel_check import GPU, assert_calls_match_reference, recorded_calls, requires_kernels

pytestmark = requires_kernels


@pytest.mark.slow
@pytest.mark.parametrize("profile", ["a100", "rtx4090"])
def test_every_kernel_call_under_the_profile_matches_the_reference(cfg, weights, rng, profile):
    from flashrt.graphs.model import Model

    device = "cuda" if GPU else "cpu"
    ids = torch.randint(0, cfg.vocab_size, (2, 20), generator=rng).to(device)
    with profiles.using(profile):
        model = Model(cfg, weights) if not GPU else Model(cfg, {k: v.to(device) for k, v in weights.items()})
        with recorded_calls() as calls, flashrt.use_backend("cuda"), flashrt.value_checks(False):
            state = model.new_state(2, 24)
            model.forward(ids, state=state)
            model.forward(ids[:, -1:], state=state)
        checked = assert_calls_match_reference(calls)
    assert {"linear", "moe_experts", "prefix_attention", "sparse_attention", "index_scores", "hc_coefficients",
            "norm_rope_quantize", "topk_positions"} <= checked, checked
