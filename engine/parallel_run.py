"""``flashrt run --tp N --ep M``: one model across ``N * M`` ranks (docs/parallel.md).

The parent checks the request, makes sure the checkpoint exists, then starts the ranks
(:func:`flashrt.engine.launch.launch`; under ``torchrun`` this process is one of them). Every rank
loads only its slices of the checkpoint; rank 0 owns the tokenizer: it encodes the request and
broadcasts the token ids, the ranks generate in lockstep (:func:`~flashrt.engine.parallel.parallel_generate`)
and rank 0 builds the report (the single-device report plus a ``parallel`` section).
"""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import torch

from flashrt import dispatch, distributed
from flashrt.progress import Progress

from flashrt.graphs import chat_format
from flashrt.graphs.config import SHIPPED, ModelConfig
from flashrt.graphs.loader import load
from flashrt.graphs.parallel import Layout, Parallel
from flashrt.graphs.shard import nbytes
from .launch import launch, under_torchrun
from flashrt.kv.prefix_cache import PrefixCache
from .generation import PREFILLS
from .parallel import parallel_generate
from .parallel_whole import generate_whole
from .speculative import check_config
from flashrt.graphs.image_processor import open_image
from .run import OP_FAMILIES, builtin_checkpoint, chat_messages, check_image_token, encode_request, \
    peak_memory_bytes, phase_progress, pick_device


def checkpoint_path(model: str, seed: int, quiet: bool) -> Path:
    if model in SHIPPED and not os.path.isdir(model):
        if model not in ("tiny", "tiny-vl", "small"):
            raise ValueError(f"model: {model!r} has no built-in weights; pass its checkpoint directory")
        return builtin_checkpoint(model, seed, quiet)
    path = Path(model)
    if not (path / "config.json").exists():
        raise ValueError(f"model: expected 'tiny', 'tiny-vl', 'small' or a checkpoint directory with config.json, got {model!r}")
    return path


def run_parallel(model: str = "tiny", prompt: str = "", max_new_tokens: int = 16, device=None, backend=None,
                 prefill: str = "exact", temperature: float = 0.0, seed: int = 0, quiet: bool = False,
                 threads: int | None = None, kv_budget: int | None = None, prefill_chunk: int | None = None,
                 cuda_graph: bool | None = None, prefix_cache: str | None = None, chat: str | None = None,
                 system: str | None = None, thinking: bool = True, effort=None, tp: int = 1, ep: int = 1,
                 timeout_s: float = 600.0, dispatch: str = "gather", on_event=None, images=None,
                 weights_seed: int = 0, speculative: str | None = None, draft_tokens="auto") -> dict | None:
    """The whole job on ``tp * ep`` ranks; rank 0's report (None on the other ranks of a torchrun job).
    ``speculative="dspark"``: every rank drafts with its replica of the draft layers and verifies
    in lockstep (``draft_tokens``: an int or ``"auto"``, as for :func:`flashrt.engine.run.run`)."""
    layout = Layout(tp, ep)
    if dispatch not in ("gather", "all_to_all"):
        raise ValueError(f"dispatch: expected 'gather' or 'all_to_all', got {dispatch!r}")
    if prefill not in PREFILLS:
        raise ValueError(f"prefill: expected one of {list(PREFILLS)}, got {prefill!r}")
    if prefix_cache is not None:  # claims (or checks) the directory before any rank opens it
        PrefixCache.for_profile(prefix_cache)
    images = [images] if isinstance(images, (str, bytes, os.PathLike)) else list(images or ())
    for image in images:  # an unreadable image fails before any rank starts
        open_image(image)
    names = [str(i) if isinstance(i, (str, os.PathLike)) else type(i).__name__ for i in images]
    images = [Path(i).read_bytes() if isinstance(i, (str, os.PathLike)) else i for i in images]  # sent to the ranks
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
    if chat is not None:  # bad input fails here, before any rank starts
        chat_messages(chat, system)
        chat_format.effort_budget(effort)
    elif system is not None:
        raise ValueError("system: a system prompt needs --chat (a plain --prompt is continued as is)")
    elif not isinstance(prompt, str) or not prompt:
        raise ValueError(f"prompt: expected a non-empty str, got {prompt!r}")
    kind = pick_device(device).type
    if cuda_graph and kind != "cuda":
        raise ValueError(f"cuda_graph: CUDA graphs need a CUDA device, the device is {kind}")
    if kind == "cuda" and not under_torchrun():
        count = torch.cuda.device_count()
        if count < layout.world:
            raise ValueError(f"tp: tp * ep = {layout.world} ranks need {layout.world} {kind} devices, found {count}")
    path = checkpoint_path(model, weights_seed, quiet or (under_torchrun() and os.environ.get("RANK") != "0"))
    cfg = ModelConfig.from_file(str(path / "config.json"))
    layout.check(cfg)
    draft_tokens = check_config(cfg, cfg.n_mtp_layers > 0, speculative, draft_tokens)
    if images and not cfg.vision_n_layers:
        raise ValueError(f"images: model {cfg.name!r} has no vision tower (vision_n_layers = 0)")
    job = dict(path=str(path), tp=tp, ep=ep, dispatch=dispatch, backend=backend, prompt=prompt, chat=chat, system=system,
               thinking=thinking, effort=effort, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
               kv_budget=kv_budget, prefill_chunk=prefill_chunk, quiet=quiet, prefill=prefill, images=images, image_names=names,
               prefix_cache=None if prefix_cache is None else str(prefix_cache),
               speculative=speculative, draft_tokens=draft_tokens,
               cuda_graph=kind == "cuda" if cuda_graph is None else bool(cuda_graph),
               threads=threads or max(1, (os.cpu_count() or 1) // layout.world))
    t0 = time.perf_counter()
    results = launch(rank_main, layout.world, (job,), device=kind, timeout_s=timeout_s, on_event=on_event)
    first = next((r for r in results if r["report"] is not None), None)
    if first is None:  # a torchrun rank other than 0
        return None
    out = first["report"]
    out["parallel"]["ranks"] = [r["rank"] for r in results]
    out["wall_seconds"] = time.perf_counter() - t0
    return out


def rank_main(rank: int, device, job: dict, report=None) -> dict:
    """One rank: load its slices, take rank 0's token ids, generate; rank 0 returns the report too."""
    if device.type == "cpu":
        torch.set_num_threads(job["threads"])
    par = Parallel(Layout(job["tp"], job["ep"], rank), job["dispatch"])
    show = rank == 0 and not job["quiet"]
    with dispatch.use_backend(job["backend"]) if job["backend"] else contextlib.nullcontext():
        t0 = time.perf_counter()
        model = load(job["path"], device=device, parallel=par, progress=Progress(f"loading rank {rank}", enabled=show))
        load_s = time.perf_counter() - t0
        tok, ids = model.tokenizer, None
        if rank == 0:
            if job["images"]:
                check_image_token(model, tok)
            ids = encode_request(tok, model.cfg.vocab_size, job["prompt"], job["chat"], job["system"],
                                 job["thinking"], job["effort"], job["images"])
        ids = distributed.broadcast_object(ids, 0)
        phases = phase_progress(show)

        def progress(phase, done, total):
            phases(phase, done, total)
            if report is not None:
                report(phase, done)
        eos = tok.eos_id if job["chat"] is not None else None
        cache = None
        if job["prefix_cache"] is not None:
            cache = PrefixCache.for_profile(job["prefix_cache"], model.profile)
        if job["prefill"] != "exact" or cache is not None or job["images"] or job["speculative"]:  # run whole
            result = generate_whole(model, ids, dict(job, eos=eos), progress, cache,
                                    [job["images"]] if job["images"] else None)
        else:
            result = parallel_generate(model, [ids], job["max_new_tokens"], temperature=job["temperature"],
                                       seed=job["seed"], eos_token_id=eos, prefill_chunk=job["prefill_chunk"],
                                       kv_budget=job["kv_budget"], progress=progress, cuda_graph=job["cuda_graph"])
        families = {fam: "/".join(sorted({(dispatch.chain(op, device.type) or ["none"])[0] for op in ops}))
                    for fam, ops in OP_FAMILIES.items()}
    held = sum(nbytes(v) for v in model.weights.values())
    mine = {"rank": rank, "weight_bytes": held, "peak_memory_bytes": peak_memory_bytes(device),
            "sequences": result.rows}
    if rank != 0:
        return {"rank": mine, "report": None}
    out = _report(model, device, job, ids, result, load_s, families, mine)
    out["images"], out["image_tokens"] = job["image_names"], result.image_tokens
    if cache is not None:
        out["prefix_cache"] = {"root": str(cache.root), "hits": cache.hits, "misses": cache.misses}
    return {"rank": mine, "report": out}


def _report(model, device, job, ids, result, load_s, families, mine) -> dict:
    tok, chat, state = model.tokenizer, job["chat"], result.state
    layout = model.parallel.layout
    kv_token = state.global_kv_bytes_per_token() if state is not None else 0.0
    decode = result.load[-(result.new_tokens - 1):] if result.new_tokens > 1 else []
    return {
        "model": model.cfg.name, "device": f"{device.type} x {layout.world}", "cpu_threads": torch.get_num_threads(),
        "backend_per_op_family": families, "prefill": job["prefill"], "tokenizer": tok.describe(),
        "prompt": None if chat is not None else job["prompt"],
        "chat": None if chat is None else {"system": job["system"], "user": chat, "thinking": job["thinking"],
                                           "effort": chat_format.effort_budget(job["effort"]) if job["thinking"] else None},
        "prompt_tokens": result.prompt_tokens, "new_tokens": result.new_tokens,
        "new_token_ids": result.tokens[0], "new_text": tok.decode(result.tokens[0]),
        "message": None if chat is None else chat_format.decode_message(tok, result.tokens[0], thinking=job["thinking"]),
        "load_seconds": load_s, "prefill_seconds": result.prefill_seconds, "decode_seconds": result.decode_seconds,
        "ttft_from_load_s": load_s + result.prefill_seconds, "ttft_from_process_start_s": None,
        "prefill_tokens_per_s": result.prompt_tokens / max(result.prefill_seconds, 1e-9),
        "decode_tokens_per_s": max(result.new_tokens - 1, 0) / max(result.decode_seconds, 1e-9),
        "kv_bytes_per_token": kv_token,
        "kv_bytes_total": kv_token * (result.prompt_tokens + result.new_tokens) + (state.window_bytes() if state else 0),
        "window_state_bytes": state.window_bytes() if state else 0, "peak_memory_bytes": mine["peak_memory_bytes"],
        "kv_budget": job["kv_budget"], "kv_tiers": state.tier_stats() if state else {}, "step_capture": result.step_capture,
        "prefix_cache": None, "speculative": result.speculative,
        "parallel": {"tp": layout.tp, "ep": layout.ep, "world": layout.world,
                     "collectives": distributed.backend_for(device), "moe_dispatch": model.parallel.dispatch,
                     "expert_pairs_per_rank_per_decode_step": decode},
    }
