"""Compile the CUDA launchers' Triton kernels for sm_90 on a machine WITHOUT a GPU and report what
the compiler made of them: registers, spilled bytes, shared memory, and the SASS instruction mix
(``HGMMA`` / ``QGMMA`` = Hopper wgmma on 16-bit / fp8 operands, ``HMMA`` = the older mma path,
``F2FP`` = conversions, e.g. fp8 operands widened to fp16 for ``HMMA``, ``LDL``/``STL`` =
local-memory spills).
Costs no device time: use it to check a kernel change for spills and wgmma before timing it.

    python tools/sm90_compile.py attention --B 64 --S 1 [--tiles '{"attention": {"K_BLOCK": 16}}']
    python tools/sm90_compile.py qgmma --B 8 --S 1024   # kernels_cuda/experts_qgmma.py (--cold: no ring)
    python tools/sm90_compile.py moe_route --B 8        # also linear, linear_v41 (the released decode projections),
                                                        # linear_plain, moe, moe_tables, mhc, kv_store,
                                                        # norm_rope_quant, prefix_attention, topk (--S: entries),
                                                        # quant (fp4_b16 store; --cold: fp8), moe (--cold: the
                                                        # experts' scales K major; --moe-dims released: the
                                                        # released model's experts at up to one token;
                                                        # --profile-set expert_fp4=words: their codes in words)

How: the launcher runs on CPU tensors as it would on an sm_90 GPU, each kernel specialization it
launches recorded instead of compiled (:func:`flashrt.jit_compile.recording`, shared with
``flashrt jit compile``, which compiles every variant for sm_80 / sm_89 / sm_90 and checks limits);
``triton.compile`` builds the cubin with the ptxas that Triton ships. Compile with
the Triton version of the GPU image for numbers that match the device.
"""
from __future__ import annotations

import argparse
import atexit
import collections
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
# a cache of this run's own: Triton's cache key holds the target but not what the active driver
# answered (cuda_capability_geq), so a shared cache could hand back a compile made under other answers
os.environ["TRITON_CACHE_DIR"] = _CACHE = tempfile.mkdtemp(prefix="sm90-compile-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from flashrt.jit_compile import answering_as, recording, source  # noqa: E402
from flashrt.jit_targets import ARCHS  # noqa: E402
from sass_pieces import pieces_of  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
DUMP_DIR = os.environ.get("SM90_DUMP_DIR", "/tmp/sm90")  # <kernel>-<n>.cubin / .ttgir / .ptx / .sass
_DUMPS: collections.Counter = collections.Counter()  # compiles of each kernel so far in this run
SASS_OPS = ("HGMMA", "QGMMA", "HMMA", "F2FP", "LDL", "STL", "LDG", "LDGSTS", "UTMALDG", "LDS", "STS", "LDSM", "STSM", "FFMA",
            "HMUL2", "MUFU", "BAR", "WARPGROUP", "ATOMG")


def capture(call) -> list[tuple]:
    """(kernel, signature, constexprs, options, attrs) of each kernel ``call()`` launches; none is
    compiled or run (:func:`flashrt.jit_compile.recording`, with sm_90's device facts)."""
    seen = []
    with recording(ARCHS["sm_90"], lambda *spec: seen.append(spec)):
        call()
    return seen


def compile_report(fn, signature, constexprs, options, attrs) -> dict:
    """Compile one captured specialization for sm_90; its resources and SASS mix. Triton's active
    driver answers as an sm_90 GPU meanwhile (:func:`flashrt.jit_compile.answering_as`): the kernels'
    ``cuda_capability_geq`` branches read it, not the target given to ``triton.compile``."""
    with answering_as(TARGET.arch) as target:
        kernel = triton.compile(source(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    meta = kernel.metadata
    cubin = kernel.asm["cubin"]
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    _DUMPS[fn.__name__] += 1  # one dump per compile: a kernel's variants in one run do not overwrite each other
    path = os.path.join(DUMP_DIR, f"{fn.__name__}-{_DUMPS[fn.__name__]}.cubin")
    os.makedirs(DUMP_DIR, exist_ok=True)
    with open(path, "wb") as f:
        f.write(cubin)
    for ext in ("ttgir", "ptx"):
        with open(path[:-5] + ext, "w") as f:
            f.write(kernel.asm[ext])
    usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", path],
                           capture_output=True, text=True).stdout
    sass = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-sass", path], capture_output=True, text=True).stdout
    with open(path[:-5] + "sass", "w") as f:
        f.write(sass)
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    ops, loads, stores, code = collections.Counter(), collections.Counter(), collections.Counter(), []
    for line in sass.splitlines():
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)([A-Z0-9.]*)([^;]*)", line)
        if m:
            ops[m.group(2)] += 1
            code.append((int(m.group(1), 16), m.group(2), m.group(4)))
            if m.group(2) in ("LDG", "LDGSTS"):  # global loads with their width (U8, 64, 128, ...)
                loads[m.group(2) + m.group(3)] += 1
            if m.group(2) == "STG":  # and the global stores
                stores[m.group(2) + m.group(3)] += 1
    return {"kernel": fn.__name__, "triton": triton.__version__, "num_warps": meta.num_warps,
            "num_stages": meta.num_stages,
            "registers": int(regs.group(1)) if regs else None, "stack_bytes": int(stack.group(1)) if stack else None,
            "shared_bytes": meta.shared, "sass": {k: ops.get(k, 0) for k in SASS_OPS}, "global_loads": dict(loads),
            "global_stores": dict(stores),
            "instructions": len(code), "mma_loop": mma_loop(code), "dump": path[:-6],
            # instructions up to the first EXIT: a loop-free kernel's main path (out-of-line slow
            # paths, e.g. an IEEE division's, come after it)
            "to_first_exit": next((i + 1 for i, c in enumerate(code) if c[1] == "EXIT"), len(code)),
            # the loop issuing the most asynchronous copies (a warp-specialized kernel's producer), with its
            # straight-line pieces: what each path through a trip runs
            "copy_loop": mma_loop(code, ("LDGSTS",), pieces=True),
            # the loop issuing the most fp32 multiply-adds (a GEMV's multiply-add K loop)
            "fma_loop": mma_loop(code, ("FFMA",)),
            "constexprs": {fn.arg_names[k[0]]: str(v) for k, v in constexprs.items()}}


SPAN_OPS = ("BAR", "LDS", "STS", "LDL", "STL")  # counted in each loop of ``mma_loop``'s list


def mma_loop(code: list[tuple], ops: tuple = ("HMMA", "HGMMA", "QGMMA"), pieces: bool = False) -> dict | None:
    """The loop (a backward branch's span of the SASS) holding the most MMA instructions (or of
    ``ops``): its instruction count and its 12 most frequent opcodes, the static cost of one trip of
    a GEMM's K loop (None: no loop holds one); ``pieces``: also its straight-line pieces (:func:`pieces_of`)."""
    best, spans = None, []
    for addr, op, rest in code:
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            body = [o for a, o, _ in code if int(target.group(1), 16) <= a <= addr]
            mmas = sum(o in ops for o in body)
            if mmas:  # with the shared-memory and local traffic and the barriers a trip takes
                spans.append({"instructions": len(body), "count": mmas,
                              **{o: body.count(o) for o in SPAN_OPS if o in body}})
            if mmas and (best is None or mmas > best[0]):
                best = (mmas, body, (int(target.group(1), 16), addr))
    if best is None:
        return None
    return {"instructions": len(best[1]), "opcodes": dict(collections.Counter(best[1]).most_common(12)),
            "sass_range": [hex(a) for a in best[2]],  # the loop's first and last addresses in the dump
            "count": best[0],  # its instructions of ``ops``
            "loops": spans,  # every loop holding one (instructions, count, SPAN_OPS), nested ones included
            **({"pieces": pieces_of([c for c in code if best[2][0] <= c[0] <= best[2][1]])} if pieces else {})}


def attention_call(B: int, S: int, cold: bool, kv: str = "both"):
    """The released decode / prefill attention call (64 heads x 512, fp8 ring + fp4_b16 picks) on CPU tensors;
    ``kv`` "fp8" / "fp4_b16": one segment of that format alone (a K block's code for one format)."""
    from flashrt.formats import QTensor
    from flashrt.kernels_cuda import attention

    H, D, W, TOPK, T = 64, 512, 128, 512, 4096

    def stored(fmt, shape):
        per, bs = (1, 32) if fmt == "fp8" else (2, 16)
        data = torch.zeros(*shape[:-1], shape[-1] // per, dtype=torch.uint8)
        scale = torch.zeros(*shape[:-1], shape[-1] // bs, dtype=torch.uint8)
        return QTensor(data, scale, fmt, tuple(shape))

    q = torch.zeros(B, S, H, D, dtype=torch.bfloat16)
    if kv != "both":
        segments, idx = (stored(kv, (1, T, D)),), torch.zeros(B, S, W + TOPK, dtype=torch.int32)
    else:
        segments = (stored("fp8", (B, W, D)), stored("fp4_b16", (1, T, D)))
        segments += (stored("fp4_b16", (1, B * TOPK, D)),) if cold else ()
        idx = (torch.zeros(B, S, W, dtype=torch.int32), torch.zeros(B, S, TOPK, dtype=torch.int32))  # window ‖ picks
    return lambda: attention.sparse_attention(q, segments, idx, torch.zeros(H), D ** -0.5)


def linear_plain_call(B: int, S: int, cold: bool, fp32: bool = True):
    """The head of ``small`` (129,280 x 1,024 bf16) on B * S rows of fp32 (or bf16) x."""
    from flashrt.kernels_cuda import linear_plain

    x = torch.zeros(B * S, 1024, dtype=torch.float32 if fp32 else torch.bfloat16)
    w = torch.zeros(129280, 1024, dtype=torch.bfloat16)
    return lambda: linear_plain.plain_linear(x, w)


def moe_route_call(B: int, S: int, cold: bool):
    """The released gate: 384 experts, top-6, sqrtsoftplus, over B * S tokens of 4,096."""
    from flashrt.kernels_cuda import moe_route

    x, w = torch.zeros(B * S, 4096, dtype=torch.bfloat16), torch.zeros(384, 4096, dtype=torch.bfloat16)
    return lambda: moe_route.moe_route(x, w, torch.zeros(384), 6, "sqrtsoftplus", True, 2.5)


def moe_tables_call(B: int, S: int, cold: bool):
    """The routing tables of B * S tokens, top-6 of 384 experts."""
    from flashrt.kernels_cuda import moe_tables

    idx, w = torch.zeros(B * S, 6, dtype=torch.int32), torch.rand(B * S, 6)
    return lambda: moe_tables.route_tables(idx, w, 384, 16)


def _as_h200():
    """The GEMM launchers' device queries answered as an H200 (fp8 MMA, 132 SMs)."""
    from flashrt.kernels_cuda import linear

    linear.supports_fp8_mma, linear.num_sms = (lambda: True), (lambda: 132)


def _fp8_w(n: int, k: int):
    """A zero fp8_w weight [n, k] with its 32 x 32 scale bytes, its largest scale byte recorded (as a model's build
    records it)."""
    from flashrt.formats import QTensor

    return QTensor(torch.zeros(n, k, dtype=torch.float8_e4m3fn), torch.zeros(n // 32, k // 32, dtype=torch.uint8),
                   "fp8_w", (n, k), scale_max=0)


def linear_call(B: int, S: int, cold: bool):
    """``small``'s fp8_w projections at decode rows: wq_a (512 x 1,024, K split, x quantized in the
    kernel) and wo_b (1,024 x 2,048), their largest scale byte recorded as a model's build records it;
    and an fp4_w weight of the same shape."""
    from flashrt.formats import QTensor
    from flashrt.kernels_cuda import linear

    _as_h200()
    x, xo = torch.zeros(B * S, 1024, dtype=torch.bfloat16), torch.zeros(B * S, 2048, dtype=torch.bfloat16)
    fp4 = QTensor(torch.zeros(512, 512, dtype=torch.uint8), torch.zeros(512, 32, dtype=torch.uint8), "fp4_w", (512, 1024))
    return lambda: (linear.linear(x, _fp8_w(512, 1024)), linear.linear(xo, _fp8_w(1024, 2048)), linear.linear(x, fp4))


def linear_v41_call(B: int, S: int, cold: bool):
    """The released model's fp8_w decode projections at B * S rows: wq_a with wkv (1,792 x 5,120), wq_b
    (32,768 x 1,280) and wo_b (5,120 x 8,192), as the h200 profile's linear rules take them (the streamed fp8
    warpgroup MMA from 2 rows)."""
    from flashrt.kernels_cuda import linear

    _as_h200()
    shapes = ((1792, 5120), (32768, 1280), (5120, 8192))
    xs = [torch.zeros(B * S, k, dtype=torch.bfloat16) for _, k in shapes]
    return lambda: [linear.linear(x, _fp8_w(n, k)) for x, (n, k) in zip(xs, shapes)]


MOE_DIMS = {"small": (1024, 512, 32, 4),  # D, I, routed experts, slots a token
            # the released model's D, I and top-6 over 8 experts: up to one token (6 pairs, a row tile
            # each) the same launches as over its 384, without their gigabytes
            "released": (5120, 2304, 8, 6)}


def moe_call(B: int, S: int, cold: bool, dims: str = "small", shared: bool = False):
    """The routed experts (fp4_w) and a shared expert (fp8_w) over B * S tokens at ``MOE_DIMS[dims]``, in
    two calls (``shared``: in one, the op's ``shared`` argument); ``cold``: the routed experts' scales K
    major; their codes as the profile's ``expert_fp4`` says."""
    from flashrt import formats, profiles
    from flashrt.kernels_cuda import moe
    from flashrt.kernels_cuda.launch import zeros_stored

    _as_h200()
    (D, I, E, k), n = MOE_DIMS[dims], B * S
    # laid out as the model's load lays them out (tiles.linear.fp4_scale_fold applies)
    words = profiles.active_profile().expert_fp4 == "words"
    w = lambda fmt, e: tuple(formats.as_expert_stack(zeros_stored(fmt, shape, None, "cpu"), cold, words)
                             for shape in ((e, I, D), (e, I, D), (e, D, I)))
    x, idx = torch.zeros(n, D, dtype=torch.bfloat16), torch.zeros(n, k, dtype=torch.int32)
    one, first = torch.ones(n, 1), torch.zeros(n, 1, dtype=torch.int32)
    if shared:
        return lambda: moe.moe_experts(x, torch.rand(n, k), idx, *w("fp4_w", E), 10.0, shared=w("fp8_w", 1))
    return lambda: (moe.moe_experts(x, torch.rand(n, k), idx, *w("fp4_w", E), 10.0),
                    moe.moe_experts(x, one, first, *w("fp8_w", 1), 10.0))


def mhc_call(B: int, S: int, cold: bool):
    """``small``'s mixing coefficients (hc 4 x 1,024, bf16 x) over B * S tokens: K split, finished in the kernel."""
    from flashrt.kernels_cuda import mhc

    x, fn = torch.zeros(B, S, 4, 1024, dtype=torch.bfloat16), torch.zeros(24, 4096)
    pre, w = torch.zeros(B, S, 4), torch.ones(1024, dtype=torch.bfloat16)
    return lambda: (mhc.hc_coefficients(x, fn, torch.ones(3), torch.zeros(24), 20, 1e-6, 1e-20),
                    mhc.hc_collapse_norm(x, pre, w, 1e-6))


def norm_rope_quant_call(B: int, S: int, cold: bool):
    """The KV rows of B x S tokens: the window ring's (512 wide, kv_norm, fp8), a compressed entry
    (fp4_b16, no norm), its index key (128 wide, k_norm, fp4_b32) and the indexer's 32 query heads
    (128 wide, fp4_b32 fake quantization); rope on the last 64."""
    from flashrt.kernels_cuda import norm_rope_quant as nrq

    f = torch.polar(torch.ones(B, S, 32), torch.zeros(B, S, 32))
    x, k = torch.zeros(B, S, 512, dtype=torch.bfloat16), torch.zeros(B, S, 128, dtype=torch.bfloat16)
    w, wk = torch.ones(512, dtype=torch.bfloat16), torch.ones(128, dtype=torch.bfloat16)
    q = torch.zeros(B, S, 32, 128, dtype=torch.bfloat16)  # the indexer's query heads: fp4_b32 fake quantization
    return lambda: (nrq.norm_rope_quantize(x, w, 1e-6, f, "fp8"), nrq.norm_rope_quantize(x, None, 0.0, f, "fp4_b16"),
                    nrq.norm_rope_quantize(k, wk, 1e-6, f, "fp4_b32"),
                    nrq.norm_rope_quantize(q, None, 0.0, f, "fp4_b32", torch.bfloat16))


def kv_store_call(B: int, S: int, cold: bool):
    """The paged main KV of a decode step (fp4_b16, 512 wide, 64-entry pages): B rows x S new entries
    stored, and B rows x 640 picks looked up; B x S new tokens into an fp8 window ring."""
    from flashrt.kernels_cuda import kv_store
    from flashrt.kv.util import empty_qtensor

    pool, vals = empty_qtensor("fp4_b16", (1, 64 * 64, 512), "cpu"), empty_qtensor("fp4_b16", (B, S, 512), "cpu")
    table, entry = torch.zeros(B, 16, dtype=torch.long), torch.zeros(B, S, dtype=torch.long)
    picks, rows = torch.zeros(B, 640, dtype=torch.int32), torch.zeros(B * S, dtype=torch.long)
    ring = empty_qtensor("fp8", (B, 128, 512), "cpu")
    return lambda: (kv_store.store_paged(pool, table, entry, torch.ones(B, S, dtype=torch.bool), vals, 64, 0),
                    kv_store.resolve_paged(table, picks, 64),
                    kv_store.store_rows(ring, rows, rows, empty_qtensor("fp8", (B * S, 512), "cpu")))


def compress_call(B: int, S: int, cold: bool):
    """A ratio-4 compressor over B rows (512 wide): the pool of a decode step's groups and the fused
    decode step (slot writes, pool, bf16 cast, norm)."""
    from flashrt.kernels_cuda import compress

    kv, st = torch.zeros(B, 512), torch.zeros(B, 4, 512)
    return lambda: (compress.compress_pool(st.unsqueeze(1), st.unsqueeze(1)),
                    compress.compress_decode(kv, kv, st, st.clone(), torch.zeros(B, dtype=torch.long),
                                             torch.ones(512, dtype=torch.bfloat16), 1e-6, torch.bfloat16))


def indexer_call(B: int, S: int, cold: bool):
    """``small``'s indexer scores: 32 query heads x 128 over 4,096 fp4_b32 keys, bf16 head weights
    scaled in the kernel (the linear's output as it comes)."""
    from flashrt.kernels_cuda import indexer
    from flashrt.kernels_cuda.launch import zeros_stored

    _as_h200()
    q, w = torch.zeros(B, S, 32, 128, dtype=torch.bfloat16), torch.zeros(B, S, 32, dtype=torch.bfloat16)
    keys, vis = zeros_stored("fp4_b32", (B, 4096, 128), None, "cpu"), torch.full((B, S), 4096, dtype=torch.int32)
    return lambda: indexer.index_scores(q, keys, w, vis, 128 ** -0.5 * 32 ** -0.5)


def prefix_attention_call(B: int, S: int, cold: bool):
    """``small``'s prompt-chunk attention (benchmarks/prefix_attention.py's case): B rows of S
    queries over the window and 512 compressed entries."""
    from flashrt.graphs.config import shipped_config
    from flashrt.kernels_cuda import prefix_attention as kernel

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import prefix_attention

    args = prefix_attention.case(shipped_config("small"), B, S, 0, 512, torch.device("cpu"), torch.Generator())
    return lambda: kernel.prefix_attention(*args)


def quant_call(B: int, S: int, cold: bool):
    """``quantize_store`` of B x S bf16 rows of 512 into an fp4_b16 paged cache through a slot map
    (``--cold``: into an fp8 one): the compressed entries' store."""
    from flashrt.kernels_cuda import quant

    rows, fmt = B * S, "fp8" if cold else "fp4_b16"
    x = torch.zeros(rows, 512, dtype=torch.bfloat16)
    data = torch.zeros(2 * rows, 512 if cold else 256, dtype=torch.uint8)
    scale = torch.zeros(2 * rows, 512 // (32 if cold else 16), dtype=torch.uint8)
    return lambda: quant.quantize_store(x, fmt, data, scale, torch.zeros(rows, dtype=torch.long))


def topk_call(B: int, S: int, cold: bool):
    """``topk_positions`` (k = 512) of B rows of S fp32 scores."""
    from flashrt.kernels_cuda import topk

    scores = torch.zeros(B, 1, S)
    return lambda: topk.topk_positions(scores, 512)


def qgmma_call(B: int, S: int, cold: bool):
    """kernels_cuda/experts_qgmma.py's GEMM at the released up shape (W1 and W3 as one [4,608, 5,120] matrix an
    expert), B tokens a tile (8 or 16), S codes of K a program, the weights through a ring of 4 trips
    (``--cold``: loaded where used)."""
    from flashrt.kernels_cuda import experts_qgmma

    N, K = 4608, 5120
    x, xs = torch.zeros(B, K, dtype=torch.float8_e4m3fn), torch.ones(B, K // 32)
    w, ws = torch.zeros(2, N, K // 2, dtype=torch.uint8), torch.zeros(2, N, K // 32, dtype=torch.uint8)
    te, tt = torch.zeros(1, dtype=torch.int32), torch.zeros(1, B, dtype=torch.int32)
    return lambda: experts_qgmma.experts_gemm(x, xs, w, ws, te, tt, S, 0 if cold else 4)


CALLS = {"attention": attention_call, "qgmma": qgmma_call, "prefix_attention": prefix_attention_call,
         "topk": topk_call, "quant": quant_call, "compress": compress_call, "indexer": indexer_call,
         "kv_store": kv_store_call, "linear_plain": linear_plain_call, "moe_route": moe_route_call,
         "moe_tables": moe_tables_call, "linear": linear_call, "linear_v41": linear_v41_call, "moe": moe_call,
         "mhc": mhc_call,
         "norm_rope_quant": norm_rope_quant_call}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("family", choices=sorted(CALLS))
    ap.add_argument("--B", type=int, default=64)
    ap.add_argument("--S", type=int, default=1)
    ap.add_argument("--cold", action="store_true", help="attention: with the cold-page staging segment; "
                    "quant: the fp8 store; moe: the routed experts' scales K major")
    ap.add_argument("--tiles", default="{}", help="JSON merged into tiles.<module> of the active profile "
                    "(the family's kernel module)")
    ap.add_argument("--linear-tiles", default="{}", help="JSON merged into tiles.linear (the block-scaled GEMMs' "
                    "shared switches, e.g. fp4_decode, which the moe kernels also read)")
    ap.add_argument("--moe-dims", choices=sorted(MOE_DIMS), default="small",
                    help="moe: the experts' dimensions (MOE_DIMS)")
    ap.add_argument("--moe-shared", action="store_true",
                    help="moe: the shared expert in the routed experts' call (their launches' shared tiles)")
    ap.add_argument("--attention-kv", choices=("both", "fp8", "fp4_b16"), default="both",
                    help="attention: the fp8 ring and the fp4_b16 picks, or one segment of one format alone")
    ap.add_argument("--profile-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a profile field set for the compile, e.g. expert_fp4=words (repeatable)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from flashrt import profiles

    base = profiles.active_profile()
    extra = json.loads(args.tiles)
    section = {**base.tiles.get(args.family, {})}
    for k, v in extra.items():
        section[k] = {**section.get(k, {}), **v} if isinstance(v, dict) else v
    tiles = {**base.tiles, args.family: section}
    linear_extra = json.loads(args.linear_tiles)
    if linear_extra:
        tiles["linear"] = {**tiles.get("linear", {}), **linear_extra}
    fields = {}
    for item in args.profile_set:
        key, sep, value = item.partition("=")
        if not sep or key not in {f.name for f in dataclasses.fields(base)}:
            ap.error(f"--profile-set: expected KEY=VALUE with KEY a profile field, got {item!r}")
        fields[key] = value
    prof = dataclasses.replace(base, tiles=tiles, **fields)
    with profiles.using(prof):
        extra = {"dims": args.moe_dims, "shared": args.moe_shared} if args.family == "moe" else {}
        extra |= {"kv": args.attention_kv} if args.family == "attention" else {}
        seen = capture(CALLS[args.family](args.B, args.S, args.cold, **extra))
        reports = [compile_report(*c) for c in seen]
    if args.json:
        json.dump(reports, sys.stdout, indent=1)
        return
    for r in reports:
        print(f"{r['kernel']}: {r['num_warps']} warps, {r['num_stages']} stages, {r['registers']} registers, "
              f"stack {r['stack_bytes']} B, shared {r['shared_bytes']} B")
        print("   " + "  ".join(f"{k} {v}" for k, v in r["sass"].items() if v))
        print("   global loads: " + "  ".join(f"{k} {v}" for k, v in sorted(r["global_loads"].items())))
        loop, name = (r["mma_loop"], "MMA") if r["mma_loop"] else (r["fma_loop"], "multiply-add")
        if loop:
            print(f"   {name} loop: {loop['instructions']} instructions a trip ("
                  + "  ".join(f"{k} {v}" for k, v in loop["opcodes"].items()) + ")")
            print(f"   SASS: {r['dump']}.sass, the loop at {loop['sass_range'][0]}-{loop['sass_range'][1]}")


if __name__ == "__main__":
    main()
