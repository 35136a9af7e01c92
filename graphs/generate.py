"""Generation: prefill schedules (``exact``, ``ced``) and batched decode with per-sequence state.

``exact`` runs every layer over every prompt token. ``ced`` (v41-model.md, 7) runs the encoder
layers over every token plus the decoder's KV source's compression, then the decoder layers only
over the last ``window_size`` tokens (their window rings start there: SWA bounded replay).
Prompts of different lengths are prefilled in groups of equal length and decoded together, each
row at its own position.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from flashrt import ops
from flashrt.kvcache import KVState

from .context import StepContext

PREFILLS = ("exact", "ced")


@dataclass
class GenerateResult:
    tokens: list[list[int]]  # new tokens per prompt, in prompt order
    prompt_tokens: int
    new_tokens: int
    prefill_seconds: float
    decode_seconds: float
    first_logits: torch.Tensor = field(repr=False, default=None)  # [B, vocab] after prefill
    state: KVState | None = field(repr=False, default=None)


def ced_split(cfg) -> int:
    """First decoder layer: the layer-20-style KV source (candidate source, else the last source)."""
    split = cfg.candidate_source_layer if cfg.candidate_source_layer >= 0 else max(cfg.kv_source_layers, default=-1)
    if split < 0 or any(s > split for s in cfg.kv_source_layers):
        raise ValueError("prefill: 'ced' needs one KV source that starts the decoder and none after it")
    return split


def prefill_prompt(model, ids: torch.Tensor, state: KVState, schedule: str = "exact") -> torch.Tensor:
    """Run prompt ``ids`` [B, S] (all rows starting at ``state.positions``) -> last-position logits."""
    if schedule not in PREFILLS:
        raise ValueError(f"prefill: expected one of {list(PREFILLS)}, got {schedule!r}")
    cfg = model.cfg
    W = cfg.window_size
    S = ids.shape[1]
    if schedule == "exact" or S <= W or any(state.host_positions):
        return model.forward(ids, state=state)
    split = ced_split(cfg)
    ctx = model.context(ids, state)
    x, pre = model.embed_tokens(ids)
    x, pre = model.run_layers(x, pre, ctx, range(split))
    block = model.blocks[split]
    if block.engram is not None:
        x = block.engram.forward(x, ctx, ctx.token_mask)
    block.attn.compressor.forward(block.attention_input(x, pre), ctx)  # the decoder's global KV, all tokens
    tail = slice(S - W, S)
    for layer in range(split, cfg.n_layers):
        state.ring_start[layer].fill_(S - W)
    sub = StepContext(ctx.positions[:, tail], ctx.end, state, ctx.rope,
                      None if ctx.engram_ids is None else ctx.engram_ids[:, tail], compress_done=frozenset({split}))
    captured = {} if model.drafts is not None else None
    x, pre = model.run_layers(x[:, tail], pre[:, tail], sub, range(split, cfg.n_layers), skip_engram={split},
                              capture=captured)
    if captured:
        model.drafts.seed(captured, sub)
    state.advance(S)
    return model.logits(x, pre, all_positions=False)


def _as_sequences(prompts) -> list[list[int]]:
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2:
            raise ValueError(f"prompts: expected a [B, S] tensor or a list of token lists, got shape {tuple(prompts.shape)}")
        return prompts.tolist()
    seqs = [p.tolist() if isinstance(p, torch.Tensor) else list(p) for p in prompts]
    if not seqs or any(len(s) == 0 for s in seqs):
        raise ValueError("prompts: expected at least one non-empty prompt")
    return seqs


def generate(model, prompts, max_new_tokens: int, temperature: float = 0.0, prefill: str = "exact",
             generator: torch.Generator | None = None, seed: int | None = None, eos_token_id: int | None = None):
    """Prefill every prompt, then decode ``max_new_tokens`` tokens for all of them together."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
    if prefill not in PREFILLS:
        raise ValueError(f"prefill: expected one of {list(PREFILLS)}, got {prefill!r}")
    seqs = _as_sequences(prompts)
    if generator is None and seed is not None:
        generator = torch.Generator(device=model.device).manual_seed(seed)
    capacity = max(map(len, seqs)) + max_new_tokens
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    order, states, logits = [], [], []
    for length in sorted({len(s) for s in seqs}):
        rows = [i for i, s in enumerate(seqs) if len(s) == length]
        ids = model._check_ids(torch.tensor([seqs[i] for i in rows], dtype=torch.long))
        state = model.new_state(len(rows), capacity)
        logits.append(prefill_prompt(model, ids, state, prefill))
        order += rows
        states.append(state)
    state = KVState.cat(states) if len(states) > 1 else states[0]
    step_logits = torch.cat(logits)
    sync()
    t1 = time.perf_counter()
    first_logits = step_logits
    out = [[] for _ in seqs]
    done = torch.zeros(len(seqs), dtype=torch.bool)
    for step in range(max_new_tokens):
        tokens = ops.sample(step_logits, temperature, generator)
        for row, tok in enumerate(tokens.tolist()):
            if not done[row]:
                out[order[row]].append(tok)
                done[row] = eos_token_id is not None and tok == eos_token_id
        if step + 1 == max_new_tokens or bool(done.all()):
            break
        step_logits = model.forward(tokens.unsqueeze(1), state=state)
    sync()
    t2 = time.perf_counter()
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return GenerateResult(out, sum(map(len, seqs)), sum(map(len, out)), t1 - t0, t2 - t1,
                          first_logits[inverse], state)
