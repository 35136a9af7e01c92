"""The parallel layout (who owns what) and weight sharding, in one process."""
import dataclasses

import pytest
import torch

from flashrt import ops
from flashrt.formats import QTensor
from flashrt.graphs.config import shipped_config
from flashrt.graphs.init_weights import init_weights
from flashrt.graphs.params import param_specs
from flashrt.graphs.parallel import Layout, span
from flashrt.graphs.shard import NOT_HERE, local_specs, param_cut, shard_weights


def _values(v):
    return ops.dequantize(v) if isinstance(v, QTensor) else v.to(torch.float32)


@pytest.fixture(scope="module")
def cfg16():
    return dataclasses.replace(shipped_config("tiny"), n_routed_experts=16, n_activated_experts=4, name="tiny-16e")


def test_bad_layouts_name_the_argument(cfg16):
    for bad, name in (({"tp": 0}, "tp"), ({"ep": 1.5}, "ep"), ({"tp": 2, "rank": 2}, "rank")):
        with pytest.raises(ValueError, match=name):
            Layout(**bad)
    with pytest.raises(ValueError, match="tp: expected a divisor of n_heads=4"):
        Layout(tp=4).check(cfg16)  # 4 heads but 2 output groups
    with pytest.raises(ValueError, match="ep: expected tp \\* ep \\(here 32\\) to divide n_routed_experts=16"):
        Layout(tp=2, ep=16).check(cfg16)
    Layout(tp=2, ep=8).check(cfg16)


def test_span_covers_every_row_once():
    for n in (1, 7, 16, 6126):
        for parts in (1, 2, 3, 4):
            cuts = [span(n, parts, i) for i in range(parts)]
            assert cuts[0][0] == 0 and cuts[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 4), (2, 2)])
def test_every_parameter_is_held_and_the_shards_rebuild_it(cfg16, tp, ep, rng):
    """Over the ranks of a layout, every routed expert is held exactly once, every group holds
    each tensor-parallel slice exactly once, and the slices (dequantized) rebuild the parameter."""
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    full = init_weights(cfg16, seed=seed)
    shards = [shard_weights(full, cfg16, Layout(tp, ep, r)) for r in range(tp * ep)]
    for spec in param_specs(cfg16):
        holders = [r for r in range(tp * ep) if spec.name in shards[r]]
        if ".ffn.experts." in spec.name and spec.name.startswith("layers."):
            assert len(holders) == 1, spec.name
            assert torch.equal(_values(shards[holders[0]][spec.name]), _values(full[spec.name]))
            continue
        if ".shared_experts." in spec.name and spec.name.startswith("layers."):
            assert len(holders) == ep, spec.name  # one rank of each group
            continue
        assert holders == list(range(tp * ep)), spec.name
        for e in range(ep):
            group = [r for r in range(e * tp, (e + 1) * tp)]
            cut = param_cut(spec.name, cfg16, Layout(tp, ep, group[0]))
            parts = [_values(shards[r][spec.name]) for r in group]
            whole = parts[0] if cut is None else torch.cat(parts, dim=cut.dim)
            assert torch.equal(whole, _values(full[spec.name])), spec.name


def test_quantized_cuts_fall_on_whole_scale_blocks(cfg16):
    """wo_b (fp8, 32x32 tiles) is cut by columns: each rank's slice dequantizes to its columns."""
    full = init_weights(cfg16, seed=3)
    name = "layers.0.attn.wo_b.weight"
    cut = param_cut(name, cfg16, Layout(2, 1, 1))
    part = shard_weights(full, cfg16, Layout(2, 1, 1))[name]
    assert cut.dim == 1 and part.shape == (cfg16.dim, cut.stop - cut.start)
    assert torch.equal(ops.dequantize(part), ops.dequantize(full[name])[:, cut.start:cut.stop])


def test_local_specs_skip_other_ranks_experts(cfg16):
    layout = Layout(2, 2, 3)
    names = {s.name for s, _, _ in local_specs(cfg16, layout)}
    lo, hi = layout.experts(16)
    assert (lo, hi) == (12, 16)
    assert "layers.0.ffn.experts.12.w1.weight" in names and "layers.0.ffn.experts.11.w1.weight" not in names
    assert param_cut("layers.0.ffn.experts.0.w2.weight", cfg16, layout) is NOT_HERE
    assert "mtp.0.ffn.experts.0.w1.weight" in names  # draft layers are replicated
