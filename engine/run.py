"""``flashrt run``: build or load a model, generate from a prompt, report speed and memory.

The built-in models (``tiny``, ``small``) get deterministic weights, created once and saved as
a safetensors checkpoint under the cache directory (``FLASHRT_CACHE_DIR``, else the user cache
dir), then loaded from there. Without a tokenizer, prompts are encoded as UTF-8 bytes (ids 0-255).
"""
from __future__ import annotations

import contextlib
import os
import resource
import time
from pathlib import Path

import torch

from flashrt import dispatch
from flashrt.kv.prefix_cache import PrefixCache
from flashrt.profile_match import check_device
from flashrt.progress import Progress

from flashrt.graphs import checkpoint
from flashrt.graphs.config import SHIPPED, shipped_config
from flashrt.graphs.init_weights import init_weights
from flashrt.graphs.loader import load
from flashrt.graphs.model import Model
from .generation import generate

DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog."
OP_FAMILIES = {
    "attention": ("sparse_attention",), "indexer": ("index_scores", "topk_positions", "candidate_blocks"),
    "linear": ("linear",), "moe": ("moe_route", "moe_experts"), "norm+rope": ("rms_norm", "rope"),
    "mhc": ("hc_coefficients", "hc_collapse", "hc_expand"), "compress": ("compress_pool",),
    "engram": ("engram_lookup", "engram_gate"), "quant": ("quantize", "dequantize"), "sample": ("sample",),
}


def cache_dir() -> Path:
    root = os.environ.get("FLASHRT_CACHE_DIR")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flashrt"


def builtin_checkpoint(name: str, seed: int = 0, quiet: bool = False) -> Path:
    """The cached checkpoint of a built-in model with the weights of ``seed``, created
    (atomically) on first use."""
    path = cache_dir() / "models" / f"{name}-seed{seed}"
    if not (path / "config.json").exists():
        cfg = shipped_config(name)
        weights = init_weights(cfg, seed=seed, progress=Progress(f"creating {name} weights", enabled=not quiet))
        checkpoint.save(weights, cfg, path, progress=Progress(f"saving to {path}", enabled=not quiet))
    return path


def pick_device(device: str | None) -> torch.device:
    """``device`` ("cpu", "cuda", "cuda:N", "npu[:N]") checked to exist; None: cuda when available."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return check_device(device)


def load_model(model: str, device: torch.device, seed: int = 0, quiet: bool = False, profile=None) -> Model:
    """``tiny`` / ``small`` (built-in, with the weights of ``seed``) or a checkpoint directory ->
    Model on ``device``."""
    if model in SHIPPED and not os.path.isdir(model):
        if model not in ("tiny", "small"):
            raise ValueError(f"model: {model!r} has no built-in weights; pass its checkpoint directory")
        path = builtin_checkpoint(model, seed, quiet)
    else:
        path = Path(model)
        if not (path / "config.json").exists():
            raise ValueError(f"model: expected 'tiny', 'small' or a checkpoint directory with config.json, got {model!r}")
    return load(path, device=device, profile=profile, progress=Progress(f"loading {path.name}", enabled=not quiet))


def encode_prompt(text: str, vocab_size: int) -> list[int]:
    try:  # surrogateescape: bytes of a command-line argument that are not UTF-8 come back as given
        ids = list(text.encode("utf-8", "surrogateescape"))
    except UnicodeEncodeError as exc:
        raise ValueError(f"prompt: expected UTF-8 text, got {text!r} ({exc.reason})") from None
    if not ids:
        raise ValueError("prompt: expected a non-empty prompt")
    if max(ids) >= vocab_size:
        raise ValueError(f"prompt: byte-level ids need vocab_size >= 256, the model has {vocab_size}")
    return ids


def check_context(prompt_tokens: int, max_new_tokens: int, cfg) -> None:
    """The prompt and the tokens to generate must fit the model's context (``max_seq_len``)."""
    if isinstance(max_new_tokens, int) and prompt_tokens + max_new_tokens > cfg.max_seq_len:
        room = max(cfg.max_seq_len - max_new_tokens, 0)
        raise ValueError(f"prompt: {prompt_tokens} tokens + {max_new_tokens} new tokens exceed the context of "
                         f"{cfg.name} ({cfg.max_seq_len} tokens); with --max-new-tokens {max_new_tokens} the prompt "
                         f"may have at most {room} tokens")


def check_run_args(prompt, threads, seed: int, weights_seed: int, cuda_graph, dev: torch.device) -> None:
    """What ``run`` checks before loading anything (the CLI's argument types check the same)."""
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"prompt: expected a non-empty prompt, got {prompt!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads: expected an int >= 1 or None, got {threads!r}")
    for name, value in (("seed", seed), ("weights_seed", weights_seed)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
            raise ValueError(f"{name}: expected an int in [0, 2**63), got {value!r}")
    if cuda_graph and dev.type != "cuda":
        raise ValueError(f"cuda_graph: CUDA graphs need a CUDA device, the device is {dev}")


def decode_tokens(ids: list[int]) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


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


def run(model: str = "tiny", prompt: str = DEFAULT_PROMPT, max_new_tokens: int = 16, device=None,
        backend: str | None = None, prefill: str = "exact", temperature: float = 0.0, seed: int = 0,
        quiet: bool = False, threads: int | None = None, kv_budget: int | None = None,
        prefill_chunk: int | None = None, cuda_graph: bool | None = None, prefix_cache: str | None = None,
        weights_seed: int = 0) -> dict:
    """The whole job; returns the report as a dict (the CLI prints it). ``seed`` seeds sampling;
    ``weights_seed`` picks the built-in models' weights (a checkpoint is ignored)."""
    dev = pick_device(device)
    check_run_args(prompt, threads, seed, weights_seed, cuda_graph, dev)
    if dev.type == "cpu" and threads is None and model == "tiny":
        threads = 1  # tiny ops: thread fan-out costs more than it gains (12x slower when the cores are busy)
    if threads:
        torch.set_num_threads(threads)
    with dispatch.use_backend(backend) if backend is not None else contextlib.nullcontext():
        t0 = time.perf_counter()
        m = load_model(model, dev, weights_seed, quiet)
        load_s = time.perf_counter() - t0
        ids = encode_prompt(prompt, m.cfg.vocab_size)
        check_context(len(ids), max_new_tokens, m.cfg)
        t_gen = time.perf_counter()
        cache = None if prefix_cache is None else PrefixCache.for_profile(prefix_cache, m.profile)
        result = generate(m, [ids], max_new_tokens, temperature=temperature, prefill=prefill, seed=seed,
                            prefix_cache=cache,
                            kv_budget=kv_budget, prefill_chunk=prefill_chunk, cuda_graph=cuda_graph)
        families = {fam: "/".join(sorted({(dispatch.chain(op, dev.type) or ["none"])[0] for op in ops}))
                    for fam, ops in OP_FAMILIES.items()}
    ttft_load = t_gen - t0 + result.prefill_seconds  # the first token's logits, from the start of loading
    age, now = process_seconds(), time.perf_counter()
    state = result.state
    kv_token = state.global_kv_bytes_per_token()
    n_tokens = result.prompt_tokens + result.new_tokens
    return {
        "model": m.cfg.name, "device": str(dev), "cpu_threads": torch.get_num_threads(), "backend_per_op_family": families, "prefill": prefill,
        "prompt": prompt, "prompt_tokens": result.prompt_tokens, "new_tokens": result.new_tokens,
        "new_token_ids": result.tokens[0], "new_text": decode_tokens(result.tokens[0]),
        "load_seconds": load_s, "prefill_seconds": result.prefill_seconds, "decode_seconds": result.decode_seconds,
        "ttft_from_load_s": ttft_load,
        "ttft_from_process_start_s": None if age is None else age - (now - t0) + ttft_load,
        "prefill_tokens_per_s": result.prompt_tokens / max(result.prefill_seconds, 1e-9),
        "decode_tokens_per_s": max(result.new_tokens - 1, 0) / max(result.decode_seconds, 1e-9),
        "kv_bytes_per_token": kv_token, "kv_bytes_total": kv_token * n_tokens + state.window_bytes(),
        "window_state_bytes": state.window_bytes(), "peak_memory_bytes": peak_memory_bytes(dev),
        "kv_budget": kv_budget, "kv_tiers": state.tier_stats(), "step_capture": result.step_capture,
        "prefix_cache": None if cache is None else {"root": str(cache.root), "hits": cache.hits, "misses": cache.misses},
    }
