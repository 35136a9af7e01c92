"""Deterministic synthetic weights for every parameter of a config (tests, benchmarks, demos).

Each parameter draws from its own CPU ``torch.Generator`` seeded from zlib.crc32 of
``"{seed}:{name}"``, so a value depends only on the seed and the parameter's name: the same seed gives
bit-identical weights whatever the parameter order or the device. Init rules (``ParamSpec.init``):

| init | values |
|---|---|
| ``linear`` | standard normal / sqrt(in) |
| ``small`` | standard normal * 0.02 / sqrt(in) (mHC ``hc_*_fn``) |
| ``normal`` | standard normal (embeddings, Engram tables) |
| ``ones`` / ``zeros`` | constants |

Values are made in fp32 on the CPU, then cast (``bf16`` / ``fp32``) or quantized with
``flashrt.formats.quantize`` (``fp8_w``, ``fp4_w``, ``fp8_table`` -> fmt ``fp8``) on the CPU, so
the bytes do not depend on ``device``; the result is moved to ``device`` last.

Parameters are made on a pool of threads (``workers``, default ``torch.get_num_threads()``): each
draws from its own generator, so the bytes do not depend on the order or the number of threads
(torch's sampling and quantization kernels release the GIL, so the threads run in parallel).
"""
from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from flashrt.formats import QTensor, quantize

from .config import ModelConfig
from .params import QUANTIZED, ParamSpec, param_specs

PLAIN_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def param_seed(seed: int, name: str) -> int:
    """The generator seed of parameter ``name``: crc32 of ``"{seed}:{name}"``.

    32 bits on purpose: the CPU generator (mt19937) keeps only the low 32 bits of a seed.
    """
    return zlib.crc32(f"{int(seed)}:{name}".encode("utf-8"))


def init_values(spec: ParamSpec, seed: int = 0) -> torch.Tensor:
    """fp32 CPU values of one parameter, before casting or quantization."""
    if spec.init == "ones":
        return torch.ones(spec.shape, dtype=torch.float32)
    if spec.init == "zeros":
        return torch.zeros(spec.shape, dtype=torch.float32)
    gen = torch.Generator(device="cpu").manual_seed(param_seed(seed, spec.name))
    x = torch.randn(spec.shape, generator=gen, dtype=torch.float32)
    fan_in = spec.shape[-1]
    if spec.init == "linear":
        return x.mul_(fan_in**-0.5)
    if spec.init == "small":
        return x.mul_(0.02 * fan_in**-0.5)
    if spec.init == "normal":
        return x
    raise ValueError(f"{spec.name}: unknown init {spec.init!r} (expected linear, small, normal, ones, zeros)")


def init_param(spec: ParamSpec, seed: int = 0, device="cpu") -> torch.Tensor | QTensor:
    """One parameter in its storage kind on ``device`` (values drawn on the CPU, quantized on
    ``device``: the codec is exact IEEE arithmetic, so the bytes do not depend on it)."""
    x = init_values(spec, seed).to(device)
    if spec.kind in QUANTIZED:
        return quantize(x, QUANTIZED[spec.kind])
    if spec.kind not in PLAIN_DTYPES:
        raise ValueError(f"{spec.name}: unknown kind {spec.kind!r}")
    return x.to(PLAIN_DTYPES[spec.kind])


def init_weights(cfg: ModelConfig, seed: int = 0, device="cpu",
                 progress: Callable[[int, int], None] | None = None,
                 workers: int | None = None) -> dict[str, torch.Tensor | QTensor]:
    """Weights for every ``param_specs(cfg)`` entry, keyed by checkpoint name (QTensor if quantized).

    ``progress(done, total)`` is called after each parameter (counts parameters, not bytes);
    ``workers``: threads making parameters at once (default ``torch.get_num_threads()``).
    """
    device = torch.device(device)
    return make_all(param_specs(cfg), lambda spec: init_param(spec, seed, device), progress, workers)


def make_all(specs: list[ParamSpec], make: Callable[[ParamSpec], torch.Tensor | QTensor],
             progress: Callable[[int, int], None] | None = None,
             workers: int | None = 1) -> dict[str, torch.Tensor | QTensor]:
    """``make(spec)`` for every spec, keyed by name, in the order of ``specs``; ``progress(done,
    total)`` after each (from the calling thread). ``workers`` threads call ``make`` at once
    (None: ``torch.get_num_threads()``); an error of one is raised once the earlier ones are in."""
    workers = torch.get_num_threads() if workers is None else workers
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers: expected an int >= 1 or None, got {workers!r}")
    out: dict[str, torch.Tensor | QTensor] = {}
    threads = torch.get_num_threads()
    if workers == 1:
        values = map(make, specs)
    else:
        torch.set_num_threads(1)  # one thread per parameter, not a team each: the threads are the parallelism
        pool = ThreadPoolExecutor(workers, thread_name_prefix="init-weights")
        futures = [pool.submit(make, spec) for spec in specs]
        values = (f.result() for f in futures)
    try:
        for i, (spec, value) in enumerate(zip(specs, values)):
            out[spec.name] = value
            if progress is not None:
                progress(i + 1, len(specs))
    finally:
        if workers > 1:  # an error or Ctrl-C: the parameters not started are dropped, not made
            pool.shutdown(wait=True, cancel_futures=True)
            torch.set_num_threads(threads)
    return out
