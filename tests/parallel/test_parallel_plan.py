"""``flashrt plan --tp / --ep``: per-rank bytes against the shards themselves, and the fits."""
import dataclasses

import pytest

from flashrt.graphs.config import shipped_config
from flashrt.graphs.init_weights import init_weights
from flashrt.graphs.parallel import Layout
from flashrt.graphs.plan_parallel import rank_weight_bytes
from flashrt.graphs.plan_report import plan_report
from flashrt.graphs.shard import nbytes, shard_weights

GIB = 2**30


@pytest.mark.parametrize("tp,ep", [(2, 1), (2, 2), (1, 4)])
def test_rank_bytes_are_the_shards_bytes(tp, ep):
    cfg = dataclasses.replace(shipped_config("tiny"), n_routed_experts=16, n_activated_experts=4, name="tiny-16e")
    full = init_weights(cfg, seed=1)
    got = rank_weight_bytes(cfg, Layout(tp, ep))
    held = []
    for r in range(tp * ep):
        part = shard_weights(full, cfg, Layout(tp, ep, r))
        held.append(sum(nbytes(v) for k, v in part.items() if ".engram.embed." not in k))
    assert got["backbone"] + got["draft"] == max(held)
    engram = sum(nbytes(v) for k, v in full.items() if ".engram.embed." in k)
    assert engram / tp <= got["engram"] < engram / tp + 2 * 64  # rows split tp ways (the last part shorter)


def test_plan_report_per_rank_and_fit():
    memory = 0.05 * GIB
    report = plan_report("tiny", 4096, memory, tp=2, ep=2)
    p = report["parallel"]
    per_seq = p["kv_bytes_per_sequence"] + p["fixed_bytes_per_sequence"] + p["workspace_bytes_per_sequence"]
    weights = p["rank_bytes"]["backbone"] + p["rank_bytes"]["draft"]
    assert p["sequences_fit"]["engram_host"] == 2 * int((memory - weights) // per_seq)  # two groups
    assert p["sequences_fit"]["engram_device"] == 2 * int((memory - weights - p["rank_bytes"]["engram"]) // per_seq)
    assert p["kv_bytes_per_sequence"] == 4096 * report["kv_bytes_per_token"]  # full KV on each rank of a group
    assert any(line.startswith("layout: tp 2 x ep 2 = 4 ranks") for line in report["lines"])
    tight = plan_report("tiny", 4096, weights * 0.9, tp=2, ep=2)["parallel"]
    assert tight["sequences_fit"] == {"engram_device": 0, "engram_host": 0}
    with pytest.raises(ValueError, match="tp: expected a divisor"):
        plan_report("tiny", 4096, memory, tp=3)


def test_v41_flash_needs_several_h200s():
    """141 GB H200s at 90 %: 2 ranks cannot hold the weights, 8 hold them with Engram on the device
    too, and the routed experts (most of the model) shrink with every rank added."""
    v41 = shipped_config("v4.1-flash")
    usable = 141 * GIB * 0.9
    two, eight, sixteen = (rank_weight_bytes(v41, Layout(tp, ep)) for tp, ep in ((2, 1), (8, 1), (8, 2)))
    assert two["backbone"] + two["draft"] > usable
    assert eight["backbone"] + eight["draft"] + eight["engram"] < usable
    assert sixteen["backbone"] < 0.6 * eight["backbone"] and sixteen["engram"] == eight["engram"]
