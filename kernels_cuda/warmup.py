"""What the kernel families' warm-up hooks share (``flashrt jit warmup``).

A family's hook (``FAMILY.warmup``, made by :func:`hook` from its ``warmup_cases``) compiles its
kernels by calling its own launchers once, on small tensors of the dtypes and
dims the shipped models launch them with, on the current CUDA device, with the profile's tiles
active (the launchers read them): each launch compiles exactly the variant the model would, into
the compile cache. ``MODELS`` holds the kernel-relevant keys of ``graphs/configs/*.json`` (kernels
never import graphs; a test checks the two agree; the ``vision_*`` keys only where the model has an
image encoder). Token counts: a decode step (1) and a prefill
(``PREFILL``); contexts ``CONTEXTS``: Triton specialises integer arguments on ``== 1`` and
``% 16 == 0``, so these cover the three classes. The kernels of ``topk_positions``,
``candidate_blocks`` and ``index_scores`` do not specialise on the entry count and floor their
block sizes, so their variants are the same for every count from 1 to 1024 (past it the top-k
summary grows by powers of two): any of these contexts stands for that whole range. A family says which launches it needs with
``warmup_cases(device, dims, dtype)``, a generator of :class:`Launch`. ``FLASHRT_WARMUP_MODELS``
(``flashrt jit warmup --shapes``) narrows the models warmed. Without a CUDA device a
hook launches nothing and says why.
"""
from __future__ import annotations

import os
from typing import Callable, Iterable, Iterator, NamedTuple

import torch

from flashrt import dtypes


_COMMON = dict(head_dim=512, rope_head_dim=64, hc_mult=4, index_n_heads=32, index_head_dim=128, index_topk=512,
               candidate_block_size=8, engram_n_heads=8, engram_head_dim=256, engram_max_ngram_size=4,
               n_shared_experts=1, compress_ratios=(0, 1, 2), expert_dtype="fp4", swiglu_limit=10.0,
               hc_sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-20, window_size=128)
_TINY = dict(_COMMON, dim=64, moe_inter_dim=64, n_heads=4, n_routed_experts=8, n_activated_experts=2,
             q_lora_rank=32, head_dim=64, rope_head_dim=16, index_n_heads=2, index_head_dim=32, index_topk=4,
             candidate_topk_blocks=2, candidate_block_size=4, engram_n_heads=2, engram_head_dim=32, window_size=8)
MODELS = {
    "tiny": _TINY,
    "tiny-vl": dict(_TINY, vision_dim=32, vision_n_heads=2, vision_max_n_token=64),
    "small": dict(_COMMON, dim=1024, moe_inter_dim=512, n_heads=16, n_routed_experts=32, n_activated_experts=4,
                  q_lora_rank=512, candidate_topk_blocks=256, vision_dim=256, vision_n_heads=4, vision_max_n_token=1024),
    "v4.1-flash": dict(_COMMON, dim=5120, moe_inter_dim=2304, n_heads=64, n_routed_experts=384,
                       n_activated_experts=6, q_lora_rank=1280, candidate_topk_blocks=2048, vision_dim=1024,
                       vision_n_heads=16, vision_max_n_token=1024),
}
DEFAULT_MODELS = ("small", "v4.1-flash")  # tiny / tiny-vl only when asked for (--shapes tiny)
TOKENS = (1, 44)  # a decode step of one sequence; a prefill of flashrt run's default prompt (44 bytes)
CONTEXTS = (1, 22, 48)  # compressed entries visible: == 1, neither, % 16 == 0


class Launch(NamedTuple):
    """One launcher call: ``fn(*args)``; ``name`` says what it compiles (for reports and tests)."""
    name: str
    fn: Callable
    args: tuple


def cuda_missing() -> str | None:
    """Why nothing can be compiled here, or None when a CUDA device is usable."""
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch (nothing compiled)"
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return f"compute capability sm_{major}{minor} is below sm_80 (nothing compiled)"
    return None


def activation_dtype(profile) -> torch.dtype:
    """The model's activation dtype under ``profile`` (fp8 / int8 compute keeps bf16 activations)."""
    return dtypes.activation_dtype(getattr(profile, "compute_dtype", "bf16"))


def selected_models() -> dict:
    """``DEFAULT_MODELS``' dims, or those of the models named in ``FLASHRT_WARMUP_MODELS`` (comma-separated;
    ``flashrt jit warmup --shapes``)."""
    names = [n for n in os.environ.get("FLASHRT_WARMUP_MODELS", "").split(",") if n]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        raise ValueError(f"FLASHRT_WARMUP_MODELS: expected names from {sorted(MODELS)}, got {unknown}")
    return {n: MODELS[n] for n in names or DEFAULT_MODELS}


def plan(cases: Callable[..., Iterable[Launch]], profile, device, models: dict | None = None) -> Iterator[Launch]:
    """Every launch of ``cases`` for every model's dims (lazily: tensors live one model at a time)."""
    dtype = activation_dtype(profile)
    for dims in (selected_models() if models is None else models).values():
        yield from cases(torch.device(device), dims, dtype)


def _launch(launch: Launch) -> None:
    launch.fn(*launch.args)


def hook(cases: Callable[..., Iterable[Launch]]) -> Callable:
    """The warm-up hook of a family whose launches are ``cases``: ``hook(profile) -> run(cases, profile)``."""
    def warmup(profile) -> dict:
        return run(cases, profile)

    warmup.cases = cases
    return warmup


def run(cases: Callable[..., Iterable[Launch]], profile, models: dict | None = None) -> dict:
    """A hook's body: ``{"launches": n, "kernels": [...]}``, or ``{"skipped": why}`` without CUDA."""
    why = cuda_missing()
    if why:
        return {"skipped": why}
    device = _device()
    names = []
    for launch in plan(cases, profile, device, models):
        _launch(launch)
        names.append(launch.name)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"launches": len(names), "kernels": sorted(set(names))}


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def rand(shape, dtype, device) -> torch.Tensor:
    return torch.randn(shape, device=device).to(dtype)
