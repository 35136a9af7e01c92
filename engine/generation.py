"""Generation: a fixed batch of prompts prefilled (``flashrt.graphs.prefill``) and decoded to the end.

Prompts of different lengths are prefilled in groups of equal length and decoded together, each
row at its own position.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from flashrt import memory_cap, ops
from flashrt.graphs.context import StepContext
from flashrt.graphs.image_processor import expand_prompt
from flashrt.graphs.prefill import PREFILLS
from flashrt.kv.sizes import device_kv_budget
from flashrt.kv.state import KVState

from . import prefix, speculative as spec
from .sampling import HostCopy
from .spec_capture import SpecRunners, graphs_on
from .step_capture import StepCapture


@dataclass
class GenerateResult:
    tokens: list[list[int]]  # new tokens per prompt, in prompt order
    prompt_tokens: int
    new_tokens: int
    prefill_seconds: float
    decode_seconds: float
    first_logits: torch.Tensor = field(repr=False, default=None)  # [B, vocab] after prefill
    state: KVState | None = field(repr=False, default=None)
    step_capture: dict | None = None  # captured / replayed / fallback step counts with cuda_graph
    image_tokens: int = 0  # prompt tokens in image spans (counted in prompt_tokens)
    speculative: dict | None = None  # SpecStats.as_dict() of a speculative run


def profile_kv_sizes(model, kv_budget: int | None, page_entries: int | None) -> tuple:
    """(device KV budget, page entries, cold-tier bytes) for a batch: what was given, else the
    model's hardware profile (``model.profile``, set by ``flashrt.load``). On CUDA the budget is
    the profile's hot + warm fractions of the device memory it may use (``memory_utilization`` of
    the total, or of the ``--memory-limit`` cap: :mod:`flashrt.memory_cap`) that is not allocated
    yet (the weights); the cold tier holds at most
    ``hkcp_cold_host_gib``. No profile or no CUDA: no budget, 64 entries per page, no cold cap."""
    p = getattr(model, "profile", None)
    page_entries = page_entries or (p.hkcp_page_entries if p is not None else 64)
    if p is None:
        return kv_budget, page_entries, None
    if kv_budget is None and model.device.type == "cuda":
        kv_budget = device_kv_budget(memory_cap.device_total(model.device), p.memory_utilization,
                                     torch.cuda.memory_allocated(model.device), p.hkcp_hot_fraction,
                                     p.hkcp_warm_fraction)
    return kv_budget, page_entries, p.cold_host_bytes


_OK = object()  # no bad token found


def _as_sequences(prompts) -> list[list[int]]:
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2 or prompts.dtype.is_floating_point or prompts.dtype == torch.bool:
            raise ValueError(f"prompts: expected an integer [B, S] tensor or a list of token lists, "
                             f"got {prompts.dtype} {tuple(prompts.shape)}")
        seqs = prompts.tolist()
    else:
        seqs = [p.tolist() if isinstance(p, torch.Tensor) else list(p) for p in prompts]
    if not seqs or any(len(s) == 0 for s in seqs):
        raise ValueError("prompts: expected at least one non-empty prompt")
    if any(set(map(type, s)) - {int} for s in seqs):  # plain ints only: checked by the set of types
        bad = next((t for s in seqs for t in s if isinstance(t, bool) or not isinstance(t, int)), _OK)
        if bad is not _OK:  # (an int subclass other than bool is an int)
            raise ValueError(f"prompts: expected integer token ids, got {type(bad).__name__} {bad!r}")
    return seqs


def _with_images(model, seqs: list[list[int]], images) -> tuple[list[list[int]], list[list]]:
    """(prompts with each image placeholder expanded to its span, per prompt ``[(start, ImageInput)]``)."""
    if images is None:
        return seqs, [[] for _ in seqs]
    if not isinstance(images, (list, tuple)) or len(images) != len(seqs):
        got = len(images) if isinstance(images, (list, tuple)) else type(images).__name__
        raise ValueError(f"images: expected one entry (an image, a list of images or None) per prompt "
                         f"({len(seqs)}), got {got}")
    tid, vocab = model.cfg.image_token_id, model.cfg.vocab_size
    if model.vision is not None and not 0 <= tid < vocab:
        raise ValueError(f"images: the config's image_token_id {tid} is not a token id (vocab_size={vocab})")
    out, spans = [], []
    for tokens, entry in zip(seqs, images):
        entry = [] if entry is None else list(entry) if isinstance(entry, (list, tuple)) else [entry]
        tokens, _, found = expand_prompt(tokens, entry, model.cfg)
        out.append(tokens)
        spans.append(found)
    return out, spans


def generate(model, prompts, max_new_tokens: int, temperature: float = 0.0, prefill: str = "exact",
             generator: torch.Generator | None = None, seed: int | None = None, eos_token_id: int | None = None,
             kv_budget: int | None = None, prefill_chunk: int | None = None, kv_page_entries: int | None = None,
             prefix_cache=None, cuda_graph: bool | None = None, prefix_replay: int | None = None, progress=None,
             images=None, speculative: str | None = None, draft_tokens="auto"):
    """Prefill every prompt, then decode ``max_new_tokens`` tokens for all of them together.

    ``kv_budget``: device bytes for the batch's whole KV state; main-KV pages beyond it live in
    host memory (HKCP cold tier) and only the selected entries come back. None: from the model's
    hardware profile on CUDA (:func:`profile_kv_sizes`), unlimited elsewhere. ``prefill_chunk``:
    prompt tokens per forward call. ``kv_page_entries``: compressed entries per KV page (None: the
    profile's ``hkcp_page_entries``, else 64).
    ``prefix_cache``: a :class:`flashrt.kv.prefix_cache.PrefixCache`; prompts whose aligned prefix is
    cached load its stored state instead of prefilling it (the same logits and tokens as a prefill
    split there: :mod:`flashrt.engine.prefix`), and every prompt's aligned prefix is stored.
    ``prefix_replay``: on a hit, load only the global KV and replay this many tokens instead
    (bounded replay, an approximation; nothing is stored then). ``cuda_graph``: run the decode
    steps from captured CUDA graphs (:mod:`flashrt.engine.step_capture`); None: on CUDA devices.
    ``progress(phase, done, total)``: called as the prompt tokens are prefilled (``"prefill"``) and
    as new tokens are decoded (``"decode"``). ``images``: one entry per prompt (an image, a list of
    images or None; an image is a path, bytes, a PIL image or a base64 data URL); each image
    replaces, in order, one ``image_token_id`` of its prompt by its span (docs/vision.md).
    ``speculative="dspark"``: decode with the model's DSpark draft layers, verifying ``draft_tokens``
    drafts per step (an int up to the draft's block size, or ``"auto"``: chosen each step from the
    confidence head and the device's cost table); greedy output is the target's, sampled output is
    distributed as the target's (docs/speculative.md); its draft, verify and plain steps follow
    ``cuda_graph`` as plain decode steps do (:mod:`flashrt.engine.spec_capture`).

    Plain decode steps run one ahead of the host: each is launched from the previous step's
    tokens on the device, then the host reads those tokens (EOS checks, progress) while it runs.
    When every row has met EOS, the step launched last is not read (its state holds one position
    more than the tokens returned)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
    if prefill not in PREFILLS:
        raise ValueError(f"prefill: expected one of {list(PREFILLS)}, got {prefill!r}")
    prefix.check_replay(prefix_replay)
    cuda_graph = graphs_on(model, cuda_graph)
    t0 = time.perf_counter()  # image preprocessing counts towards the prefill time
    draft_tokens = spec.check_options(model, speculative, draft_tokens)
    seqs, images = _with_images(model, _as_sequences(prompts), images)
    if generator is None and seed is not None:
        generator = torch.Generator(device=model.device).manual_seed(seed)
    capacity = max(map(len, seqs)) + max_new_tokens + (model.cfg.dspark_block_size if speculative else 0)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    order, states, logits = [], [], []
    given = kv_budget
    kv_budget, kv_page_entries, cold_bytes = profile_kv_sizes(model, kv_budget, kv_page_entries)
    try:
        pool = KVState.pool_for(model.cfg, len(seqs), capacity, model.device, kv_budget, kv_page_entries, cold_bytes)
    except ValueError as exc:
        if given is not None or kv_budget is None:
            raise
        raise ValueError(f"{exc} (the budget comes from profile {model.profile.name!r}: its hot + warm fractions of "
                         f"the device memory left; pass kv_budget= or free device memory)") from exc
    hits = [prefix.lookup(model, prefix_cache, s, prefill, im) if prefix_cache is not None else (0, None)
            for s, im in zip(seqs, images)]
    report = progress or (lambda phase, done, total: None)
    report("prefill", 0, sum(map(len, seqs)))
    for length, hit in sorted({(len(s), h[0]) for s, h in zip(seqs, hits)}):
        rows = [i for i, s in enumerate(seqs) if len(s) == length and hits[i][0] == hit]
        ids = model._check_ids(torch.tensor([seqs[i] for i in rows], dtype=torch.long))
        state = model.new_state(len(rows), capacity, pool=pool)
        spans = model.image_spans([images[i] for i in rows], length)
        out = prefix.prefill(model, ids, state, prefix_cache, hit, [hits[i][1] for i in rows], prefill,
                             prefill_chunk, prefix_replay, spans, [images[i] for i in rows])
        logits.append(out)
        order += rows
        report("prefill", sum(len(seqs[i]) for i in order), sum(map(len, seqs)))
        states.append(state)
    state = KVState.cat(states) if len(states) > 1 else states[0]
    step_logits = torch.cat(logits)
    sync()
    t1 = time.perf_counter()
    first_logits = step_logits
    if speculative is not None:
        runners = SpecRunners(model, state) if cuda_graph else None
        rows, stats = spec.decode(model, state, step_logits, max_new_tokens, temperature, generator, eos_token_id,
                                  draft_tokens, report, runners=runners)
        sync()
        inverse = sorted(range(len(order)), key=order.__getitem__)
        out = [rows[i] for i in inverse]
        return GenerateResult(out, sum(map(len, seqs)), sum(map(len, out)), t1 - t0, time.perf_counter() - t1,
                              first_logits[inverse], state, runners.stats() if runners else None,
                              _image_tokens(images), stats.as_dict())
    graphs = StepCapture(model, state) if cuda_graph else None
    out = [[] for _ in seqs]
    done = [False] * len(seqs)  # per row of the batch (host-side: checked every step)
    tokens = ops.sample(step_logits, temperature, generator)
    for step in range(max_new_tokens):
        drawn = HostCopy(tokens)  # on its way to the host while the next step runs
        if step + 1 < max_new_tokens:  # the next step reads this step's tokens on the device
            step_logits = graphs.step(tokens) if graphs else model.forward(tokens.unsqueeze(1), state=state)
        for row, tok in enumerate(drawn.lists()[0]):
            if not done[row]:
                out[order[row]].append(tok)
                done[row] = eos_token_id is not None and tok == eos_token_id
        report("decode", max_new_tokens if all(done) else step + 1, max_new_tokens)
        if step + 1 == max_new_tokens or all(done):  # every row at EOS: the step launched above is not read
            break
        tokens = ops.sample(step_logits, temperature, generator)
    sync()
    t2 = time.perf_counter()
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return GenerateResult(out, sum(map(len, seqs)), sum(map(len, out)), t1 - t0, t2 - t1,
                          first_logits[inverse], state, graphs.stats if graphs else None, _image_tokens(images))


def _image_tokens(images) -> int:
    return sum(item.n_tokens for row in images for _, item in row)
