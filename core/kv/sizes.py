"""Sizes of the KV state: bytes per compressed entry, index-K pages, the fixed part of a budget and
the device budget a profile gives."""
from __future__ import annotations

from flashrt.formats import MAIN_KV_FORMAT, spec

DEFAULT_PAGE_ENTRIES = 64


def entry_bytes(dim: int, fmt: str) -> int:
    """Stored bytes of one entry of ``dim`` channels in an fp4 format (a byte per two elements, one
    scale byte per block)."""
    return dim // 2 + dim // spec(fmt).block


def index_pages_for(cfg, batch: int, capacity: int, page_entries: int = DEFAULT_PAGE_ENTRIES) -> int:
    """Index-K pages a batch needs for ``capacity`` positions (every source layer and row)."""
    cdiv = lambda a, b: -(-a // b)
    return batch * sum(cdiv(cdiv(capacity, cfg.ratio(l)), page_entries) for l in cfg.kv_source_layers)


def fixed_bytes_for(cfg, batch: int, capacity: int, page_entries: int = DEFAULT_PAGE_ENTRIES) -> int:
    """Device bytes taken from a KV budget before main-KV pages: window rings (fp8), compressor
    partial groups (fp32 kv + score), index-K pages (fp4_b32) for ``capacity`` positions, and the
    trash page of each pool (index and main)."""
    rings = cfg.total_layers * cfg.window_size * (cfg.head_dim + cfg.head_dim // 32)
    partial = sum(2 * cfg.ratio(l) * cfg.head_dim * 4 for l in cfg.kv_source_layers if cfg.ratio(l) > 1)
    index_page = page_entries * entry_bytes(cfg.index_head_dim, "fp4_b32")
    index = (index_pages_for(cfg, batch, capacity, page_entries) + 1) * index_page
    main_trash = page_entries * entry_bytes(cfg.head_dim, MAIN_KV_FORMAT)
    return batch * (rings + partial) + index + main_trash


def device_kv_budget(total: int, memory_utilization: float, allocated: int, hot_fraction: float,
                     warm_fraction: float) -> int:
    """Device bytes for the KV state under a hardware profile: its hot + warm fractions of the
    memory flashrt may use (``memory_utilization`` of ``total``, the device's memory or the
    ``--memory-limit`` cap) that ``allocated`` bytes (the weights) leave free; at least 1."""
    free = total * memory_utilization - allocated
    return max(int(free * (hot_fraction + warm_fraction)), 1)
