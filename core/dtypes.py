"""Names of dtypes and storage formats: the one table profiles, kernels and the model share.

Profiles name dtypes briefly (``compute_dtype: bf16``, ``kv_window_dtype: fp8``); :data:`TORCH`
maps the plain ones to torch dtypes and :data:`STORAGE` the storage names to the QTensor formats
of :mod:`flashrt.formats` that store them. The main (compressed) KV has one format everywhere,
:data:`MAIN_KV_FORMAT`.
"""
from __future__ import annotations

import torch

from .formats import MAIN_KV_FORMAT  # the main KV pages' format (named in STORAGE)

TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # plain dtypes by name
STORAGE = {"fp4": MAIN_KV_FORMAT, "fp8": "fp8", "int8": "int8", "bf16": None}  # storage name -> format (None: plain)
COMPUTE = ("fp8", "int8", "bf16", "fp16", "fp32")  # what a device computes in (fp8 / int8: bf16 activations)


def activation_dtype(compute: str) -> torch.dtype:
    """The activations' dtype for a profile's ``compute_dtype`` (fp8 / int8 compute keeps bf16)."""
    return TORCH.get(compute, torch.bfloat16)


def name(dtype: torch.dtype) -> str:
    """The short name of a plain dtype (``torch.bfloat16`` -> ``bf16``)."""
    for key, value in TORCH.items():
        if value == dtype:
            return key
    raise ValueError(f"dtype: expected one of {', '.join(map(str, TORCH.values()))}, got {dtype}")
