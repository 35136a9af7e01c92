"""The DeepSeek-V4.1-Flash model: embed -> hc copies -> blocks (Engram at its layers) -> head.

Written only against ``flashrt.ops`` (plus embedding row gathers and reshapes), so every backend
runs it unchanged. ``Model.forward`` keeps an internal :class:`KVState` like the published code
(``start_pos == 0`` starts a new one); pass ``state=`` to drive several batches explicitly.
"""
from __future__ import annotations

import torch

from flashrt import checks, ops
from flashrt.formats import with_scale_maxes
from flashrt.kv.state import KVState

from .block import Block
from .config import ModelConfig
from .context import RopeCache, StepContext, StepNeeds
from .engram import EngramPrefetch, place_tables
from .engram_hash import EngramHasher, EngramLayout, TokenMap
from .mix_stream import MixStream
from .moe import SharedRoutes
from .vision import ImageSpans, VisionTower


class Model:
    def __init__(self, cfg: ModelConfig, weights: dict, token_map=None, engram_placement: str = "device",
                 window_fmt: str = "fp8", parallel=None):
        if weights["embed.weight"].device.type == "cpu":
            engram_placement = "device" if engram_placement in ("host", "host_pinned") else engram_placement
        place_tables(cfg, weights, engram_placement)
        with_scale_maxes(weights)  # the linear weights' largest scale bytes: the packed decodes' fold
        self.cfg, self.weights, self.engram_placement = cfg, weights, engram_placement
        self.profile = None  # set by flashrt.load
        self.window_fmt = window_fmt  # window-ring format: fp8, or int8 where the device has no FP8
        self.embed, self.norm, self.head = weights["embed.weight"], weights["norm.weight"], weights["head.weight"]
        self.device = self.embed.device
        self.parallel = parallel  # a graphs.parallel.Parallel: this rank's shards and its collectives
        self.blocks = [Block(cfg, layer, weights, f"layers.{layer}.", parallel) for layer in range(cfg.n_layers)]
        self.rope = RopeCache(cfg, self.device)
        self.routes = SharedRoutes() if cfg.n_shared_experts else None
        self.step_needs = StepNeeds.of(cfg)
        self.first_mix = torch.zeros(cfg.hc_mult, dtype=torch.float32, device=self.device)  # block 0 reads copy 0
        self.mix_stream = MixStream(self.device)
        self.select_stream = MixStream(self.device)  # the attention's selection (a stream of its own)
        self.first_mix[0] = 1.0
        layout = EngramLayout.from_config(cfg)
        self.hasher = None
        if layout is not None:
            self.hasher = EngramHasher(layout, token_map or TokenMap.identity(layout.compressed_vocab_size))
        self._state: KVState | None = None
        engrams = [b.engram for b in self.blocks if b.engram is not None]
        self.prefetch = EngramPrefetch(engrams, self.device) if engrams and engram_placement != "device" else None
        # a text-only load of a vision config has no vision weights (graphs/published.py)
        self.vision = VisionTower(cfg, weights) if cfg.vision_n_layers and "vision.norm.weight" in weights else None
        self.drafts = None
        if cfg.dspark_block_size:
            from .dspark import Drafts

            self.drafts = Drafts(self, weights)

    # ----- state ---------------------------------------------------------------------------------
    def new_state(self, batch: int, capacity: int, kv_budget: int | None = None, pool=None) -> KVState:
        """Empty caches for ``batch`` sequences of ``capacity`` positions (grown when exceeded).

        ``kv_budget``: device bytes for the whole KV state; main-KV pages beyond it spill to host
        memory (HKCP cold tier). ``pool``: share another state's page pool (to concatenate states)."""
        return KVState(self.cfg, batch, capacity, self.device, kv_budget=kv_budget, pool=pool,
                       window_fmt=self.window_fmt)

    def _check_ids(self, input_ids) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            got = f"{input_ids.dtype} {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"input_ids: expected an int64 tensor [B, S], got {got}")
        if input_ids.shape[1] == 0:
            raise ValueError("input_ids: expected at least one token per sequence, got S = 0")
        if input_ids.device.type == "meta" or not checks.values_checked():  # tracing / a checked-off hot loop
            return input_ids.to(device=self.device, dtype=torch.long)
        lo, hi = checks.value_range(input_ids)
        if lo < 0 or hi >= self.cfg.vocab_size:
            raise ValueError(f"input_ids: expected ids in [0, {self.cfg.vocab_size}), got values in [{lo}, {hi}]")
        return input_ids.to(device=self.device, dtype=torch.long)

    def context(self, ids: torch.Tensor, state: KVState, token_mask: torch.Tensor | None = None,
                compress_done: frozenset = frozenset(), vl_mask: torch.Tensor | None = None) -> StepContext:
        """The step context of a chunk ``ids`` [B, S] continuing ``state`` (positions, Engram hashes
        and the rest of :meth:`step_context`); opens the state's step (:meth:`KVState.begin_step`).

        ``token_mask`` [B, S] bool: False marks tokens (e.g. image tokens) that take no part in an
        n-gram and whose Engram gate is off. ``compress_done``: KV sources whose compressed entries
        for this chunk are already stored (their compressors are skipped). ``vl_mask`` [B, S] bool:
        True marks image-span tokens, routed with ``bias_vl``."""
        S = ids.shape[1]
        end = max(state.host_positions) + S
        state.begin_step(S)
        positions = state.positions.unsqueeze(1) + torch.arange(S, device=self.device)
        engram_ids = history = None
        if self.hasher is not None and state.is_meta:
            cols = (self.cfg.engram_max_ngram_size - 1) * self.cfg.engram_n_heads
            engram_ids = torch.zeros(*ids.shape, len(self.cfg.engram_layer_ids), cols, dtype=torch.long, device="meta")
        elif self.hasher is not None:
            engram_ids, history = self.hasher.hash_ids(ids, state.engram_history, token_mask)
        # the state changes only when the chunk has run (advance): a failed call can be retried
        ctx = self.step_context(state, positions, end, engram_ids=engram_ids, token_mask=token_mask,
                                compress_done=compress_done, next_history=history, vl_mask=vl_mask)
        if self.prefetch is not None and not state.is_meta:
            self.prefetch.start(ctx)
        return ctx

    def step_context(self, state: KVState, positions: torch.Tensor, end: int, **fields) -> StepContext:
        """:meth:`StepContext.build` for this model (its rotary factors and shared-expert routes; the
        blocks' mixes and the attention's selections forked to their streams where the profile asks,
        graphs/mix_stream.py)."""
        if "fork" not in fields and MixStream.wanted(self.device, positions.numel()):
            fields["fork"] = self.mix_stream.fork
        if "fork_select" not in fields and MixStream.wanted(self.device, positions.numel(), "indexer_stream_max_tokens"):
            fields["fork_select"] = self.select_stream.fork
        return StepContext.build(self.step_needs, self.rope, state, positions, end, routes=self.routes, **fields)

    def shared_route(self, tokens: int):
        """The shared expert's routes for ``tokens`` tokens (None without a shared expert)."""
        return None if self.routes is None else self.routes(tokens, self.device)

    # ----- pieces ----------------------------------------------------------------------------------
    def embed_tokens(self, ids: torch.Tensor, spans: ImageSpans | None = None):
        """Token embeddings [B, S, hc, dim] and the one-hot first mix; image-span positions take
        their span embeddings (``spans``, see :class:`~flashrt.graphs.vision.ImageSpans`)."""
        x = self.embed[ids] if self.parallel is None else self.parallel.embed(self.embed, ids)  # [B, S, dim]
        if spans is not None:
            x = torch.where(spans.mask.unsqueeze(-1), spans.rows[spans.index.clamp_min(0)].to(x.dtype), x)
        x = x.unsqueeze(2).repeat(1, 1, self.cfg.hc_mult, 1)
        return x, self.first_mix.expand(*ids.shape, self.cfg.hc_mult)  # a view: no fill launch

    def run_layers(self, x, pre, ctx: StepContext, layers, skip_engram=(), capture=None):
        for layer in layers:
            block = self.blocks[layer]
            if block.engram is not None and layer not in skip_engram:
                x = block.engram.forward(x, ctx, ctx.token_mask)
            if capture is not None and layer in self.cfg.dspark_target_layer_ids:
                capture[layer] = x.to(torch.float32).mean(dim=2).to(x.dtype)
            x, pre = block.forward(x, pre, ctx)
        return x, pre

    def logits(self, x, pre, all_positions: bool) -> torch.Tensor:
        if not all_positions:
            x, pre = x[:, -1:], pre[:, -1:]
        h = ops.hc_collapse_norm(x, pre, self.norm, self.cfg.norm_eps)
        if self.parallel is None:  # fp32 sums of h, with no cast launch before the head
            out = ops.linear(h, self.head, torch.float32)
        else:
            out = self.parallel.head_logits(h.to(torch.float32), self.head)
        return out if all_positions else out[:, 0]

    # ----- public ----------------------------------------------------------------------------------
    def forward(self, input_ids, start_pos: int = 0, all_positions: bool = False, state: KVState | None = None,
                token_mask: torch.Tensor | None = None, spans: ImageSpans | None = None):
        """fp32 logits ``[B, vocab]`` of the last position (``[B, S, vocab]`` with ``all_positions``).

        ``start_pos == 0`` starts new sequences in the internal state; ``start_pos > 0`` continues
        it and must equal the number of tokens already run. ``token_mask`` [B, S] bool (optional):
        False gates the Engram contribution off for those tokens (image tokens). ``spans``: the
        image spans of this chunk (:meth:`image_spans`); their positions take the image
        embeddings, skip Engram and route with ``bias_vl``.
        """
        ids = self._check_ids(input_ids)
        if token_mask is not None and (not isinstance(token_mask, torch.Tensor) or token_mask.dtype != torch.bool
                                       or token_mask.shape != ids.shape):
            raise ValueError(f"token_mask: expected a bool tensor {tuple(ids.shape)}, got {token_mask!r:.80}")
        token_mask, vl_mask = self._span_masks(ids, token_mask, spans)
        state = self._state_for(ids, start_pos, state)
        # the ids are checked above; every other index the layers pass to an op (routes, top-k
        # picks, cache slots) is computed by the model itself, so the ops skip reading index values
        # (a host sync each, dozens per forward on a GPU)
        with checks.value_checks(False):
            ctx = self.context(ids, state, token_mask, vl_mask=vl_mask)
            logits = self.run(ids, ctx, all_positions, spans)
        state.advance(ids.shape[1], ctx.next_history)
        return logits

    def image_spans(self, rows_spans: list, length: int) -> ImageSpans | None:
        """:class:`ImageSpans` of rows of ``length`` tokens with ``rows_spans[b] = [(start,
        ImageInput), ...]`` (as :func:`~flashrt.graphs.image_processor.expand_prompt` returns them);
        every image goes through the vision tower once."""
        if self.vision is None and any(rows_spans):
            raise ValueError("images: this model has no vision tower (vision_n_layers = 0)")
        return ImageSpans.build(self.vision, rows_spans, length, self.embed.dtype) if any(rows_spans) else None

    def _span_masks(self, ids, token_mask, spans):
        """(Engram token mask, bias_vl mask) of a chunk: span positions are image tokens."""
        if token_mask is not None:
            token_mask = token_mask.to(self.device)
        if spans is None:
            return token_mask, None
        if not isinstance(spans, ImageSpans) or spans.index.shape != ids.shape:
            got = tuple(spans.index.shape) if isinstance(spans, ImageSpans) else type(spans).__name__
            raise ValueError(f"spans: expected ImageSpans over {tuple(ids.shape)} tokens, got {got}")
        inside = spans.mask
        return (~inside if token_mask is None else token_mask & ~inside), inside

    def run(self, ids: torch.Tensor, ctx: StepContext, all_positions: bool = False,
            spans: ImageSpans | None = None) -> torch.Tensor:
        """Every layer over ``ids`` in context ``ctx`` nothing committed (``ctx.state.advance`` does):
        only device work, so a decode step can be captured in a CUDA graph (engine/step_capture.py)."""
        x, pre = self.embed_tokens(ids, spans)
        captured = {} if self.drafts is not None else None
        x, pre = self.run_layers(x, pre, ctx, range(self.cfg.n_layers), capture=captured)
        if captured:
            self.drafts.seed(captured, ctx)
        return self.logits(x, pre, all_positions)

    def _state_for(self, ids, start_pos: int, state: KVState | None) -> KVState:
        if state is not None:
            if not isinstance(state, KVState) or state.batch != ids.shape[0]:
                got = f"a batch of {state.batch}" if isinstance(state, KVState) else type(state).__name__
                raise ValueError(f"state: expected a KVState for a batch of {ids.shape[0]}, got {got}")
            if start_pos and set(state.host_positions) != {start_pos}:
                raise ValueError(f"start_pos: expected the state's position(s) {sorted(set(state.host_positions))}, "
                                 f"got {start_pos}")
            return state
        if start_pos == 0:
            self._state = self.new_state(ids.shape[0], ids.shape[1])
        elif self._state is None or self._state.batch != ids.shape[0] or set(self._state.host_positions) != {start_pos}:
            have = None if self._state is None else self._state.host_positions
            raise ValueError(f"start_pos: expected the next position of the running sequences ({have}), got {start_pos}")
        return self._state

    def save(self, path, **kwargs):
        """Write the model as a checkpoint (config.json + safetensors shards + SHA256SUMS)."""
        from .checkpoint import save

        return save(self.weights, self.cfg, path, **kwargs)
