"""Random weights made directly on a device, for configurations too large to build on the host.

:func:`flashrt.graphs.init_weights.init_weights` draws every value on the CPU so that the bytes do
not depend on the device; at the real V4.1-Flash dimensions that is hundreds of GiB of fp32 values
and hours of host time. :func:`device_weights` draws each parameter on ``device`` (one
``torch.Generator`` per parameter, seeded like ``init_weights``) and quantizes it there, one
tensor at a time, so peak extra memory is one parameter in fp32. Values follow the same init rules
(``ParamSpec.init``) but are not bit-identical to ``init_weights`` (a device generator draws other
numbers): use it for speed and memory measurements, not for comparisons against CPU runs.
"""
from __future__ import annotations

from typing import Callable

import torch

from flashrt.formats import QTensor, quantize

from .config import ModelConfig
from .init_weights import PLAIN_DTYPES, make_all, param_seed
from .params import QUANTIZED, ParamSpec, param_specs

SCALES = {"linear": lambda fan_in: fan_in**-0.5, "small": lambda fan_in: 0.02 * fan_in**-0.5, "normal": lambda _: 1.0}


def device_param(spec: ParamSpec, seed: int, device: torch.device) -> torch.Tensor | QTensor:
    """One parameter in its storage kind, drawn and quantized on ``device``."""
    if spec.init in ("ones", "zeros"):
        x = (torch.ones if spec.init == "ones" else torch.zeros)(spec.shape, dtype=torch.float32, device=device)
    elif spec.init in SCALES:
        gen = torch.Generator(device=device).manual_seed(param_seed(seed, spec.name))
        x = torch.randn(spec.shape, generator=gen, dtype=torch.float32, device=device)
        x.mul_(SCALES[spec.init](spec.shape[-1]))
    else:
        raise ValueError(f"{spec.name}: unknown init {spec.init!r} (expected {sorted(SCALES)}, ones or zeros)")
    if spec.kind in QUANTIZED:
        return quantize(x, QUANTIZED[spec.kind])
    if spec.kind not in PLAIN_DTYPES:
        raise ValueError(f"{spec.name}: unknown kind {spec.kind!r}")
    return x.to(PLAIN_DTYPES[spec.kind])


def device_weights(cfg: ModelConfig, device, seed: int = 0, progress: Callable[[int, int], None] | None = None,
                   select: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor | QTensor]:
    """Every ``param_specs(cfg)`` entry (those whose name ``select`` accepts, when given) made on
    ``device``; ``progress(done, total)`` after each."""
    device = torch.device(device)
    specs = [s for s in param_specs(cfg) if select is None or select(s.name)]
    return make_all(specs, lambda spec: device_param(spec, seed, device), progress)
