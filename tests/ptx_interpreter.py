"""Inline PTX under Triton's CPU interpreter: ``tl.inline_asm_elementwise`` evaluated by :mod:`ptx_emulator`.

Inside :func:`emulated_ptx` the interpreter runs every inline-PTX call of a kernel through the emulator and
the launchers take the sm_90 PTX paths (:func:`flashrt.kernels_cuda.codecs.ptx_sm90`), so a whole kernel
with its packed decodes runs on the CPU and can be compared with the reference: the PTX and the Triton code
around it (which registers hold which elements, the joins and permutes after the call) together.

The packing follows Triton's lowering of the op: each call takes ``pack`` consecutive elements of every
operand (consecutive along the last dimension, in row-major order), an operand narrower than 32 bits with
``32 / bits`` of them a register, the first in the low bits; the outputs' registers come first in the
constraint list (``=r``), in the order of the output dtypes, then the inputs', in the order of the operands.
"""
from __future__ import annotations

import collections
import contextlib

import numpy as np
from triton.runtime import interpreter

from flashrt import profiles
from flashrt.kernels_cuda import codecs
from ptx_emulator import run_ptx

_UNSIGNED = {8: np.uint8, 16: np.uint16, 32: np.uint32}


def _per_register(bits: int, pack: int, what: str) -> tuple[int, int]:
    """(elements a register, registers a call) of an operand of ``bits``-bit elements."""
    if bits not in _UNSIGNED or (pack * bits) % 32:
        raise NotImplementedError(f"{what}: {bits}-bit elements, pack {pack}: not whole 32-bit registers")
    return 32 // bits, pack * bits // 32


def evaluate(asm: str, constraints: str, operands: list[tuple[np.ndarray, int]], out_bits: list[int],
             pack: int) -> list[np.ndarray]:
    """The outputs (unsigned arrays of ``out_bits`` each, the operands' shape) of ``asm`` over
    ``operands`` ((array, element bits), broadcast to one shape) called ``pack`` elements at a time."""
    shape = operands[0][0].shape
    if shape[-1] % pack:
        raise NotImplementedError(f"pack {pack} over a last dimension of {shape[-1]}")
    kinds = [c.strip() for c in constraints.split(",")]
    regs, number = {}, 0
    outputs = []
    for i, bits in enumerate(out_bits):
        per, n = _per_register(bits, pack, f"output {i}")
        outputs.append((bits, per, list(range(number, number + n))))
        number += n
    n_out = number
    for i, (array, bits) in enumerate(operands):
        per, n = _per_register(bits, pack, f"operand {i}")
        groups = np.ascontiguousarray(array).view(_UNSIGNED[bits]).reshape(-1, pack).astype(np.uint32)
        for r in range(n):
            word = np.zeros(groups.shape[0], dtype=np.uint32)
            for j in range(per):
                word |= groups[:, r * per + j] << np.uint32(bits * j)
            regs[number] = word
            number += 1
    if kinds != ["=r"] * n_out + ["r"] * (number - n_out):
        raise NotImplementedError(f"constraints {constraints!r}: expected {n_out} '=r' then {number - n_out} 'r'")
    got = run_ptx(asm, regs)
    results = []
    for bits, per, numbers in outputs:
        mask = np.uint32((1 << bits) - 1)
        cols = [(got[f"${n}"] >> np.uint32(bits * j)) & mask for n in numbers for j in range(per)]
        results.append(np.stack(cols, axis=1).astype(_UNSIGNED[bits]).reshape(shape))
    return results


class _Call:
    """What the interpreter reads of an inline-asm op: its results."""

    def __init__(self, results):
        self.results = results

    def get_result(self, i):
        return self.results[i]


_RUN: collections.Counter = collections.Counter()  # PTX text -> calls evaluated (elements / pack) in the block


def _create_inline_asm(self, asm, constraints, values, types, is_pure, pack):
    _RUN[asm] += values[0].data.size // pack
    operands = [(v.data, v.dtype.primitive_bitwidth) for v in values]
    scalars = [t.element_ty if hasattr(t, "element_ty") else t for t in types]
    outs = evaluate(asm, constraints, operands, [t.primitive_bitwidth for t in scalars], pack)
    np_types = [interpreter._get_np_dtype(t) for t in scalars]
    return _Call([interpreter.TensorHandle(o.view(dt), t) for o, dt, t in zip(outs, np_types, scalars)])


@contextlib.contextmanager
def emulated_ptx():
    """Inside the block the interpreter evaluates inline PTX with the emulator and the launchers take the
    sm_90 PTX paths (the launch plans are made afresh on entry and on exit: the tiles cache is cleared).
    Yields a Counter: each PTX text run in the block, with its calls."""
    if not codecs.INTERPRETED:
        raise RuntimeError("emulated_ptx: the kernels run on a GPU here, not in the interpreter")
    saved = interpreter.InterpreterBuilder.create_inline_asm
    interpreter.InterpreterBuilder.create_inline_asm = _create_inline_asm
    codecs.PTX_EMULATED["on"] = True
    profiles._TILES_CACHE.clear()  # launch plans made before it chose the paths without PTX: made again
    _RUN.clear()
    try:
        yield _RUN
    finally:
        codecs.PTX_EMULATED["on"] = False
        interpreter.InterpreterBuilder.create_inline_asm = saved
        profiles._TILES_CACHE.clear()
