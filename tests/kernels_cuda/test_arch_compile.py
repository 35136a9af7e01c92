"""``flashrt jit compile``: the kernels cross-compiled for sm_80 / sm_89 / sm_90 without a GPU, and
the sm_80 paths the A100 profile selects, checked on the interpreter (or the GPU) against the reference.

The compiles run in a subprocess without ``TRITON_INTERPRET`` (this process imported Triton in
interpreter mode). CI compiles a representative subset here: the families whose code differs per
architecture (attention: the E4M3 decode; linear: FP8 MMA or bf16 MMA; indexer: the fp4 keys' packed
decode, sm_90 only) at the tiny model's dims
(the kernels' constexprs follow the profile, not the dims); the workflow runs the full command.
A profile forcing FP8 MMA on sm_80 and a kernel over the shared-memory limit must be reported.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from flashrt import formats, profiles
from flashrt.cli import commands as cli
from flashrt.jit_targets import ARCHS, parse_arch
from flashrt.jit_triton import interpreted
from kernel_check import DEVICE, needs_ptxas, rel_err, requires_kernels, run_both

triton = pytest.importorskip("triton")
lin = pytest.importorskip("flashrt.kernels_cuda.linear")
ROOT = Path(__file__).resolve().parents[2]
SUBSET = ("attention", "linear", "indexer")
INTERPRETED = interpreted()




def _run(args, env_extra=None, timeout=900):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | (env_extra or {})
    return subprocess.run([sys.executable, "-m", "flashrt.cli", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=timeout)


def test_arch_names_parse_and_an_unknown_one_is_a_clear_error(capsys):
    assert parse_arch("sm_80") is parse_arch("80") is parse_arch("8.0") is parse_arch("SM80") is ARCHS["sm_80"]
    with pytest.raises(ValueError, match=r"--arch: expected one of sm_80, sm_89, sm_90, got 'sm_75'"):
        parse_arch("sm_75")
    assert cli.main(["jit", "compile", "--arch", "sm_90", "sm_75"]) == 2
    err = capsys.readouterr().err
    assert "--arch: expected one of sm_80, sm_89, sm_90, got 'sm_75'" in err and "Traceback" not in err


@pytest.mark.skipif(not INTERPRETED, reason="runs under TRITON_INTERPRET=1 (the CPU test run)")
def test_interpreter_mode_is_refused(capsys):
    """Under TRITON_INTERPRET=1 (this process) the launchers plan for the interpreter: not compiled."""
    assert cli.main(["jit", "compile", "--arch", "sm_90"]) == 2
    assert "TRITON_INTERPRET=1 is set" in capsys.readouterr().err


PROFILES_OF = {"sm_80": ["a100"], "sm_89": ["rtx4090"], "sm_90": ["h100", "h200"]}


@needs_ptxas
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_the_subset_compiles_for_every_architecture(tmp_path, arch):
    """One architecture a test (each its own compile process, so a parallel run spreads them)."""
    out = tmp_path / "report.json"
    r = _run(["jit", "compile", "--arch", arch, "--models", "tiny", "--families", *SUBSET, "--out", str(out)])
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failed"] == 0 and report["profiles"] == {arch: PROFILES_OF[arch]}
    assert f"jit compile {arch} [1/" in r.stderr and "0 failed" in r.stdout  # progress on stderr, summary on stdout
    rows = report["rows"]
    assert rows and {row["arch"] for row in rows} == {arch}
    kernels = {row["kernel"] for row in rows}
    assert {"_sparse_attention_kernel", "_linear_kernel", "_quantize_kernel"} <= kernels, kernels
    for row in rows:
        assert row["status"] == "compiled" and row["registers"] > 0 and row["spill_bytes"] is not None
        assert 0 <= row["shared_bytes"] <= row["smem_limit"] == ARCHS[arch].smem_limit, row
    promote = {row["constexprs"]["PROMOTE"] for row in rows if row["kernel"] == "_linear_kernel"}
    assert promote == ({False} if arch == "sm_80" else {True}), promote  # FP8 MMA from sm_89
    # the fp4 keys' packed decode (bf16x2 multiplies: sm_90) only where the target has it
    asm = {row["constexprs"]["ASM"] for row in rows if row["kernel"] == "_index_scores_kernel"}
    assert asm == ({True} if arch == "sm_90" else {False}), asm


@needs_ptxas
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_the_prefix_attention_fits_each_cards_shared_memory_at_512_wide_heads(tmp_path, arch):
    """``small``'s heads of 512 (the released width): the tile of each card's profile within its per-block
    shared memory (the default tile's 124 KB is over the RTX 4090's 99 KB)."""
    out = tmp_path / "report.json"
    r = _run(["jit", "compile", "--arch", arch, "--models", "small", "--families", "prefix_attention", "--out", str(out)])
    report = json.loads(out.read_text())
    assert r.returncode == 0 and report["failed"] == 0, [row["error"] for row in report["rows"] if row["error"]]
    wide = [row for row in report["rows"] if row["constexprs"]["D"] == 512]
    assert wide and all(row["shared_bytes"] <= row["smem_limit"] == ARCHS[arch].smem_limit for row in wide)


def _broken_a100(tmp_path) -> Path:
    """A user profile for sm_80 that forces FP8 tensor-core MMA (which sm_80 does not have)."""
    text = (ROOT / "hwconfigs" / "a100.yaml").read_text().replace("fp8_mma: false", "fp8_mma: true")
    text = text.replace("name: a100", "name: a100-fp8mma").replace("match_name: A100", "match_name: A100 test")
    assert "fp8_mma: true" in text
    (tmp_path / "a100-fp8mma.yaml").write_text(text)
    return tmp_path


@needs_ptxas
def test_a_profile_forcing_fp8_mma_on_sm80_fails_with_the_compilers_error(tmp_path):
    r = _run(["jit", "compile", "--arch", "sm_80", "--models", "tiny", "--families", "linear", "--json"],
             {"FLASHRT_PROFILE_DIR": str(_broken_a100(tmp_path))})
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads(r.stdout)
    failed = [row for row in report["rows"] if row["status"] == "failed"]
    assert report["failed"] == len(failed) > 0 and report["profiles"]["sm_80"] == ["a100", "a100-fp8mma"]
    assert all(row["profiles"] == ["a100-fp8mma"] and row["kernel"] == "_linear_kernel" for row in failed)
    assert all("fp8e4nv" in row["error"] for row in failed), failed[0]["error"]  # the compiler's own message
    assert all(row["status"] == "compiled" for row in report["rows"] if "a100" in row["profiles"])


GEMV_RULES = """\
      - [4, {BLOCK_M: 16, BLOCK_N: 64, BLOCK_K: 256, num_warps: 4, num_stages: 3, split_min_blocks: 1, gemv: true}]
      - [16, {BLOCK_M: 16, BLOCK_N: 64, BLOCK_K: 128, num_warps: 4, num_stages: 3}]
      - [null, {BLOCK_M: 64, BLOCK_N: 64, BLOCK_K: 64, num_warps: 4, num_stages: 3}]
"""
GEMV_TILES = "tiles:\n  linear:\n    linear:\n" + GEMV_RULES + "  linear_plain:\n    plain:\n" + GEMV_RULES


def _gemv_profiles(tmp_path) -> Path:
    """User profiles putting a ``gemv`` rule first for up to 4 rows of ``linear`` and of the plain-weight
    linear: one over h200 (sm_90), one over a100 (sm_80, where E4M3 is decoded on the bits)."""
    for base, cap in (("h200", "9.0"), ("a100", "8.0")):
        (tmp_path / f"{base}-gemv.yaml").write_text(
            f"name: {base}-gemv\nextends: {base}\nmatch_device_type: cuda\nmatch_name: GEMV test\n"
            f"match_capability: [\"{cap}\"]\n" + GEMV_TILES)
    return tmp_path


@needs_ptxas
@pytest.mark.parametrize("arch,profile", [("sm_90", "h200-gemv"), ("sm_80", "a100-gemv")])
def test_a_gemv_rule_compiles(tmp_path, arch, profile):
    """The decode GEMVs (kernels_cuda/gemv.py) compile for Hopper (the E4M3 conversion) and Ampere
    (E4M3 decoded on the bits), within the shared-memory limit."""
    r = _run(["jit", "compile", "--arch", arch, "--models", "tiny", "--families", "linear", "linear_plain", "--json"],
             {"FLASHRT_PROFILE_DIR": str(_gemv_profiles(tmp_path))})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert profile in report["profiles"][arch] and report["failed"] == 0
    for kernel in ("_gemv_kernel", "_plain_gemv_kernel"):
        gemv = [row for row in report["rows"] if row["kernel"] == kernel]  # the base profile may have GEMVs too
        assert any(profile in row["profiles"] for row in gemv), kernel
        assert all(row["status"] == "compiled" for row in gemv), kernel
        assert all(row["shared_bytes"] <= row["smem_limit"] for row in gemv)


SMEM_SCRIPT = textwrap.dedent('''
    import json, types, torch, triton, triton.language as tl
    from flashrt import jit_compile
    from flashrt.jit_targets import ARCHS

    @triton.jit
    def _big_tile_kernel(x_ptr, y_ptr, o_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        a = tl.load(x_ptr + i[:, None] * N + i[None, :])
        b = tl.load(y_ptr + i[:, None] * N + i[None, :])
        tl.store(o_ptr + i[:, None] * N + i[None, :], tl.dot(a, b))

    def launch(x, y, o):
        _big_tile_kernel[(1,)](x, y, o, N=256, num_warps=8, num_stages=1)

    def cases(device, dims, dtype):
        x = torch.zeros(256, 256, dtype=torch.bfloat16)
        yield types.SimpleNamespace(name="big tile", fn=launch, args=(x, x.clone(), torch.zeros(256, 256)))

    report = jit_compile.cross_compile([ARCHS["sm_89"], ARCHS["sm_90"]], {"any": {}}, [("big", cases)])
    print(json.dumps(report))
''')


@needs_ptxas
def test_shared_memory_over_the_limit_is_a_failure(tmp_path):
    """Two 256 x 256 bf16 dot operands staged in shared memory (256 KB): over sm_89's 99 KB and
    sm_90's 227 KB per block."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = tmp_path / "big_tile.py"  # Triton reads a kernel's source from its file
    script.write_text(SMEM_SCRIPT)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    rows = {row["arch"]: row for row in report["rows"]}
    assert report["failed"] == 2 and set(rows) == {"sm_89", "sm_90"}
    for arch, row in rows.items():
        assert row["status"] == "failed" and row["shared_bytes"] > ARCHS[arch].smem_limit
        assert f"exceeds the {arch} per-block limit of {ARCHS[arch].smem_limit} B" in row["error"]


CVT_SCRIPT = textwrap.dedent('''
    import json, triton, triton.language as tl
    from flashrt.jit_compile import compile_kernel
    from flashrt.kernels_cuda.codecs import e4m3_cvt

    @triton.jit
    def _decode_kernel(x_ptr, o_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(o_ptr + i, e4m3_cvt(tl.load(x_ptr + i)))

    out = {}
    for cc in (80, 89, 90):
        kernel, error = compile_kernel(_decode_kernel, {"x_ptr": "*u8", "o_ptr": "*fp32", "N": "constexpr"},
                                       {(2,): 64}, {}, {}, cc)
        out[cc] = error or ("e4m3x2" in kernel.asm["ptx"])
    print(json.dumps(out))
''')


@needs_ptxas
def test_a_kernel_branches_on_the_architecture_it_is_compiled_for(tmp_path):
    """E4M3 decoding by the hardware conversion on sm_89+ and on the bits on sm_80, whatever GPU
    (or none) the compiling machine has: the target a kernel reads at compile time is the one
    compiled for, not the machine's."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = tmp_path / "cvt.py"
    script.write_text(CVT_SCRIPT)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"80": False, "89": True, "90": True}


# ------------------------------------------------------------ the A100 profile's paths, computed


@requires_kernels
def test_the_a100_profile_selects_bf16_mma_and_it_matches_the_reference(rng):
    """FP8 storage, bf16 math: a100.yaml turns the FP8 MMA off (whatever the device reports); the
    linear and the experts then dequantize both operands before tl.dot and match the reference."""
    with profiles.using("a100"):
        assert lin.mma_mode("fp8_w")[0] is False
        x = (torch.randn(5, 96, generator=rng) * 0.5).to(torch.bfloat16).to(DEVICE)
        w = formats.quantize(torch.randn(40, 96, generator=rng) * 0.25, "fp8_w").to(DEVICE)
        got, want = run_both("linear", x, w)
        assert got.dtype == torch.bfloat16 and rel_err(got, want) < 1e-3
        experts = [formats.quantize(torch.randn(2, *shape, generator=rng) * 0.25, "fp8_w").to(DEVICE)
                   for shape in ((32, 96), (32, 96), (96, 32))]
        idx = torch.randint(0, 2, (5, 1), generator=rng).to(torch.int32).to(DEVICE)
        got, want = run_both("moe_experts", x, torch.rand(5, 1, generator=rng).to(DEVICE), idx, *experts, 10.0)
        assert rel_err(got, want) < 1e-3
    with profiles.using("h200"):
        assert lin.mma_mode("fp8_w")[0] is True  # the sm_89+ profiles keep the FP8 MMA
