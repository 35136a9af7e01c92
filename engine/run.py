"""``flashrt run``: build or load a model, generate from a prompt, report speed and memory.

The built-in models (``tiny``, ``small``) get deterministic weights and a byte-level BPE tokenizer
of their vocabulary size, created once and saved as a checkpoint under the cache directory
(``FLASHRT_CACHE_DIR``, else the user cache dir), then loaded from there. Text goes through the
checkpoint's tokenizer (``model.tokenizer``; UTF-8 bytes when it has none): a plain ``prompt`` is
encoded with the tokenizer's BOS rule and continued for ``max_new_tokens``; a ``chat`` message
(and ``system`` text) is rendered in the model's chat format and answered until EOS.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from flashrt import dispatch, memory_cap
from flashrt.kv.prefix_cache import PrefixCache
from flashrt.progress import Progress
from flashrt.errors import CheckpointError

from flashrt.graphs import chat_format, checkpoint
from flashrt.graphs.builtin_tokenizer import build as build_tokenizer, ensure_builtin_tokenizer
from flashrt.graphs.config import SHIPPED, ModelConfig, shipped_config
from flashrt.graphs.devices import resolve_device
from flashrt.graphs.image_processor import open_image
from flashrt.graphs.init_weights import init_weights
from flashrt.graphs.loader import load, resolve_profile
from flashrt.graphs.model import Model
from .generation import generate, profile_kv_sizes
from .precompile import begin, jit_report, plan_model, save_plan, start_compiles, start_preload, stop_compiles

DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog."
OP_FAMILIES = {
    "attention": ("sparse_attention",), "indexer": ("index_scores", "topk_positions", "candidate_blocks"),
    "linear": ("linear",), "moe": ("moe_route", "moe_experts"), "norm+rope": ("rms_norm", "rope"),
    "mhc": ("hc_coefficients", "hc_collapse", "hc_expand"), "compress": ("compress_pool",),
    "engram": ("engram_lookup", "engram_gate"), "quant": ("quantize", "dequantize"), "sample": ("sample",),
    "vision": ("dense_attention",),
}


def cache_dir() -> Path:
    root = os.environ.get("FLASHRT_CACHE_DIR")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flashrt"


def builtin_checkpoint(name: str, seed: int = 0, quiet: bool = False) -> Path:
    """The cached checkpoint of a built-in model with the weights of ``seed``, created (atomically)
    on first use; its tokenizer files are added when missing (also to a checkpoint cached before
    they existed). A cached checkpoint made from another config (an older release's, e.g. ``small``
    before its vision tower) is left as it is: the current config's is made next to it, its name
    suffixed with the config's digest."""
    cfg = shipped_config(name)
    path = cache_dir() / "models" / f"{name}-seed{seed}"
    if (path / "config.json").exists() and not _same_config(path, cfg):  # cached by a release whose config differed
        digest = hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()[:12]
        path = path.with_name(f"{path.name}-{digest}")
    if not (path / "config.json").exists():
        with ThreadPoolExecutor(1, thread_name_prefix="builtin-tokenizer") as pool:
            tok = pool.submit(build_tokenizer, cfg.vocab_size)  # trained while the weights are made
            weights = init_weights(cfg, seed=seed, progress=Progress(f"creating {name} weights", enabled=not quiet))
            checkpoint.save(weights, cfg, path, progress=Progress(f"saving to {path}", enabled=not quiet))
            del weights
            ensure_builtin_tokenizer(path, cfg, tok=tok.result())
    elif not (path / "tokenizer.json").exists():  # cached before the checkpoint held its tokenizer
        ensure_builtin_tokenizer(path, ModelConfig.from_file(str(path / "config.json")))
    return path


def _same_config(path: Path, cfg: ModelConfig) -> bool:
    """Whether the checkpoint at ``path`` was made from ``cfg`` (an unreadable config is not)."""
    try:
        return ModelConfig.from_file(str(path / "config.json")).to_dict() == cfg.to_dict()
    except (ValueError, OSError, CheckpointError):
        return False


def pick_device(device: str | None) -> torch.device:
    """The device asked for (``DeviceError`` naming the ones this machine has), else cuda if present."""
    dev = resolve_device(device) if device else None
    return dev if dev is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")


BUILTIN = ("tiny", "small", "tiny-vl")  # the shipped configs that get built-in weights


def load_model(model: str, device: torch.device, seed: int = 0, quiet: bool = False, profile=None) -> Model:
    """``tiny`` / ``small`` / ``tiny-vl`` (built-in, with the weights of ``seed``) or a checkpoint
    directory -> Model on ``device``."""
    if model in SHIPPED and not os.path.isdir(model):
        if model not in BUILTIN:
            raise ValueError(f"model: {model!r} has no built-in weights; pass its checkpoint directory")
        path = builtin_checkpoint(model, seed, quiet)
    else:
        path = Path(model)
        if not (path / "config.json").exists():
            raise ValueError(f"model: expected one of {list(BUILTIN)} or a checkpoint directory with config.json, "
                             f"got {model!r}")
    return load(path, device=device, profile=profile, progress=Progress(f"loading {path.name}", enabled=not quiet))


def model_config(model: str) -> ModelConfig | None:
    """The config ``load_model`` will load for ``model``, read without loading; None when there is
    none to read (``load_model`` then says why)."""
    try:
        if model in SHIPPED and not os.path.isdir(model):
            return shipped_config(model) if model in BUILTIN else None
        return ModelConfig.from_file(str(Path(model) / "config.json"))
    except (ValueError, OSError, CheckpointError):
        return None


def chat_messages(chat: str, system: str | None = None, images=()) -> list[dict]:
    """The conversation of ``flashrt run --chat``: an optional system turn and one user turn (its
    ``images`` first, then the text)."""
    for name, text in (("chat", chat), ("system", system)):
        if text is not None and not isinstance(text, str):
            raise ValueError(f"{name}: expected a str, got {type(text).__name__}")
    if not chat:
        raise ValueError("chat: expected a non-empty message")
    content = [{"type": "image", "image": i} for i in images] + [{"type": "text", "text": chat}] if images else chat
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]


def encode_request(tok, vocab_size: int, prompt: str | None, chat: str | None, system: str | None,
                   thinking: bool, effort, images=()) -> list[int]:
    """Prompt ids: ``chat`` (+ ``system``) in the chat format, else ``prompt`` with the tokenizer's
    BOS rule; one image placeholder per image, before the text."""
    if chat is not None:
        ids = chat_format.encode(tok, chat_messages(chat, system, images), thinking=thinking, effort=effort)
    else:
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"prompt: expected a non-empty str, got {prompt!r}")
        ids = tok.encode(chat_format.IMAGE * len(images) + prompt)
    if max(ids) >= vocab_size:
        raise ValueError(f"prompt: token id {max(ids)} is past the model's vocab_size {vocab_size}")
    return ids


def check_image_token(model, tok) -> None:
    """``ValueError`` unless the model has a vision tower and its tokenizer spells the image
    placeholder as the config's ``image_token_id``."""
    if model.vision is None:
        raise ValueError(f"images: model {model.cfg.name!r} has no vision tower (vision_n_layers = 0)")
    tid = tok.token_id(chat_format.IMAGE)
    if tid != model.cfg.image_token_id:
        raise ValueError(f"images: the tokenizer ({tok.describe()}) spells {chat_format.IMAGE} as {tid}, "
                         f"expected the config's image_token_id {model.cfg.image_token_id}")


def phase_progress(enabled: bool):
    """``progress(phase, done, total)`` for :func:`generate`: one :class:`Progress` line per phase."""
    bars: dict[str, Progress] = {}

    def report(phase: str, done: int, total: int) -> None:
        bars.setdefault(phase, Progress(phase, enabled=enabled))(done, total)
    return report


def check_context(prompt_tokens: int, max_new_tokens: int, cfg) -> None:
    """The prompt and the tokens to generate must fit the model's context (``max_seq_len``)."""
    if isinstance(max_new_tokens, int) and prompt_tokens + max_new_tokens > cfg.max_seq_len:
        room = max(cfg.max_seq_len - max_new_tokens, 0)
        raise ValueError(f"prompt: {prompt_tokens} tokens + {max_new_tokens} new tokens exceed the context of "
                         f"{cfg.name} ({cfg.max_seq_len} tokens); with --max-new-tokens {max_new_tokens} the prompt "
                         f"may have at most {room} tokens")


def check_run_args(prompt, chat, threads, seed: int, weights_seed: int, cuda_graph, dev: torch.device) -> None:
    """What ``run`` checks before loading anything (the CLI's argument types check the same)."""
    if chat is None and (not isinstance(prompt, str) or not prompt):
        raise ValueError(f"prompt: expected a non-empty prompt, got {prompt!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads: expected an int >= 1 or None, got {threads!r}")
    for name, value in (("seed", seed), ("weights_seed", weights_seed)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
            raise ValueError(f"{name}: expected an int in [0, 2**63), got {value!r}")
    if cuda_graph and dev.type != "cuda":
        raise ValueError(f"cuda_graph: CUDA graphs need a CUDA device, the device is {dev}")


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def memory_report(dev: torch.device, sizes: tuple) -> dict:
    """The device memory the KV state was sized from (the ``--memory-limit`` cap when set), the peak
    the caching allocator reserved, and the sizes chosen: device KV budget (None: unlimited),
    entries per page, cold-tier cap in host bytes."""
    budget, page_entries, cold = sizes
    cuda = dev.type == "cuda"
    return {"memory_limit_bytes": memory_cap.limit(dev),
            "sized_from_bytes": memory_cap.device_total(dev) if cuda else None,
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(dev) if cuda else None,  # what the cap bounds
            "kv_budget_bytes": budget, "page_entries": page_entries, "cold_tier_bytes": cold}


def process_seconds() -> float | None:
    """Seconds since this process started (Linux ``/proc``, 10 ms ticks), or None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def run(*args, **kwargs) -> dict:
    """``flashrt run``'s whole job (the arguments of :func:`run_with_model`); returns the report as
    a dict (the CLI prints it)."""
    return run_with_model(*args, **kwargs)[0]


def run_with_model(model: str = "tiny", prompt: str = DEFAULT_PROMPT, max_new_tokens: int = 16, device=None,
        backend: str | None = None, prefill: str = "exact", temperature: float = 0.0, seed: int = 0,
        quiet: bool = False, threads: int | None = None, kv_budget: int | None = None,
        prefill_chunk: int | None = None, cuda_graph: bool | None = None, prefix_cache: str | None = None,
        chat: str | None = None, system: str | None = None, thinking: bool = True, effort=None,
        images=None, weights_seed: int = 0, speculative: str | None = None,
        draft_tokens="auto") -> tuple[dict, Model]:
    """The whole job; returns the report as a dict and the loaded model (for more work on it
    without loading it again, e.g. ``flashrt jit warmup --model``). ``chat`` replaces
    ``prompt`` with a chat turn (``system``, ``thinking``, ``effort``: chat_format.render).
    ``images``: image files (or other image sources) shown before the text (docs/vision.md).
    ``seed`` seeds sampling; ``weights_seed`` picks the built-in models' weights (a checkpoint
    directory is used as it is). ``speculative="dspark"``: decode with the model's draft layers,
    ``draft_tokens`` (an int or ``"auto"``) drafts verified per step (docs/speculative.md)."""
    t_entry, age_entry = time.perf_counter(), process_seconds()
    images = [images] if isinstance(images, (str, bytes, os.PathLike)) else list(images or ())
    if chat is not None:  # bad chat input fails before the model loads
        chat_messages(chat, system)
        chat_format.effort_budget(effort)
    elif system is not None:
        raise ValueError("system: a system prompt needs --chat (a plain --prompt is continued as is)")
    for image in images:  # an unreadable image fails before the model loads
        open_image(image)
    dev = pick_device(device)
    check_run_args(prompt, chat, threads, seed, weights_seed, cuda_graph, dev)
    if dev.type == "cpu" and threads is None and model in ("tiny", "tiny-vl"):
        threads = 1  # tiny ops: thread fan-out costs more than it gains (docs/performance.md)
    if threads:
        torch.set_num_threads(threads)
    cfg = model_config(model) if dev.type == "cuda" else None
    t_fork = time.perf_counter()
    pool, dims, recorder, compiled_before = start_compiles(cfg, dev, backend)  # compiles while the model loads
    t_forked = time.perf_counter()
    try:
        with dispatch.use_backend(backend) if backend is not None else contextlib.nullcontext():
            profile = resolve_profile(None, dev)  # the one load() picks: the cache is checked before loading
            pool = begin(pool, dev, profile, dims)
            cache = None if prefix_cache is None else PrefixCache.for_profile(prefix_cache, profile)
            t0 = time.perf_counter()
            preload = start_preload(dev, backend, profile, cfg)  # the plan's cached kernels, while the model loads
            try:
                m = load_model(model, dev, weights_seed, quiet, profile=profile)
            finally:
                preloaded = preload.join() if preload is not None else None  # no thread beside the forwards
            load_s = time.perf_counter() - t0
            tok = m.tokenizer
            if images:
                check_image_token(m, tok)
            ids = encode_request(tok, m.cfg.vocab_size, prompt, chat, system, thinking, effort, images)
            check_context(len(ids), max_new_tokens, m.cfg)
            sizes = profile_kv_sizes(m, kv_budget, None)  # what generate() derives, for the report
            t_gen = time.perf_counter()
            result = generate(m, [ids], max_new_tokens, temperature=temperature, prefill=prefill, seed=seed,
                              prefix_cache=cache, eos_token_id=tok.eos_id if chat is not None else None,
                              kv_budget=kv_budget, prefill_chunk=prefill_chunk, cuda_graph=cuda_graph,
                              progress=phase_progress(not quiet), images=[images] if images else None,
                              speculative=speculative, draft_tokens=draft_tokens)
            families = {fam: "/".join(sorted({(dispatch.chain(op, dev.type) or ["none"])[0] for op in ops}))
                        for fam, ops in OP_FAMILIES.items()}
    finally:
        precompiled = stop_compiles(pool, recorder)  # cancels what is not needed now
    plan_added = save_plan(recorder, dev, profile, plan_model(cfg, m.cfg))
    ttft_load = t_gen - t0 + result.prefill_seconds  # the first token's logits, from the start of loading
    age, now = process_seconds(), time.perf_counter()
    state = result.state
    kv_token = state.global_kv_bytes_per_token()
    n_tokens = result.prompt_tokens + result.new_tokens
    report = {
        "model": m.cfg.name, "device": str(dev), "cpu_threads": torch.get_num_threads(), "backend_per_op_family": families, "prefill": prefill,
        "tokenizer": tok.describe(), "prompt": None if chat is not None else prompt,
        "chat": None if chat is None else {"system": system, "user": chat, "thinking": thinking,
                                           "effort": chat_format.effort_budget(effort) if thinking else None},
        "prompt_tokens": result.prompt_tokens, "image_tokens": result.image_tokens,
        "images": [str(i) if isinstance(i, (str, os.PathLike)) else type(i).__name__ for i in images],
        "new_tokens": result.new_tokens,
        "new_token_ids": result.tokens[0], "new_text": tok.decode(result.tokens[0]),
        "message": None if chat is None else chat_format.decode_message(tok, result.tokens[0], thinking=thinking),
        "load_seconds": load_s, "prefill_seconds": result.prefill_seconds, "decode_seconds": result.decode_seconds,
        "ttft_from_load_s": ttft_load,
        "ttft_from_process_start_s": None if age is None else age - (now - t0) + ttft_load,
        "startup_seconds": {  # where the time before loading goes (ttft_from_process_start_s - ttft_from_load_s)
            "process_to_run": age_entry, "checks_and_device": t_fork - t_entry, "pool_fork": t_forked - t_fork,
            "profile_and_pool_start": t0 - t_forked},
        "prefill_tokens_per_s": result.prompt_tokens / max(result.prefill_seconds, 1e-9),
        "decode_tokens_per_s": max(result.new_tokens - 1, 0) / max(result.decode_seconds, 1e-9),
        "kv_bytes_per_token": kv_token, "kv_bytes_total": kv_token * n_tokens + state.window_bytes(),
        "window_state_bytes": state.window_bytes(), "peak_memory_bytes": peak_memory_bytes(dev),
        "kv_budget": kv_budget, "kv_tiers": state.tier_stats(), "step_capture": result.step_capture,
        "profile": profile.name, "engram_placement": m.engram_placement, "memory": memory_report(dev, sizes),
        "speculative": result.speculative,
        "jit": jit_report(precompiled, plan_added, compiled_before, preloaded),
        "prefix_cache": None if cache is None else {"root": str(cache.root), "hits": cache.hits, "misses": cache.misses},
    }
    return report, m
