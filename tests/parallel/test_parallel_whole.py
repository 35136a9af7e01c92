"""``flashrt run --tp / --ep`` with CED prefill and with the prefix cache: every group runs the
request whole (engine/parallel_whole.py); greedy tokens identical to one process."""
import pytest
from parallel_text import random_text
import torch

from flashrt.engine.parallel_run import run_parallel
from flashrt.engine.run import run


def _text(rng, n):
    return random_text(rng, n)


def test_ced_prefill_on_two_ranks_matches_one_process(cache, rng):
    prompt = _text(rng, 70)
    one = run("tiny", prompt, 4, prefill="ced", quiet=True)
    for tp, ep in ((2, 1), (1, 2)):
        out = run_parallel("tiny", prompt, 4, prefill="ced", quiet=True, tp=tp, ep=ep, timeout_s=120)
        assert out["new_token_ids"] == one["new_token_ids"], f"tp {tp} ep {ep}"
        assert out["prefill"] == "ced"
        assert out["parallel"]["moe_dispatch"] == ("replicated" if ep > 1 else "gather")
        steps = out["parallel"]["expert_pairs_per_rank_per_decode_step"]
        cfg_pairs = 1 * 2 * 8  # one sequence, top-2 of tiny's experts, 8 layers
        assert len(steps) == 3 and all(sum(s) == cfg_pairs for s in steps)


def test_prefix_cache_hits_on_two_ranks(cache, rng, tmp_path):
    prompt = _text(rng, 75)
    one = run("tiny", prompt, 4, quiet=True)
    root = tmp_path / "prefix"
    first = run_parallel("tiny", prompt, 4, quiet=True, tp=2, prefix_cache=str(root), timeout_s=120)
    second = run_parallel("tiny", prompt, 4, quiet=True, tp=2, prefix_cache=str(root), timeout_s=120)
    assert first["new_token_ids"] == second["new_token_ids"] == one["new_token_ids"]
    assert first["prefix_cache"]["hits"] == 0 and second["prefix_cache"]["hits"] == 1
    assert len(list(root.glob("*/*.kv"))) >= 2  # each rank stored its own entry (keys cover its shard)
    ced = run_parallel("tiny", prompt, 4, quiet=True, ep=2, prefill="ced", prefix_cache=str(root), timeout_s=120)
    assert ced["new_token_ids"] == run("tiny", prompt, 4, prefill="ced", quiet=True)["new_token_ids"]


def test_image_on_two_ranks_matches_one_process(cache, rng, tmp_path):
    from PIL import Image

    pixels = torch.randint(0, 256, (40, 56, 3), generator=rng, dtype=torch.uint8).numpy()
    image = tmp_path / "x.png"
    Image.fromarray(pixels).save(image)
    prompt = _text(rng, 12)
    one = run("tiny-vl", prompt, 4, images=[str(image)], quiet=True)
    assert one["image_tokens"] > 0
    for tp, ep in ((2, 1), (1, 2)):
        out = run_parallel("tiny-vl", prompt, 4, images=[str(image)], quiet=True, tp=tp, ep=ep, timeout_s=120)
        assert out["new_token_ids"] == one["new_token_ids"], f"tp {tp} ep {ep}"
        assert out["image_tokens"] == one["image_tokens"] and out["images"] == [str(image)]
    with pytest.raises(ValueError, match="images: model .* has no vision tower"):
        run_parallel("tiny", prompt, 4, images=[str(image)], quiet=True, tp=2, timeout_s=120)


def test_cuda_graph_off_cuda_is_refused_before_any_rank_starts(cache):
    with pytest.raises(ValueError, match="cuda_graph: CUDA graphs need a CUDA device, the device is cpu"):
        run_parallel("tiny", "a fox", 2, cuda_graph=True, tp=2, device="cpu")
    with pytest.raises(ValueError, match=r"prefill: expected one of \['exact', 'ced'\], got 'fast'"):
        run_parallel("tiny", "a fox", 2, prefill="fast", tp=2)
