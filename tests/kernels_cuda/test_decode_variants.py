"""The decode kernels' Triton variants do not follow the entry count: a decode's rows grow by one
compressed entry a step, and each new variant met mid-run is a compile in the middle of a step.

Recorded (``flashrt.jit_compile.recording``: nothing is compiled or run) in a subprocess without
``TRITON_INTERPRET`` (this process imported Triton in interpreter mode), as test_arch_compile.py
does: ``topk_positions`` (with and without candidates) and ``candidate_blocks`` at the shipped
models' ``k`` over entry counts 1 .. 1024 give one variant of each kernel, and the MoE routing
tables past the one-program kernel one variant each over a prefill chunk's pair counts. The bucketed tiles the
kernels take (``select.min_summary``; ``k`` past the row's length) are checked against the
reference under the interpreter here. ``tools/decode_variants.py`` over the tiny model's decode
finds no variant met after its first step.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

from kernel_check import DEVICE, requires_kernels  # noqa: E402
from test_arch_compile import ROOT, needs_ptxas  # noqa: E402
from test_topk import tied_scores  # noqa: E402

import flashrt  # noqa: E402
from flashrt import ops  # noqa: E402
from flashrt.kernels_cuda import topk  # noqa: E402

VARIANTS_SCRIPT = textwrap.dedent('''
    import collections, json, sys, torch
    from flashrt import profiles
    from flashrt.jit_compile import kernel_name, recording, variant_key
    from flashrt.jit_targets import ARCHS
    from flashrt.kernels_cuda.indexer import candidate_blocks
    from flashrt.kernels_cuda.moe_tables import ROUTE, route_tables
    from flashrt.kernels_cuda.topk import topk_positions
    from flashrt.kernels_cuda.warmup import MODELS

    counts = [int(t) for t in sys.argv[2].split(",")]
    found = collections.defaultdict(set)  # (model, launch, kernel) -> variant keys
    where = {}

    def record(fn, signature, constexprs, options, attrs):
        name = kernel_name(fn)
        found[where["at"] + (name,)].add(variant_key(fn.__module__, name, signature, constexprs, attrs,
                                                     options.__dict__))

    g = torch.Generator().manual_seed(int(sys.argv[3]))
    with profiles.using(sys.argv[1]), recording(ARCHS["sm_90"], record):
        for model in ("small", "v4.1-flash"):
            d = MODELS[model]
            for T in counts:
                B = 8
                scores = torch.randn(B, 1, T, generator=g)
                vis = torch.randint(1, T + 1, (B, 1), generator=g, dtype=torch.int32)
                where["at"] = (model, "topk_positions")
                topk_positions(scores, d["index_topk"], None)
                where["at"] = (model, "topk_positions candidates")
                topk_positions(scores, d["index_topk"], torch.rand(B, 1, T, generator=g) < 0.5)
                where["at"] = (model, "candidate_blocks")
                candidate_blocks(scores, vis, d["candidate_topk_blocks"], d["candidate_block_size"])
            k = d["n_activated_experts"]
            for tokens in sorted({1 + ROUTE["max_pairs"] // k, 512, 1024, 2048, 2049, 4096, 5461, 8192}):
                if tokens * k > ROUTE["max_pairs"]:  # prefill chunks past the one-program tables
                    where["at"] = (model, "route_tables")
                    idx = torch.randint(0, d["n_routed_experts"], (tokens, k), generator=g, dtype=torch.int32)
                    route_tables(idx, torch.rand(tokens, k, generator=g), d["n_routed_experts"], 64)
    print(json.dumps({" / ".join(k): len(v) for k, v in sorted(found.items())}))
''')


def _entry_counts(seed: int) -> list[int]:
    """1 .. 1024: the ends, every class Triton could specialise an integer on (== 1, % 16 == 0,
    neither), and random counts between."""
    g = torch.Generator().manual_seed(seed)
    return sorted({1, 2, 7, 8, 9, 16, 48, 511, 512, 513, 1023, 1024, *torch.randint(2, 1025, (12,), generator=g).tolist()})


@needs_ptxas
@pytest.mark.parametrize("profile", ["h200", "h100"])
def test_decode_kernels_have_one_variant_from_1_to_1024_entries(profile, tmp_path):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = tmp_path / "variants.py"
    script.write_text(VARIANTS_SCRIPT)
    counts = _entry_counts(seed)
    r = subprocess.run([sys.executable, str(script), profile, ",".join(map(str, counts)), str(seed)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    found = json.loads(r.stdout.strip().splitlines()[-1])
    for model in ("small", "v4.1-flash"):
        for launch, kernels in (("topk_positions", ("_select_kernel",)),
                                ("topk_positions candidates", ("_select_kernel",)),
                                ("candidate_blocks", ("_block_keys_kernel", "_select_kernel", "_expand_kernel"))):
            for kernel in kernels:
                assert found.get(f"{model} / {launch} / {kernel}") == 1, (model, launch, kernel, counts, found)
        for kernel in ("_route_pairs_kernel", "_route_tiles_kernel"):  # any prefill chunk's pair count
            assert found.get(f"{model} / route_tables / {kernel}") == 1, (model, kernel, found)
    assert not any("_chunk_max_kernel" in k for k in found), found  # rows of <= 1024 entries need no chunk pass


@needs_ptxas
def test_a_decode_meets_no_new_variant_after_its_first_step(tmp_path):
    """tools/decode_variants.py over the tiny model's decode (its compressed entries pass 1, 16,
    32, 64 ...): every variant is met in the prefill or at the first step."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "variants.json"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "decode_variants.py"), "--model", "tiny", "--batch", "2",
                        "--prompt", "20", "--steps", "60", "--json", str(out)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["prefill_variants"] > 0 and report["positions"]["20"], report
    assert list(report["positions"]) == ["20"], r.stdout[-3000:]
    assert "positions with new variants after it: none" in r.stdout


@needs_ptxas
def test_small_meets_no_new_variant_as_its_window_fills(tmp_path):
    """`small` at batch 8 from position 126: the window part of the attention's indices fills at
    128 and the blocks a split reads change (an integer Triton would specialise on == 1)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "decode_variants.py"), "--model", "small", "--batch", "8",
                        "--prompt", "126", "--steps", "3"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "positions with new variants after it: none" in r.stdout, r.stdout[-3000:]


GEMV_SCRIPT = textwrap.dedent('''
    import collections, dataclasses, json, torch
    from flashrt import formats, profiles
    from flashrt.jit_compile import kernel_name, recording, variant_key
    from flashrt.jit_targets import ARCHS
    from flashrt.kernels_cuda import linear, linear_plain

    found = collections.defaultdict(set)

    def record(fn, signature, constexprs, options, attrs):
        name = kernel_name(fn)
        found[name].add(variant_key(fn.__module__, name, signature, constexprs, attrs, options.__dict__))

    rule = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3, split_min_blocks=1, gemv=True)
    base = profiles.load_profile("h200")
    tiles = dict(base.tiles, linear=dict(base.tiles["linear"], linear=[[4, rule]]),
                 linear_plain=dict(base.tiles["linear_plain"], plain=[[4, rule]]))
    w8 = formats.quantize(torch.zeros(1792, 5120), "fp8_w")
    w16 = torch.zeros(1024, 5120, dtype=torch.bfloat16)  # K split at every batch here, as w8's
    with profiles.using(dataclasses.replace(base, tiles=tiles)), recording(ARCHS["sm_90"], record):
        for m in (1, 2, 3, 4):
            linear.linear(torch.zeros(m, 5120, dtype=torch.bfloat16), w8)
            linear_plain.plain_linear(torch.zeros(m, 5120, dtype=torch.bfloat16), w16)
    print(json.dumps({k: len(v) for k, v in found.items()}))
''')


@needs_ptxas
def test_a_gemv_rule_has_one_variant_for_its_batches(tmp_path):
    """A decode batch of 1 .. 4 rows through GEMV rules (fp8 and plain weights; shapes split over K at
    each of them) launches one variant of each kernel: the rows are not specialised on, so the
    warm-up's one-row launches compile what the larger batches need."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = tmp_path / "gemv_variants.py"
    script.write_text(GEMV_SCRIPT)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"_gemv_kernel": 1, "_plain_gemv_kernel": 1}


# ------------------------------------------------------------ the bucketed tiles, computed


def _same(scores, k, cand=None):
    with flashrt.use_backend("reference"):
        want = ops.topk_positions(scores, k, cand)
    with flashrt.use_backend("cuda"):
        got = ops.topk_positions(scores.to(DEVICE), k, None if cand is None else cand.to(DEVICE))
    assert got.shape == want.shape and torch.equal(got.cpu(), want)


@requires_kernels
@pytest.mark.parametrize("T", [1, 5, 40, 300])
def test_summary_floored_and_k_past_the_row_match_the_reference(T, monkeypatch, rng):
    """``min_summary`` below, at and above the row's summary (one level, and chunks of 8 at T = 300
    with summary 64), and ``k`` larger than the row (every valid entry picked, ``-1`` after)."""
    for floor in (16, 64, 256):
        monkeypatch.setitem(topk.TILES, "select", {**topk.TILES["select"], "summary": 64, "min_summary": floor})
        scores = tied_scores(2, 2, T, rng, p_special=0.3)
        for k in (3, T, T + 7, 512):
            _same(scores, k)
            _same(scores, k, torch.rand(2, 2, T, generator=rng) < 0.6)
