"""``benchmarks/jit_ttft.py``'s reading of a run's JIT log: each variant the run compiled itself is
classed by what the pool did with its cache key (never had it, began it later, began it first), and
where no worker had it, the key pieces that differ from a worker's variant of the same source."""
import random
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _parts(src: str, **other) -> dict:
    parts = {"triton": "t", "src": src, "backend": "b", "options": "o", "env": "[]"} | other
    return parts | {"cache_key": "|".join(parts[k] for k in ("triton", "src", "backend", "options", "env"))}


def test_each_run_compile_is_classed_by_the_pool_s_key(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import jit_ttft

    base = random.uniform(1e9, 2e9)
    rows, want = [], {"not_on_pool": [], "pool_later": [], "raced": [], "waited": []}
    for i in range(random.randint(8, 20)):
        kind = random.choice(list(want) + ["hit"])
        name, begun, seconds = f"_k{i}", base + 10 + i, round(random.uniform(0.2, 2.0), 3)
        parts = _parts(f"s{i}")
        run = {"t": begun + seconds, "s": seconds, "name": name, "cache_key": parts["cache_key"], "parts": parts,
               "plan_parts": parts, "compiled": kind in ("not_on_pool", "pool_later", "raced")}
        if kind == "not_on_pool":  # a worker compiled the same source under other options
            other = _parts(f"s{i}", options="o2")
            rows.append({"pool": True, "name": name, "cache_key": other["cache_key"], "parts": other,
                         "submitted": base + 1, "start": base + 2, "t": base + 3, "s": 1.0})
        elif kind in ("pool_later", "raced"):
            start = begun + (0.5 if kind == "pool_later" else -0.5)
            rows.append({"pool": True, "name": name, "cache_key": parts["cache_key"], "parts": parts,
                         "submitted": base, "start": start, "t": start + 1, "s": 1.0})
        elif kind == "hit":
            run["s"] = 0.01
        if kind == "waited":
            run["s"] = 0.5
        if kind in want:
            want[kind].append(name)
        rows.append(run)
    random.shuffle(rows)
    out = jit_ttft.log_summary(rows)
    for kind, names in want.items():
        assert sorted(r["name"] for r in out[kind]) == sorted(names)
        assert out["counts"][kind] == len(names)
    for r in out["not_on_pool"]:
        assert r["parts_make_key"] and r["plan_keeps_key"] and r["differs_from_pool"] == ["options"]
    for r in out["pool_later"]:
        assert r["pool_start_after_run_s"] == 0.5
    if any(r.get("pool") for r in rows):
        assert out["pool_first_submitted"] == min(out[k] for k in ("pool_first_submitted", "pool_first_start",
                                                                    "run_first_lookup") if out[k] is not None)
