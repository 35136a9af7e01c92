"""torch_npu operator adapters for the Ascend backend: one family per module, listed here.

Each family module declares ``FAMILY`` (:func:`.npu_runtime.npu_family`) and, where an operator has
preconditions, ``PLANS`` (``plan(*args) -> None`` when the operator serves the call exactly, else
the reason it falls back to plain torch). ``npu_runtime`` holds what they share.
"""
from . import attention, dense_attention, misc, moe, norm_rope, quant, topk

FAMILIES = (attention.FAMILY, dense_attention.FAMILY, misc.FAMILY, moe.FAMILY, norm_rope.FAMILY, quant.FAMILY,
            topk.FAMILY)
PLANS = {**attention.PLANS, **dense_attention.PLANS, **misc.PLANS, **moe.PLANS, **norm_rope.PLANS, **quant.PLANS}
