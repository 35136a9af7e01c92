"""What ``ptxas`` makes of an fp8 ``mma.sync`` for sm_90, on a machine without a GPU: a Gluon kernel of one
``mma_v2`` on E4M3 operands [64, 64] x [64, 8] (4 warps) compiled with the installed Triton; prints (or
writes with ``--out``) the PTX MMA instructions Triton emitted and the SASS opcodes that carry them
(``HMMA`` with ``F2FP`` conversions: emulated on fp16 MMAs; ``QMMA``: native).

    python tools/fp8_mma_sync.py [--arch 90] [--out benchmarks/results/cpu-sm90-t36-fp8-mma-sync.json]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import mma_v2  # noqa: E402

from flashrt.jit_compile import answering_as, source  # noqa: E402

OPS = ("HMMA", "QMMA", "F2FP", "PRMT", "I2F", "F2F")


@gluon.jit
def _one_mma(a_ptr, b_ptr, c_ptr, KW: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=KW)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=KW)
    ra = gl.arange(0, 64, layout=gl.SliceLayout(1, a_l))
    ca = gl.arange(0, 64, layout=gl.SliceLayout(0, a_l))
    a = gl.load(a_ptr + ra[:, None] * 64 + ca[None, :])
    rb = gl.arange(0, 64, layout=gl.SliceLayout(1, b_l))
    cb = gl.arange(0, 8, layout=gl.SliceLayout(0, b_l))
    b = gl.load(b_ptr + rb[:, None] * 8 + cb[None, :])
    acc = mma_v2(a, b, gl.zeros([64, 8], gl.float32, mma))
    rc = gl.arange(0, 64, layout=gl.SliceLayout(1, mma))
    cc = gl.arange(0, 8, layout=gl.SliceLayout(0, mma))
    gl.store(c_ptr + rc[:, None] * 8 + cc[None, :], acc)


def report(arch: int, kw: int = 16) -> dict:
    """Compile the kernel for ``sm_<arch>``; its PTX MMA lines and SASS opcode counts."""
    sig = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*fp32", "KW": "constexpr"}
    with answering_as(arch) as target:
        kernel = triton.compile(source(_one_mma, sig, {(3,): kw}, {}), target=target, options={"num_warps": 4})
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-sass", path], capture_output=True,
                              text=True, check=True).stdout
    ptx = [line.strip() for line in kernel.asm["ptx"].splitlines() if line.strip().startswith("mma.")]
    ops = collections.Counter(re.findall(r"\b(" + "|".join(OPS) + r")\b", sass))
    return {"triton": triton.__version__, "arch": f"sm_{arch}", "k_width": kw, "ptx_mma": ptx,
            "sass": {k: ops.get(k, 0) for k in OPS}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability to compile for (90: sm_90)")
    ap.add_argument("--out", help="write the report as JSON here (a new file; an existing one is refused)")
    args = ap.parse_args(argv)
    r = report(args.arch)
    if args.out:
        if os.path.exists(args.out):
            ap.error(f"--out: {args.out} exists; give a new file")
        with open(args.out, "w") as f:
            json.dump(r, f, indent=1)
    print(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
