"""Triton kernels for the CUDA backend: one kernel family per module, listed here.

Each family module declares ``FAMILY`` (a :class:`flashrt.families.KernelFamily`: its ops, what
they serve, its tile defaults, its warm-up); helper modules (``codecs``, ``launch``, the
``*_kernel`` files, ``moe_tables``, ``warmup``) declare none. ``docs/kernels.md`` says how to add
one.
"""
from . import (attention, compress, dense_attention, engram, indexer, kv_gather, kv_store, linear, linear_plain, mhc, moe, moe_route, norm_rope,
               norm_rope_quant, pdl, prefix_attention, quant, sample, topk)

FAMILIES = (attention.FAMILY, compress.FAMILY, dense_attention.FAMILY, engram.FAMILY, indexer.FAMILY, kv_gather.FAMILY,
            kv_store.FAMILY, linear.FAMILY, linear_plain.FAMILY, mhc.FAMILY, moe.FAMILY, moe_route.FAMILY,
            norm_rope.FAMILY, norm_rope_quant.FAMILY, pdl.FAMILY, prefix_attention.FAMILY, quant.FAMILY, sample.FAMILY,
            topk.FAMILY)
