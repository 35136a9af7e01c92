"""A ``triton.jit`` function's hash (part of every compile's cache key) is the same whatever order
functions are first hashed in, once flashrt's cache is installed (``flashrt.jit_triton.stable_hashes``):
the run and its compile pool, which hash kernels in different orders, name each variant by one key.

Triton releases that merge a callee's globals before hashing the callee (3.6, the GPU image's) give
order-dependent hashes; later ones hash the callee first. The check stands that merge order in for
Triton's own, so it tests the hook whatever Triton is installed: without the hook two orders differ,
with it none. Hashing needs Triton without its interpreter: the checks run in a subprocess."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]

CHECK = textwrap.dedent('''
    import gc, importlib, json, pkgutil, random, sys
    from triton.runtime import jit as triton_jit
    from triton.runtime.jit import JITCallable, JITFunction
    from flashrt.jit_triton import stable_hashes
    import flashrt.kernels_cuda as kc

    def merge_then_hash(self, func):  # the callee's globals merged before the callee is hashed
        self.used_global_vals.update(func.used_global_vals)
        self.hasher.update((func.cache_key + str(getattr(func, "noinline", False))).encode("utf-8"))

    triton_jit.DependenciesFinder._update_hash = merge_then_hash
    if sys.argv[2] == "hooked":
        assert stable_hashes() and stable_hashes()  # in place, once

    fns = {}
    for m in pkgutil.iter_modules(kc.__path__):
        mod = importlib.import_module(f"flashrt.kernels_cuda.{m.name}")
        for obj in vars(mod).values():
            if isinstance(obj, JITFunction):
                fns[f"{obj.__module__}.{obj.__name__}"] = obj
    everything = [o for o in gc.get_objects() if isinstance(o, JITCallable) and hasattr(o, "used_global_vals")]

    def hashes(order):  # every function's hash forgotten (Triton's helpers' too), then taken in this order
        for fn in everything:
            fn.hash, fn.used_global_vals = None, {}
        for name in order:
            fns[name].cache_key
        return {name: fn.hash for name, fn in fns.items()}

    order = sorted(fns)
    random.Random(int(sys.argv[1])).shuffle(order)
    first, second = hashes(order), hashes(order[::-1])  # every caller before and after its callees
    print(json.dumps({"count": len(fns), "differ": sorted(n for n in fns if first[n] != second[n])}))
''')


def _differ(mode: str) -> tuple[int, list]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    seed = random.randrange(2 ** 32)
    r = subprocess.run([sys.executable, "-c", CHECK, str(seed), mode], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return out["count"], out["differ"]


def test_kernel_hashes_do_not_depend_on_the_order_they_are_computed_in():
    count, differ = _differ("plain")
    assert count > 50 and differ  # the merge order alone: some kernels' hashes depend on the order
    count, differ = _differ("hooked")
    assert count > 50 and differ == []
