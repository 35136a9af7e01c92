"""Settings of a serving engine (checked), and the shared page pool they describe."""
from __future__ import annotations

from dataclasses import dataclass, fields

from flashrt.kv.sizes import index_pages_for
from flashrt.kv.state import KVState

from .generation import profile_kv_sizes
from .speculative import SPECULATIVE, check_options


DEFAULT_STEP_TOKENS = 2048  # a step's token budget without a hardware profile
# the decode batch's block tables start wide enough for this many positions per row at most (a
# longer context widens them by doubling, a recapture each time; a table per bucket and layer)
TABLE_POSITIONS = 1 << 16


@dataclass
class EngineConfig:
    max_running: int = 64  # sequences holding KV state at once (decode batch rows + prefilling)
    max_step_tokens: int | None = None  # tokens per step: one per decode, the rest for prefill chunks
    # (None: the hardware profile's serve_max_step_tokens, else DEFAULT_STEP_TOKENS)
    prefill_chunk: int = 512  # prompt tokens per forward call (also the prefix-cache block)
    max_model_len: int | None = None  # prompt + output tokens (None: the config's max_seq_len)
    max_waiting: int | None = None  # requests queued before add_request raises QueueFull
    kv_budget: int | None = None  # device bytes of KV (None: the hardware profile's, on CUDA)
    kv_page_entries: int | None = None  # entries per main-KV page (None: the profile's)
    max_kv_pages: int | None = None  # main-KV pages held at once, both tiers (None: the pool's limits)
    swap_bytes: int = 4 << 30  # host bytes for preempted sequences (beyond: drop and recompute)
    prefix_cache_bytes: int = 1 << 30  # host bytes of prefix snapshots (0: no prefix cache)
    prefix_cache_dir: str | None = None  # also keep prefix snapshots on disk here
    cuda_graphs: bool | None = None  # decode from captured CUDA graphs (None: on CUDA devices)
    # prompt chunks of at most prefill_capture.GRAPH_TOKENS tokens from CUDA graphs (None: with cuda_graphs)
    prefill_graphs: bool | None = None
    eos_token_id: int | None = None
    seed: int | None = None  # seeds the generators of requests that give no seed
    speculative: str | None = None  # "dspark": decode batches draft and verify (docs/speculative.md)
    draft_tokens: int | str = "auto"  # drafts verified per round (1 .. block size) or "auto"
    device_timing: bool = False  # time the forwards on the device too (CUDA events: a host sync per step)
    overlap: bool = True  # launch each step before the host has read the previous step's tokens
    # the server runs engine/warmup.py before it admits requests (None: when decode steps are captured)
    warmup: bool | None = None

    def __post_init__(self):
        positive = ("max_running", "max_step_tokens", "prefill_chunk", "max_model_len", "max_waiting",
                    "kv_budget", "kv_page_entries", "max_kv_pages")
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in positive and v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{f.name}: expected an int >= 1{' or None' if f.default is None else ''}, got {v!r}")
        for name in ("swap_bytes", "prefix_cache_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {v!r}")
        if self.speculative is not None and self.speculative not in SPECULATIVE:
            raise ValueError(f"speculative: expected one of {list(SPECULATIVE)} or None, got {self.speculative!r}")
        for name in ("device_timing", "overlap"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        for name in ("warmup", "prefill_graphs"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"{name}: expected a bool or None, got {v!r}")
        d = self.draft_tokens
        if d != "auto" and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"draft_tokens: expected an int >= 1 or 'auto', got {d!r}")
        if self.max_step_tokens is not None and self.max_step_tokens < self.prefill_chunk:
            raise ValueError(f"max_step_tokens: expected at least prefill_chunk ({self.prefill_chunk}), "
                             f"got {self.max_step_tokens}")

    def resolve(self, model) -> "EngineConfig":
        """Fill in what depends on the model: the context length, the step budget (its profile's)."""
        if self.speculative is not None:  # the model's draft layers and block size
            self.draft_tokens = check_options(model, self.speculative, self.draft_tokens)
        if self.max_model_len is None:
            self.max_model_len = model.cfg.max_seq_len
        if self.max_step_tokens is None:
            profile = getattr(model, "profile", None)
            budget = profile.serve_max_step_tokens if profile is not None else DEFAULT_STEP_TOKENS
            self.max_step_tokens = max(budget, self.prefill_chunk)  # a step always has room for one chunk
        return self

    def graphs_on(self, model) -> bool:
        """Whether decode steps (plain, draft and verify) run from static buffers: CUDA graphs on a GPU."""
        return model.device.type == "cuda" if self.cuda_graphs is None else bool(self.cuda_graphs)

    def prefill_graphs_on(self, model) -> bool:
        """Whether short prompt chunks may replay from CUDA graphs (engine/prefill_capture.py): on
        a CUDA device with ``cuda_graphs`` on, unless ``prefill_graphs`` says otherwise; never for
        a model split over ranks (its ranks would have to capture in lockstep) or with speculative
        decoding (a prefill seeds the draft layers' state)."""
        if model.device.type != "cuda" or model.parallel is not None or self.speculative is not None:
            return False
        return self.graphs_on(model) if self.prefill_graphs is None else self.prefill_graphs

    def warmup_on(self, model) -> bool:
        """Whether a server warms this engine up before admitting requests (engine/warmup.py)."""
        return self.graphs_on(model) if self.warmup is None else self.warmup

    def make_pool(self, model):
        """The engine's page pool and the most main-KV pages it may hold (None: no limit). The
        device budget's fixed part counts window rings for ``max_running`` rows."""
        given = self.kv_budget
        kv_budget, entries, cold = profile_kv_sizes(model, self.kv_budget, self.kv_page_entries)
        try:
            pool = KVState.pool_for(model.cfg, self.max_running, self.prefill_chunk, model.device, kv_budget,
                                    entries, cold)
        except ValueError as exc:
            raise ValueError(f"{exc} ({'given' if given else 'from the hardware profile'}; lower max_running "
                             f"or raise kv_budget)") from None
        limit = None
        if pool.limit is not None and pool.host_limit is not None:
            limit = pool.limit + pool.host_limit
        if self.max_kv_pages is not None:
            limit = self.max_kv_pages if limit is None else min(limit, self.max_kv_pages)
        return pool, limit

    def reserve_pools(self, model, pool, positions: int) -> int:
        """With a device budget (``pool.limit``): allocate now the main-KV and index-K pages that
        ``max_running`` sequences of ``positions`` positions hold (the main pool capped at its
        limit), so serving never reallocates (moves) a pool and so never recaptures its decode
        steps for it. Returns the positions per row the decode batch's block tables start wide
        enough for (those covered, at most ``TABLE_POSITIONS``), or ``prefill_chunk`` without a
        budget (pools grow on demand)."""
        if pool.limit is None:
            return self.prefill_chunk
        rows, cfg = self.max_running, model.cfg
        need = index_pages_for(cfg, rows, positions, pool.P)  # main KV: the same pages per entry
        cap = pool.limit if self.max_kv_pages is None else min(pool.limit, self.max_kv_pages)
        if need > cap:
            positions = max(self.prefill_chunk, positions * cap // need)
        pool.grow_device_to(min(need, cap))
        pool.index_pool.grow_to(index_pages_for(cfg, rows, positions, pool.index_pool.P))
        return min(positions, TABLE_POSITIONS)

    def salt(self, model) -> bytes:
        from .prefix import model_identity

        return model_identity(model).encode()

    def prefix_disk(self, model):
        if not self.prefix_cache_dir:
            return None
        from flashrt.kv.prefix_cache import PrefixCache

        return PrefixCache.for_profile(self.prefix_cache_dir, getattr(model, "profile", None))
