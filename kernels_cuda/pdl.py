"""Programmatic dependent launch (PDL): a kernel's launch overlapping the end of the one before it.

Without PDL a kernel is launched only after the previous kernel on its stream has finished and
its writes are flushed: each launch in a decode step pays that gap, and a batch-1 step is hundreds
of small launches. A kernel launched with the PDL attribute (Triton's ``launch_pdl=True``, sm_90+)
is launched as soon as every program of the previous kernel has signalled
``griddepcontrol.launch_dependents`` or exited; it must then run ``griddepcontrol.wait`` (which
returns once the previous kernel has completed and its memory is visible) before it touches memory
that kernel reads or writes.

Every kernel of this package calls :func:`wait_inputs` first, before any load or store. Waiting
first keeps the ordering of a plain stream (each kernel waits for the full completion of the one
before, so by induction for all earlier ones); what PDL removes is part of the launch latency
between them. No kernel signals early: its dependents are launched as it exits (signalling at
entry, which lets the next kernel's programs occupy SMs while they wait, measured slower at
batch 8; docs/performance.md). The wait is a no-op in a kernel launched without the attribute
(PTX ISA, ``griddepcontrol``), so the same binary serves either launch; it is emitted only when
compiling for sm_90 or newer, and never under the interpreter.

Whether launches carry the attribute is the profile's ``tiles.pdl.enabled`` (off by default: a
device's profile turns it on where it was measured), honoured only on sm_90+ CUDA devices (or when
cross-compiling for one). :func:`options` gives the launch options every launcher adds; a shipped
kernel plan (``core/jit_plans``) lists the variants with the option as the profile sets it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashrt import jit_targets
from flashrt.families import KernelFamily
from flashrt.kernels_cuda.codecs import INTERPRETED
from flashrt.kernels_cuda.launch import PlanCache

try:  # the compile target, read inside a kernel; the grid-dependency wait (Triton 3.4+)
    from triton.language.extra.cuda import gdc_wait
    from triton.language.target_info import cuda_capability_geq
except ImportError:
    gdc_wait = cuda_capability_geq = None

TILES = {"enabled": False}  # launches carry the PDL attribute (sm_90+ only)
PLANS = PlanCache("pdl", TILES)
SUPPORTED = gdc_wait is not None and cuda_capability_geq is not None and not INTERPRETED
_ON = {"launch_pdl": True}
_OFF: dict = {}

if SUPPORTED:
    @triton.jit
    def wait_inputs():
        """Wait for the previous kernel on the stream to complete, its writes visible (sm_90+;
        nothing on older targets)."""
        if cuda_capability_geq(9, 0):
            gdc_wait()
else:
    @triton.jit
    def wait_inputs():
        """Nothing: the interpreter, or a Triton without grid-dependency control."""
        pass


def options(device: torch.device) -> dict:
    """The launch options a kernel launch on ``device`` adds: ``{"launch_pdl": True}`` when the active
    profile enables PDL and the device (or the cross-compile target) is sm_90 or newer, else none."""
    target = jit_targets.cross_target()
    tiles, hit = PLANS.lookup((device, target))  # (per launch: one lookup, decided once per device)
    if hit is None:
        if target is not None or device.type == "cuda":
            cap = target.capability if target is not None else torch.cuda.get_device_capability(device)
            on = SUPPORTED and tiles["enabled"] and tuple(cap) >= (9, 0)
        else:
            on = False
        hit = PLANS.store((device, target), _ON if on else _OFF)
    return hit


FAMILY = KernelFamily(
    name="pdl", tiles=TILES,
    description="programmatic dependent launch of every kernel (tiles.pdl.enabled; sm_90+)")
