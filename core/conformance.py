"""``flashrt conformance``: every op on the current device and backend against the reference.

Each case draws fresh random inputs of a model-like shape on the device, runs the op through the
automatic choice (the backend that would serve it) and through the reference, and records the op,
the backend that served it, dtype, shapes, max relative error, the tolerance and pass/fail, and
``route``: what the backend says served the call (:func:`note_route`; the ascend backend names each
torch_npu operator, each plain-torch fallback and each fused operator it declined, with the reason).
The report names the active hardware profile, the ``--memory-limit`` cap (:mod:`flashrt.memory_cap`)
and the tiles each kernel family runs with under that profile (:func:`kernel_paths`).
"""
from __future__ import annotations

import json
import platform

import torch

from . import dispatch, memory_cap, ops, profiles
from .dtypes import MAIN_KV_FORMAT
from .formats import QTensor
from .out_files import OutFile, json_report

# op -> tolerance on max|got - want| / max|want| (selections compare exactly)
TOLERANCE = {"quantize": 0.0, "dequantize": 0.0, "topk_positions": 0.0, "candidate_blocks": 0.0,
             "sample": 0.0, "moe_route": 1e-5, "gather_cold_rows": 0.0, "store_paged": 0.0,
             "resolve_paged": 0.0, "store_rows": 0.0, "engram_hash": 0.0, "norm_rope_quantize": 0.02,
             "window_indices": 0.0, "store_paged_many": 0.0}
# op -> the arguments it writes: each run gets its own copy of them
IN_PLACE = {"store_paged": (0,), "store_rows": (0,), "compress_decode": (2, 3), "store_paged_many": (0,)}
DEFAULT_TOL = 2e-2  # bf16 outputs

_ROUTES: list | None = None  # (op, route) notes, collected only while a case runs


def note_route(op: str, route: str) -> None:
    """A backend names what served ``op`` on this call (an operator, or a fallback and its reason);
    kept, once per distinct note, only while a conformance case runs."""
    if _ROUTES is not None and (op, route) not in _ROUTES:
        _ROUTES.append((op, route))


def _prefix_case(dev, g, r, f32, main):
    """A prompt chunk of 6 tokens a row after 200 and 0 earlier ones: the fp8 window ring, the chunk,
    the main KV; entries at their place past ring and chunk (a few nowhere), each query seeing a prefix."""
    B, S, W, T = 2, 6, 128, 100
    ring, chunk = ops.quantize(f32(B, W, 512), "fp8"), ops.quantize(f32(B, S, 512), "fp8")
    positions = (torch.tensor([[200], [0]]) + torch.arange(S)).to(dev)
    entries = (W + S + torch.randperm(T, generator=g)).to(torch.int32)
    entries[torch.rand(T, generator=g) < 0.1] = -1
    visible = torch.randint(0, T + 1, (B, S), generator=g, dtype=torch.int32)
    return (r(B, S, 64, 512), (ring, chunk, main), positions, torch.tensor([72, 0]).to(dev), W,
            entries.expand(B, T).contiguous().to(dev), visible.to(dev), f32(64), 512 ** -0.5)


def _cases(dev, g):
    r = lambda *s, dt=torch.bfloat16: torch.randn(*s, generator=g).to(dev, dt)
    f32 = lambda *s: r(*s, dt=torch.float32)
    i32 = lambda lo, hi, *s: torch.randint(lo, hi, s, generator=g, dtype=torch.int32).to(dev)
    kv = ops.quantize(f32(2, 300, 512), MAIN_KV_FORMAT)
    yield "rms_norm", (r(64, 1024), f32(1024), 1e-6)
    yield "rms_norm", (r(64, 1024), r(1024), 1e-6)  # the model's bf16 norm weights
    yield "rope", (r(2, 16, 8, 64), torch.polar(torch.ones(16, 32), torch.rand(16, 32, generator=g)).to(dev), False)
    tail = torch.polar(torch.ones(2, 16, 32), torch.rand(2, 16, 32, generator=g)).to(dev)
    yield "rope", (r(2, 16, 8, 512), tail, True)  # the model's: the last 64 of 512 channels, per-row positions
    yield "quantize", (f32(64, 512), "fp8")
    yield "quantize", (f32(64, 512), MAIN_KV_FORMAT)
    yield "dequantize", (ops.quantize(f32(64, 512), "fp4_b32"), torch.float32)
    yield "linear", (r(16, 512), ops.quantize(f32(256, 512), "fp8_w"))
    yield "linear", (r(16, 512), ops.quantize(f32(256, 512), "int8_w"))  # the formats of devices with no FP8
    yield "linear", (r(4, 512), r(256, 512), torch.float32)  # a compressor's bf16 rows to fp32 sums
    yield "grouped_linear", (r(2, 3, 4, 256), r(4 * 128, 256) * 0.0625)
    yield "sparse_attention", (r(2, 4, 64, 512), (ops.quantize(f32(2, 128, 512), "fp8"), kv),
                               i32(-1, 428, 2, 4, 640), f32(64), 512 ** -0.5)
    yield "sparse_attention", (r(2, 4, 64, 512), (ops.quantize(f32(2, 128, 512), "int8"), kv),
                               i32(-1, 428, 2, 4, 640), f32(64), 512 ** -0.5)
    yield "prefix_attention", _prefix_case(dev, g, r, f32, kv)
    yield "index_scores", (r(2, 4, 32, 128), ops.quantize(f32(2, 300, 128), "fp4_b32"), f32(2, 4, 32).abs(),
                           i32(0, 301, 2, 4))
    yield "topk_positions", (f32(2, 4, 300), 64)
    yield "candidate_blocks", (f32(2, 4, 300), i32(1, 301, 2, 4), 8, 8)
    yield "compress_pool", (f32(1, 64, 2, 512), f32(1, 64, 2, 512))
    state = f32(4, 4, 512)  # four rows' pending groups of a ratio-4 compressor, one row completing its group
    yield "compress_decode", (f32(4, 512), f32(4, 512), state, f32(4, 4, 512), torch.tensor([5, 11, 0, 130]).to(dev),
                              r(512), 1e-6, torch.bfloat16)
    yield "hc_coefficients", (r(1, 8, 4, 256), f32(24, 1024) * 0.01, torch.ones(3, device=dev), f32(24) * 0.1,
                              20, 1e-6, 1e-6)
    yield "hc_collapse", (r(1, 8, 4, 256), torch.rand(1, 8, 4, generator=g).to(dev))
    P = 16
    f = torch.polar(torch.ones(2, 3, P), torch.rand(2, 3, P, generator=g) * 6).to(dev)
    yield "norm_rope_quantize", (r(2, 3, 512), r(512), 1e-6, f, "fp8")
    yield "norm_rope_quantize", (r(2, 3, 512), None, 0.0, f, MAIN_KV_FORMAT)
    yield "norm_rope_quantize", (r(2, 3, 32, 128), None, 0.0, f, "fp4_b32", torch.bfloat16)  # the indexer's queries
    yield "norm_rope_quantize", (r(2, 3, 8, 512), r(512), 1e-6, f, None)  # the attention's query heads: not quantized
    yield "hc_collapse_norm", (r(1, 8, 4, 256), torch.rand(1, 8, 4, generator=g).to(dev), f32(256), 1e-6)
    yield "hc_expand", (r(1, 8, 256), r(1, 8, 4, 256), torch.rand(1, 8, 4, generator=g).to(dev),
                        torch.rand(1, 8, 4, 4, generator=g).to(dev))
    yield "engram_lookup", (ops.quantize(f32(1000, 256), "fp8"), torch.randint(0, 1000, (2, 4, 24), generator=g).to(dev))
    yield "engram_gate", (r(2, 4, 4, 256), r(2, 4, 4, 256), r(2, 4, 256), f32(4, 256), 1e-6)
    yield "engram_hash", _hash_case(dev, g)
    yield "moe_route", (r(16, 256), r(32, 256), f32(32) * 0.1, 4, "sqrtsoftplus", True, 1.5)
    yield "moe_route", (r(16, 256), r(32, 256), f32(32) * 0.1, 4, "sigmoid", True, 1.5)
    w = lambda *s: ops.quantize(f32(*s) * 0.05, "fp4_w")
    yield "moe_experts", (r(8, 256), torch.rand(8, 2, generator=g).to(dev), i32(0, 8, 8, 2), w(8, 128, 256),
                          w(8, 128, 256), w(8, 256, 128), 10.0)
    shared = tuple(ops.quantize(f32(*s) * 0.05, "fp8_w") for s in ((1, 128, 256), (1, 128, 256), (1, 256, 128)))
    yield "moe_experts", (r(8, 256), torch.rand(8, 2, generator=g).to(dev), i32(0, 8, 8, 2), w(8, 128, 256),
                          w(8, 128, 256), w(8, 256, 128), 10.0, None, torch.bfloat16, shared)  # the model's call
    w = lambda *s: ops.quantize(f32(*s) * 0.05, "int8_w")
    yield "moe_experts", (r(8, 256), torch.rand(8, 2, generator=g).to(dev), i32(0, 8, 8, 2), w(8, 128, 256),
                          w(8, 128, 256), w(8, 256, 128), 10.0)
    yield "sample", (f32(4, 1000), 0.0)
    yield "dense_attention", (r(1, 324, 16, 64), r(1, 324, 16, 64), r(1, 324, 16, 64), 64 ** -0.5)
    yield "gather_cold_rows", (_host_pages(ops.quantize(torch.randn(6, 16, 512, generator=g), MAIN_KV_FORMAT), dev),
                               torch.randint(-1, 6, (2, 8), generator=g).to(dev), i32(-1, 128, 2, 40),
                               i32(-1, 300, 2, 40), 300)
    yield "store_paged", _store_case(dev, g)
    yield "store_paged_many", _store_many_case(dev, g)
    table = torch.randint(-1, 40, (2, 12), generator=g).to(dev)  # -1: logical pages with no pool page
    yield "resolve_paged", (table, i32(-1, 12 * 64, 2, 640), 64, 129)  # offset: past a window of 128 and 1 token
    ring = ops.quantize(f32(4, 128, 512), "fp8")  # a window ring: one new token for each of 4 rows
    yield "store_rows", (ring, torch.arange(4, device=dev), torch.randint(0, 128, (4,), generator=g).to(dev),
                         ops.quantize(f32(4, 512), "fp8"))
    # a verify commit: 4 rows x 3 tokens at distinct slots, the tokens past each row's kept count left out
    ring = ops.quantize(f32(4, 128, 512), "fp8")
    rows = torch.arange(4, device=dev).repeat_interleave(3)
    slots = (torch.randint(0, 126, (4, 1), generator=g) + torch.arange(3)).reshape(-1).to(dev)
    kept = (torch.arange(3).view(1, 3) < torch.randint(0, 4, (4, 1), generator=g)).reshape(-1).to(dev)
    yield "store_rows", (ring, rows, slots, ops.quantize(f32(12, 512), "fp8"), kept)
    for case in _window_case(dev, g):
        yield "window_indices", case


def _window_case(dev, g):
    """43 ring layers of a decode step and of a 5-token chunk (window 128), rows early in their
    sequence and far past the window; ring starts at 0, mid-window and past the chunk."""
    for S in (1, 5):
        start = torch.tensor([3, 130, 1000, 70000]).view(4, 1)
        ring_start = torch.randint(0, 2000, (43, 4), generator=g)
        ring_start[:10] = 0
        yield (start + torch.arange(S)).to(dev), ring_start.to(dev), 128


def _hash_case(dev, g):
    """Two sequences of 5 positions after a 3-token history (4-grams, 4 heads, 3 Engram layers),
    about one token in eight -1; int64 multipliers near 2**40 (the products wrap), primes 5000+."""
    seq = torch.randint(0, 5000, (2, 8), generator=g)
    seq[torch.rand(2, 8, generator=g) < 0.125] = -1
    mult = torch.randint(1, 2 ** 40, (3, 4), generator=g) * 2 + 1
    primes = torch.tensor([5003, 5009, 5011, 5021, 5023, 5039, 5051, 5059, 5077, 5081, 5087, 5099]).repeat(3, 1)
    return seq.to(dev), mult.to(dev), primes.to(dev), primes.cumsum(1).sub(primes).to(dev), 17


def _store_case(dev, g):
    """A decode step's store: 3 rows x 5 new entries into an 8-page pool (16 rows a page), each row
    on its own pages, one pair masked off (so the trash row's content is defined)."""
    pool = ops.quantize(torch.randn(1, 128, 512, generator=g), MAIN_KV_FORMAT).to(dev)
    table = torch.randperm(7, generator=g)[:6].add(1).view(3, 2).to(dev)  # page 0 is the trash page
    entry = torch.stack([torch.randperm(32, generator=g)[:5] for _ in range(3)]).to(dev)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1, 2] = False
    values = ops.quantize(torch.randn(3, 5, 512, generator=g), MAIN_KV_FORMAT).to(dev)
    return pool, table, entry, mask.to(dev), values, 16, 0


def _store_many_case(dev, g):
    """:func:`_store_case`'s entries stored into its pool and into an index-key pool of another
    format, page size and block table (pages of 8 rows, 4 a row)."""
    pool, table, entry, mask, values, P, trash = _store_case(dev, g)
    keys = ops.quantize(torch.randn(1, 112, 128, generator=g), "fp4_b32").to(dev)
    key_table = torch.randperm(13, generator=g)[:12].add(1).view(3, 4).to(dev)
    key_values = ops.quantize(torch.randn(3, 5, 128, generator=g), "fp4_b32").to(dev)
    return ((pool, table, values, P, trash), (keys, key_table, key_values, 8, 0)), entry, mask


def _own_copy(op: str, args) -> tuple:
    """``args`` with the argument ``op`` writes in place copied (so each run starts from the same state)."""
    def copy(t):
        if isinstance(t, tuple):  # (a store_paged_many's stores)
            return tuple(map(copy, t))
        if isinstance(t, QTensor):
            return QTensor(t.data.clone(), t.scale.clone(), t.fmt, t.shape)
        return t.clone() if isinstance(t, torch.Tensor) else t
    return tuple(copy(a) if i in IN_PLACE.get(op, ()) else a for i, a in enumerate(args))


def _host_pages(q: QTensor, dev) -> QTensor:
    """KV pages in host memory, pinned for an accelerator (``gather_cold_rows`` reads them in place)."""
    if dev.type == "cpu":
        return q
    return QTensor(q.data.pin_memory(), q.scale.pin_memory(), q.fmt, q.shape)


def _rel(got, want) -> float:
    if isinstance(got, QTensor):
        same = torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)) and \
            torch.equal(got.scale.view(torch.uint8), want.scale.view(torch.uint8))
        return 0.0 if same else float("inf")
    if not torch.is_floating_point(want):
        return 0.0 if torch.equal(got, want) else float("inf")
    g, w = got.double(), want.double()
    finite = torch.isfinite(w)
    if not torch.equal(torch.isfinite(g), finite):
        return float("inf")
    scale = w[finite].abs().max() if finite.any() else torch.tensor(1.0)
    return float((g[finite] - w[finite]).abs().max() / scale.clamp_min(1e-30)) if finite.any() else 0.0


def _describe(args) -> list:
    out = []
    for a in args:
        if isinstance(a, QTensor):
            out.append(f"{a.fmt} {list(a.shape)}")
        elif isinstance(a, torch.Tensor):
            out.append(f"{str(a.dtype).replace('torch.', '')} {list(a.shape)}")
        elif isinstance(a, tuple):
            out.append(_describe(a))
    return out


def run_noted(op: str, args) -> tuple[object, list[str]]:
    """``ops.<op>(*args)`` and the routes its backend noted for it (see :func:`note_route`)."""
    global _ROUTES
    _ROUTES = []
    try:
        got = getattr(ops, op)(*args)
        return got, [route for name, route in _ROUTES if name == op]
    finally:
        _ROUTES = None


def kernel_paths() -> dict:
    """Kernel family -> the backend declaring it, its ops and the tiles it launches with under the
    active profile (the family's defaults with the profile's ``tiles.<family>`` over them)."""
    out = {}
    for backend, fams in sorted(dispatch.families().items()):
        for fam in fams:
            out[fam.name] = {"backend": backend, "ops": sorted(fam.ops),
                             "tiles": profiles.tiles(fam.name, fam.tiles) if fam.tiles else {}}
    return out


def run(device=None, seed: int = 0) -> dict:
    """The conformance report for ``device`` (default: cuda when present, else cpu)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    g = torch.Generator().manual_seed(seed)
    rows = []
    for op, args in _cases(dev, g):
        backend = (dispatch.chain(op, dev.type) or ["none"])[0]
        got, route = run_noted(op, _own_copy(op, args))
        with dispatch.use_backend("reference"):
            want = getattr(ops, op)(*_own_copy(op, args))
        pairs = zip(got, want) if isinstance(got, tuple) else [(got, want)]
        err = max(_rel(a, b) for a, b in pairs)
        tol = TOLERANCE.get(op, DEFAULT_TOL)
        rows.append({"op": op, "backend": backend, "inputs": _describe(args), "max_rel_err": err,
                     "tolerance": tol, "pass": err <= tol, "route": route})
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
    return {"device": device_name, "device_type": dev.type, "torch": torch.__version__,
            "profile": profiles.active_profile().name, "memory_limit_bytes": memory_cap.limit(dev),
            "passed": sum(r["pass"] for r in rows), "total": len(rows), "rows": rows,
            "kernel_paths": kernel_paths()}


def out_file(path: str) -> OutFile:
    """``--out``: a new file or a report the command wrote before (:mod:`flashrt.out_files`)."""
    return OutFile(path, "flashrt conformance", json_report("device", "rows", "passed", "total"))


def cmd(args) -> int:
    out = out_file(args.out) if args.out else None
    if out:
        out.check()  # before the run: a path it may not write fails now
    report = run(args.device, args.seed)
    if out:
        out.write(json.dumps(report, indent=2, default=str) + "\n")
    for r in report["rows"]:
        print(f"{'PASS' if r['pass'] else 'FAIL'} {r['op']:18} {r['backend']:10} err {r['max_rel_err']:.2e} "
              f"(tol {r['tolerance']:.0e})" + "".join(f"\n    {route}" for route in r["route"]))
    cap = report["memory_limit_bytes"]
    print(f"{report['passed']}/{report['total']} ops conform on {report['device']} (profile {report['profile']}"
          + (f", memory capped at {memory_cap.gib(cap)})" if cap else ")"))
    if out:
        print(f"wrote {out.path}")
    return 0 if report["passed"] == report["total"] else 1


def add_parser(sub) -> None:
    from flashrt.argtypes import add_simulation_options, device, nonempty, seed

    p = sub.add_parser("conformance", help="every op on this device/backend vs the reference; JSON report")
    p.add_argument("--device", default=None, type=device)
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--out", default=None, type=nonempty("file name"), help="write the JSON report here")
    add_simulation_options(p)
    p.set_defaults(func=cmd)
