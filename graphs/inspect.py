"""``flashrt inspect PATH``: what a checkpoint directory holds and whether it will load and fit.

Reads only the configs, the index and the shard headers (no tensor data): the config summary,
the files used / missing / not used, tensor count and bytes by dtype and role, the tensors a load
would miss or reject, what it ignores (the vision tower) or converts (``wo_a`` FP8 -> BF16), and
whether the weights fit the current device (:mod:`.plan`'s byte counts and capacity rule).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from flashrt.errors import CheckpointError

from . import published
from .checkpoint import CONFIG, expected_names, read_config
from .hf_config import read_config as read_keys, special_tokens
from .params import count_params, param_specs
from .plan import Plan, kv_bytes_per_token, sequences_that_fit, stored_bytes, window_state_bytes
from .shards import INDEX, SINGLE, read_header, read_index
from .verify import OUTPUT_FILES, SUMS

ROLES = (  # (test on the name, role), first match wins
    (lambda n: published.VISION.match(n), "vision (not loaded)"), (lambda n: n.startswith("mtp."), "draft"),
    (lambda n: ".engram.embed." in n, "engram tables"), (lambda n: ".engram." in n, "engram"),
    (lambda n: ".ffn.experts." in n, "routed experts"), (lambda n: ".ffn.shared_experts." in n, "shared expert"),
    (lambda n: ".ffn.gate." in n, "router"), (lambda n: ".attn.compressor." in n, "compressor"),
    (lambda n: ".attn.indexer." in n, "indexer"), (lambda n: ".hc_" in n, "mhc"),
    (lambda n: n in ("embed.weight", "head.weight"), "embedding + head"), (lambda n: "norm" in n, "norms"),
    (lambda n: ".attn." in n, "attention"),
)


def role(name: str) -> str:
    return next((r for test, r in ROLES if test(name)), "other")


def _files(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")
                  if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))


def _tensors(path: Path) -> tuple[dict, list[str], list[str]]:
    """name -> (dtype, shape, bytes) over the shards present, the shards used, the shards missing."""
    if (path / INDEX).is_file():
        weight_map = read_index(path)
        shards = sorted(set(weight_map.values()))
    elif (path / SINGLE).is_file():
        weight_map, shards = None, [SINGLE]
    else:
        raise CheckpointError(f"{path}: no {SINGLE} or {INDEX}")
    found, missing = {}, [s for s in shards if not (path / s).is_file()]
    for shard in shards:
        if shard not in missing:
            found.update(read_header(path / shard))
    return found, shards, missing


def _tally(names, found) -> dict:
    out: dict = {}
    for key, name in names:
        slot = out.setdefault(key, {"count": 0, "bytes": 0})
        slot["count"] += 1
        slot["bytes"] += found[name][2]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["bytes"]))


def _memory(device: torch.device, prof) -> tuple[str, int]:
    """(description, usable bytes) of ``device`` under the profile's memory utilization."""
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device.index or 0)
        total, what = p.total_memory, f"{device} ({p.name})"
    else:
        total, what = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "cpu (host memory)"
    return what, int(total * prof.memory_utilization)


def fit(cfg, device: torch.device, context: int) -> dict:
    """Whether the weights (as held in memory) and one sequence of ``context`` tokens fit ``device``."""
    from .loader import resolve_profile

    prof = resolve_profile(None, device)
    wb = {"backbone": 0, "engram": 0, "draft": 0}
    for s in param_specs(cfg):
        wb[s.group] += stored_bytes(s)
    # the capacity rule needs only byte counts; FLOP figures are not traced here
    plan = Plan(cfg, count_params(cfg), wb, kv_bytes_per_token(cfg), window_state_bytes(cfg), 0.0, 0.0, {}, {})
    engram_on_device = prof.engram_placement == "device" or device.type == "cpu"
    what, memory = _memory(device, prof)
    weights = wb["backbone"] + wb["draft"] + (wb["engram"] if engram_on_device else 0)
    n = sequences_that_fit(plan, context, memory, engram_on_device)
    return {"device": what, "usable_bytes": memory, "memory_utilization": prof.memory_utilization,
            "weights_bytes": weights, "engram_on_device": engram_on_device, "context": context,
            "kv_bytes_per_token": plan.kv_bytes_per_token, "sequences": n, "fits": n > 0}


def inspect(path, device=None, context: int = 4096) -> dict:
    """The report ``flashrt inspect`` prints, as a dict (``lines``: the text form)."""
    path = Path(path)
    if not (path / CONFIG).is_file():
        raise CheckpointError(f"{path}: not a checkpoint directory (no {CONFIG})")
    if not isinstance(context, int) or context < 1:
        raise ValueError(f"context: expected a positive int, got {context!r}")
    cfg = read_config(path)
    raw = json.loads((path / CONFIG).read_text())
    hf = isinstance(raw, dict) and "text_config" in raw
    tokens = special_tokens(read_keys(raw)[2])
    found, shards, missing_shards = _tensors(path)
    text_only = published.text_only(cfg, found, hf)
    specs = param_specs(published.text_config(cfg) if text_only else cfg)
    fp8 = published.fp8_plain(specs, {k: v[0] for k, v in found.items()})
    ignored = published.vision_tensors(found, cfg) if text_only else []
    expected = expected_names(specs, fp8)
    missing = [n for n in expected if n not in found]
    unexpected = sorted(set(found) - set(expected) - set(ignored))
    used = {CONFIG, SUMS, *OUTPUT_FILES, *shards}
    files = _files(path)
    from .devices import resolve_device

    dev = resolve_device(device) or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report = {
        "path": str(path), "layout": "published (Hugging Face config.json)" if hf else "flashrt (ModelArgs config.json)",
        "config": {"name": cfg.name, **{k: getattr(cfg, k) for k in (
            "n_layers", "n_mtp_layers", "dim", "n_heads", "n_routed_experts", "n_activated_experts", "vocab_size",
            "window_size", "max_seq_len", "dtype", "expert_dtype", "engram_layer_ids", "vision_n_layers")},
                   "special_tokens": tokens},
        "files": {"used": [f for f in files if f in used], "missing": missing_shards,
                  "not_used": [f for f in files if f not in used]},
        "tensors": {"count": len(found), "bytes": sum(v[2] for v in found.values()),
                    "by_dtype": _tally(((v[0], n) for n, v in found.items()), found),
                    "by_role": _tally(((role(n), n) for n in found), found)},
        "missing_tensors": missing, "unexpected_tensors": unexpected,
        "ignored": {"count": len(ignored), "bytes": sum(found[n][2] for n in ignored), "why": published.VISION_WHY},
        "converted": {"count": len(fp8), "what": "plain weights stored FP8 + scale (wo_a), dequantized to BF16 at load"},
        "fit": fit(cfg, dev, context),
    }
    report["ok"] = not (missing or unexpected or missing_shards)
    report["lines"] = lines(report)
    return report


def _gib(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024


def _some(names: list[str], k: int = 6) -> str:
    return ", ".join(names[:k]) + (f" (+{len(names) - k} more)" if len(names) > k else "") if names else "none"


def lines(r: dict) -> list[str]:
    c, t, f, fit_ = r["config"], r["tensors"], r["files"], r["fit"]
    out = [f"{r['layout']}: {r['path']}",
           f"model {c['name']}: {c['n_layers']} layers (+{c['n_mtp_layers']} draft), dim {c['dim']}, {c['n_heads']} heads, "
           f"{c['n_routed_experts']} experts (top-{c['n_activated_experts']}), vocab {c['vocab_size']:,}, window "
           f"{c['window_size']}, context {c['max_seq_len']:,}",
           f"weights {c['dtype']} (experts {c['expert_dtype'] or c['dtype']}), Engram layers {list(c['engram_layer_ids'])}, "
           f"vision layers {c['vision_n_layers']}" + (f", tokens {c['special_tokens']}" if c["special_tokens"] else ""),
           f"files used: {len(f['used'])}; missing: {_some(f['missing'])}; not used: {_some(f['not_used'])}",
           f"tensors: {t['count']:,} ({_gib(t['bytes'])}); by dtype: " + ", ".join(
               f"{k} {v['count']:,} ({_gib(v['bytes'])})" for k, v in t["by_dtype"].items()),
           "by role: " + ", ".join(f"{k} {v['count']:,} ({_gib(v['bytes'])})" for k, v in t["by_role"].items()),
           f"missing tensors: {_some(r['missing_tensors'])}; unexpected tensors: {_some(r['unexpected_tensors'])}"]
    if r["ignored"]["count"]:
        out.append(f"ignored: {r['ignored']['count']:,} tensors ({_gib(r['ignored']['bytes'])}) of {r['ignored']['why']}")
    if r["converted"]["count"]:
        out.append(f"converted at load: {r['converted']['count']} {r['converted']['what']}")
    where = "in memory" if fit_["device"].startswith("cpu") else "on the device" + (
        "" if fit_["engram_on_device"] else " (Engram tables in host memory)")
    out.append(f"fits {fit_['device']}: {'yes' if fit_['fits'] else 'no'}: weights {_gib(fit_['weights_bytes'])} "
               f"{where}, {_gib(fit_['usable_bytes'])} usable ({fit_['memory_utilization']:.0%}); "
               f"{fit_['sequences']:,} sequences of {fit_['context']:,} tokens")
    out.append("ok: every tensor a load needs is there and nothing is unexpected" if r["ok"]
               else "not loadable as it is: see the missing / unexpected entries above")
    return out
