"""Host (Python) time per forward of a model on the CUDA backend, with no kernel run.

    python tools/host_cost.py --model small --prefill 1x512 4x512 --decode 1 64 [--profile-top 25] [--json OUT]

How: a model of ``--model``'s shipped config (random weights) runs on the CPU through the CUDA
backend's launchers with ``--profile``'s tiles, as ``tools/decode_variants.py`` does (the backend
serves CPU tensors; ``torch.empty`` returns zeros, the fill not counted). Every Triton launch goes
through Triton's warm launch path (argument binding, the cache key, the cache hit) and stops at
the launch itself: the first launch of each variant is recorded
(:func:`flashrt.jit_compile.recording`) and a stand-in kernel that does nothing is cached for it,
so later launches find it as a warm GPU process does (the stand-ins are removed on exit).

Per case (a prefill ``[R, S]`` on a new state; a one-token decode step at batch ``B`` after a
``--decode-prompt`` prefill), medians of ``--repeats`` forwards after a warm one, as CPU time of
the calling thread (torch on one thread): the host time, and the host time less the CPU time of
the torch operations that launch a kernel on a GPU. Those really run here, on CPU tensors, and
cost far more than a launch (a prefill's glue moves real data): their count is reported so the
reader can put a launch's cost in their place. Also: the host syncs a GPU run of one forward
would make, by source line (:mod:`host_syncs`: invisible in a CPU profile, a wait for the device's
whole queue on a GPU), the Triton launches of one forward, and
``cProfile`` over one forward, its own time by group (Triton's launch path, flashrt dispatch /
ops / checks, launcher plans, model glue (graphs, KV state), torch operations, other) and the top
functions by own and cumulative time (cProfile's overhead included: compare shares, not sums).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import json
import os
import pstats
import statistics
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)  # launches must reach Triton's compile path to be recorded
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import flashrt  # noqa: E402
from flashrt import profiles  # noqa: E402
from flashrt.jit_compile import recording  # noqa: E402
from decode_variants import _positive, cuda_on_cpu, load_target, target_args  # noqa: E402  (tools/ is on the path when a tool runs)
from host_syncs import HostSyncs  # noqa: E402
from step_ops import FREE  # noqa: E402

_FILL = {"depth": 0, "s": 0.0}  # inside a patched torch.empty's zero fill (no work on a GPU): depth, seconds


class _StandInKernel:
    """What Triton's launch path reads of a compiled kernel; launching it does nothing."""

    function = packed_metadata = None

    def launch_metadata(self, *args):
        return None

    def run(self, *args):
        return None


@contextlib.contextmanager
def warm_launches(arch):
    """Triton launches inside the block take the warm path and launch nothing (module docstring)."""
    from triton.runtime.jit import JITFunction

    stand_in, cached = _StandInKernel(), []

    def _do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        self.device_caches[device][0][key] = stand_in
        cached.append((self, device, key))
        return stand_in

    with recording(arch, lambda *a: None):
        real, JITFunction._do_compile = JITFunction._do_compile, _do_compile
        try:
            yield
        finally:
            JITFunction._do_compile = real
            for fn, device, key in cached:
                fn.device_caches[device][0].pop(key, None)


@contextlib.contextmanager
def empty_as_zeros():
    """``torch.empty`` / ``torch.empty_like`` -> zeros (why: tools/decode_variants.py). The fill is
    no host work on a GPU: its time is kept in ``_FILL["s"]`` (subtracted from the host time) and
    :class:`Launches` does not count it."""
    empty, empty_like = torch.empty, torch.empty_like

    def filled(t):
        _FILL["depth"] += 1
        start = time.thread_time()
        try:
            return t.zero_()
        finally:
            _FILL["s"] += time.thread_time() - start
            _FILL["depth"] -= 1

    torch.empty = lambda *a, **k: filled(empty(*a, **k))
    torch.empty_like = lambda *a, **k: filled(empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


class Launches(TorchDispatchMode):
    """Counts, inside the block, Triton launches and the torch operations that launch a GPU kernel
    (not views, allocations or host reads: ``step_ops.FREE``), and the time those operations take
    on the CPU (``torch_s``)."""

    def __init__(self):
        super().__init__()
        self.triton, self.torch_ops, self.torch_s = 0, collections.Counter(), 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if _FILL["depth"] or FREE.match(name):
            return func(*args, **(kwargs or {}))
        self.torch_ops[name] += 1
        start = time.thread_time()
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.torch_s += time.thread_time() - start

    def __enter__(self):
        from triton.runtime.jit import JITFunction

        real = self._real_run = JITFunction.run

        def run(fn, *a, **k):
            self.triton += not k.get("warmup")
            return real(fn, *a, **k)
        JITFunction.run = run
        return super().__enter__()

    def __exit__(self, *exc):
        from triton.runtime.jit import JITFunction

        JITFunction.run = self._real_run
        return super().__exit__(*exc)


GROUPS = ("triton launch path", "flashrt ops/dispatch/checks", "launcher plans", "model glue", "torch ops", "other")
_THIS = os.path.abspath(__file__)
_FLASHRT = os.path.dirname(os.path.dirname(os.path.abspath(flashrt.__file__)))  # the checkout
_OPS_FILES = ("core/dispatch.py", "core/checks.py", "core/formats.py", "core/support.py", "core/profiles.py",
              "core/argtypes.py", "core/dtypes.py")


def group(filename: str, funcname: str) -> str:
    """The :data:`GROUPS` entry a profiled function's own time counts in."""
    if filename == "~":  # a built-in: torch's (an operation) or Python's
        return "torch ops" if "torch" in funcname else "other"
    if "/triton/" in filename or filename == _THIS and funcname in ("run", "launch_metadata"):  # the stand-in
        return "triton launch path"
    if "/torch/" in filename:
        return "torch ops"
    rel = os.path.relpath(filename, _FLASHRT) if filename.startswith(_FLASHRT) else ""
    if rel.startswith("core/ops") or rel in _OPS_FILES:
        return "flashrt ops/dispatch/checks"
    if rel.startswith("kernels_cuda/"):
        return "launcher plans"
    if rel.startswith(("graphs/", "core/kv/", "core/rope.py")):
        return "model glue"
    return "other"


def profile_one(call) -> dict:
    """cProfile over ``call()``: own time by group and the top functions by own / cumulative time.
    A built-in's own time called from the zero fill of :func:`empty_as_zeros` is left out."""
    prof = cProfile.Profile()
    prof.enable()
    call()
    prof.disable()
    stats = pstats.Stats(prof).stats
    by_group, rows, fill, n_calls = collections.Counter(), [], 0.0, 0
    for (filename, line, func), (_, calls, own, cum, callers) in stats.items():
        g = group(filename, func)
        from_fill = sum(v[2] for (f, _, name), v in callers.items() if f == _THIS and name == "filled")
        n_calls += calls
        fill += from_fill
        by_group[g] += own - from_fill
        where = func if filename == "~" else f"{_short(filename)}:{line}({func})"
        rows.append({"function": where, "group": g, "calls": calls, "own_us": (own - from_fill) * 1e6,
                     "cum_us": cum * 1e6})
    total = sum(by_group.values())
    return {"total_us": total * 1e6, "fill_us": fill * 1e6, "calls": n_calls, "groups": {g: by_group[g] * 1e6 for g in GROUPS},
            "functions": rows}


def _short(filename: str) -> str:
    if filename.startswith(_FLASHRT):
        return os.path.relpath(filename, _FLASHRT)
    return filename.split("site-packages/")[-1]


class Case:
    """One measured forward: a prefill ``[rows, tokens]`` on a new state, or a decode step at
    ``rows`` after a ``tokens`` prefill (``decode``)."""

    def __init__(self, model, rows: int, tokens: int, decode: bool, seed: int = 0):
        self.model, self.rows, self.tokens, self.decode = model, rows, tokens, decode
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, model.cfg.vocab_size, (rows, tokens), generator=g)
        self.state = None

    @property
    def name(self) -> str:
        return f"decode batch {self.rows}" if self.decode else f"prefill [{self.rows}, {self.tokens}]"

    def prepare(self, steps: int):
        """A state for the next forward (a decode's holds ``steps`` more steps after its prefill)."""
        if not self.decode:
            self.state = self.model.new_state(self.rows, self.tokens + 8)
        elif self.state is None:
            self.state = self.model.new_state(self.rows, self.tokens + steps + 8)
            self.model.forward(self.ids, state=self.state)

    def forward(self):
        ids = torch.zeros(self.rows, 1, dtype=torch.long) if self.decode else self.ids
        return self.model.forward(ids, state=self.state)


def measure(case: Case, repeats: int, top: int) -> dict:
    """Medians over ``repeats`` forwards after a warm one (the zero fill left out): host time; then
    over as many forwards under :class:`Launches` (whose own cost stays out of every figure): the CPU
    time of the torch operations, subtracted from the host time; the launches of one; its profile."""
    steps = 2 * repeats + 3
    case.prepare(steps)
    case.forward()  # warm: every plan made, every variant cached
    host, torch_s = [], []
    for _ in range(repeats):
        case.prepare(steps)
        fill, t = _FILL["s"], time.thread_time()
        case.forward()
        host.append(time.thread_time() - t - (_FILL["s"] - fill))
    for _ in range(repeats):
        case.prepare(steps)
        with Launches() as counted:
            case.forward()
        torch_s.append(counted.torch_s)
    case.prepare(steps)
    with HostSyncs() as syncs:
        case.forward()
    case.prepare(steps)
    prof = profile_one(case.forward)
    med = statistics.median
    return {"case": case.name, "host_us": med(host) * 1e6, "host_less_torch_us": (med(host) - med(torch_s)) * 1e6,
            "torch_ops_cpu_us": med(torch_s) * 1e6, "triton_launches": counted.triton,
            "torch_ops": sum(counted.torch_ops.values()), "torch_ops_by_name": dict(counted.torch_ops.most_common()),
            "host_syncs": syncs.total, "host_sync_sites": dict(syncs.sites.most_common()),
            "profile_us": prof["total_us"], "profile_groups_us": prof["groups"], "function_calls": prof["calls"],
            "top_own": sorted(prof["functions"], key=lambda r: -r["own_us"])[:top],
            "top_cum": sorted(prof["functions"], key=lambda r: -r["cum_us"])[:top],
            "top_calls": sorted(prof["functions"], key=lambda r: -r["calls"])[:top]}


def show(r: dict) -> None:
    print(f"\n== {r['case']}: {r['host_us']:.0f} us host per forward, {r['host_less_torch_us']:.0f} us less the "
          f"{r['torch_ops']} torch ops run on CPU tensors; {r['triton_launches']} Triton launches")
    print(f"  host syncs a GPU run would make: {r['host_syncs']}")
    for where, n in r["host_sync_sites"].items():
        print(f"    {n:5d}  {where}")
    total = r["profile_us"]
    print(f"  profiled: {r['function_calls']} function calls, own time {total:.0f} us (cProfile's overhead "
          f"included), by group:")
    for g, us in sorted(r["profile_groups_us"].items(), key=lambda kv: -kv[1]):
        print(f"    {us:9.0f} us {100 * us / total:5.1f}%  {g}")
    for title, key, rows in (("own time", "own_us", r["top_own"]), ("cumulative time", "cum_us", r["top_cum"]),
                             ("calls", "own_us", r["top_calls"])):
        print(f"  top functions by {title}:")
        for row in rows:
            print(f"    {row[key]:9.0f} us {row['calls']:7d} calls  [{row['group']}]  {row['function']}")


def _shape(text: str) -> tuple[int, int]:
    try:
        rows, tokens = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ROWSxTOKENS (e.g. 4x512), got {text!r}") from None
    if rows < 1 or tokens < 1:
        raise argparse.ArgumentTypeError(f"expected ROWSxTOKENS >= 1, got {text!r}")
    return rows, tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    target_args(ap)
    ap.add_argument("--prefill", type=_shape, nargs="*", default=[(1, 512), (4, 512)], metavar="RxS")
    ap.add_argument("--decode", type=_positive, nargs="*", default=[1, 64], metavar="BATCH")
    ap.add_argument("--decode-prompt", type=_positive, default=128, help="tokens per row before the decode steps")
    ap.add_argument("--repeats", type=_positive, default=5)
    ap.add_argument("--profile-top", type=int, default=25, help="functions listed per profile table")
    args = ap.parse_args(argv)
    from flashrt.graphs.init_weights import init_weights
    from flashrt.graphs.model import Model

    target = load_target(args, "host_cost")
    if target is None:
        return 2
    cfg, profile, arch = target
    torch.manual_seed(0)
    torch.set_num_threads(1)  # host time is one thread's CPU time: torch's CPU operations stay on it
    results = []
    with profiles.using(profile), cuda_on_cpu(), empty_as_zeros(), warm_launches(arch):
        model = Model(cfg, init_weights(cfg, seed=0, device="cpu"))
        cases = [Case(model, r, s, False) for r, s in args.prefill]
        cases += [Case(model, b, args.decode_prompt, True) for b in args.decode]
        for case in cases:
            results.append(measure(case, args.repeats, args.profile_top))
            show(results[-1])
            case.state = None
    print(f"\n{args.model} on {arch.name} ({profile.name}), host us per forward (median of {args.repeats}):")
    for r in results:
        print(f"  {r['case']:22} {r['host_us']:9.0f} us  less torch ops {r['host_less_torch_us']:9.0f} us  "
              f"{r['triton_launches']:5d} Triton launches  {r['torch_ops']:5d} torch ops  "
              f"{r['function_calls']:6d} function calls  {r['host_syncs']:3d} host syncs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "profile": profile.name, "arch": arch.name, "repeats": args.repeats,
                       "cases": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
