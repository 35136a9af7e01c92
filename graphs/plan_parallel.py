"""``flashrt plan --tp N --ep M``: what each rank holds and how many sequences the ranks fit.

Per rank (the largest rank: ranks differ only by which layers' shared expert they hold):
weights (backbone + draft layers, :func:`flashrt.graphs.shard.local_specs`), the Engram rows it
holds (device or host memory, per the profile's ``engram_placement``), and per sequence of its
group: the compressed KV (``context`` x KV bytes per token, kept in full on each rank of the
group), the fixed state (window rings, compressor partial groups, Engram history) and the decode
workspace (the step's largest op output at that context, the gathered logits and the MoE exchange
buffers). Sequences are spread over the ``ep`` groups, so the machine holds ``ep`` times what one
rank fits.
"""
from __future__ import annotations

from .parallel import Layout
from .params import param_specs
from .plan import Plan, stored_bytes
from .shard import local_specs


def rank_weight_bytes(cfg, layout: Layout) -> dict[str, int]:
    """Stored bytes per parameter group (backbone, engram, draft) of the largest rank of ``layout``.

    Ranks hold equal slices and equal numbers of experts, except that a layer's shared expert lives
    on rank ``layer % tp`` of each group (and the first rank's Engram rows are the longest): the
    largest rank is the first one plus the most shared-expert bytes any rank of a group holds."""
    got, shared = {"backbone": 0, "engram": 0, "draft": 0}, [0] * layout.tp
    for full, local, _ in local_specs(cfg, layout.for_rank(0)):
        if not (full.name.startswith("layers.") and ".ffn.shared_experts." in full.name):
            got[local.group] += stored_bytes(local)
    for full in param_specs(cfg):
        if full.name.startswith("layers.") and ".ffn.shared_experts." in full.name:
            shared[int(full.name.split(".")[1]) % layout.tp] += stored_bytes(full)
    got["backbone"] += max(shared)
    return got


def workspace_per_sequence(plan: Plan, cfg, layout: Layout, context: int) -> int:
    """Decode-step buffers one sequence adds on a rank: its largest op output at ``context``, the
    logits (this rank's vocabulary slice and the gathered row, fp32) and its token's share of the
    MoE exchange (every group's token gathered in bf16, the partial sums in fp32)."""
    logits = 4 * (cfg.vocab_size // layout.tp + cfg.vocab_size)
    return plan.decode_largest[context] + logits + layout.ep * cfg.dim * (2 + 4)


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def _fit(free: float, per_seq: float, layout: Layout, need: float, have: float) -> tuple[int, str]:
    if free <= 0:
        return 0, f"does not fit (a rank needs {_gib(need)}, it has {_gib(have)})"
    n = int(free // per_seq)
    return n, f"{n} per group x {layout.ep} group(s) = {n * layout.ep}"


def parallel_report(plan: Plan, cfg, layout: Layout, context: int, memory_bytes: float, placement: str) -> dict:
    """Per-rank bytes and the sequences of ``context`` tokens ``layout``'s ranks fit in ``memory_bytes``
    each, with the Engram rows in device memory and in host memory (``placement``: the profile's)."""
    layout.check(cfg)
    held = rank_weight_bytes(cfg, layout)
    weights = held["backbone"] + held["draft"]
    kv, fixed = context * plan.kv_bytes_per_token, sum(plan.window_state.values())
    work = workspace_per_sequence(plan, cfg, layout, context)
    fits, text = {}, {}
    for where, engram in (("device", held["engram"]), ("host", 0)):
        need = weights + engram
        fits[where], text[where] = _fit(memory_bytes - need, kv + fixed + work, layout, need, memory_bytes)
    chosen = "device" if placement == "device" else "host"
    lines = [
        f"layout: tp {layout.tp} x ep {layout.ep} = {layout.world} ranks; per rank {_gib(memory_bytes)} usable",
        f"per rank: weights {_gib(weights)} (backbone {_gib(held['backbone'])}, draft {_gib(held['draft'])}), "
        f"Engram {_gib(held['engram'])} (the profile keeps it in {chosen} memory)",
        f"per sequence of {context:,} tokens on each rank of its group: KV {_gib(kv)}, fixed state "
        f"{fixed / 2**20:,.2f} MiB, decode workspace {work / 2**20:,.2f} MiB",
        f"sequences of {context:,} tokens: {text['device']} with Engram in device memory; "
        f"{text['host']} with Engram in host memory",
    ]
    return {"tp": layout.tp, "ep": layout.ep, "world": layout.world, "rank_bytes": held,
            "engram_placement": placement, "kv_bytes_per_sequence": kv, "fixed_bytes_per_sequence": fixed,
            "workspace_bytes_per_sequence": work,
            "sequences_fit": {"engram_device": fits["device"] * layout.ep, "engram_host": fits["host"] * layout.ep},
            "lines": lines}
