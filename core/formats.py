"""Quantized formats: ``QTensor`` and the codecs of docs/ops.md.

| fmt | element | data layout | block | scale dtype | scale rule (amax over the block) |
|---|---|---|---|---|---|
| ``fp8`` | E4M3 (max 448) | ``float8_e4m3fn [..., N]`` | 32 | ``float8_e8m0fnu`` | smallest 2**k >= max(amax, 1e-4) / 448 |
| ``fp4_b16`` | E2M1 | ``uint8 [..., N/2]`` | 16 | ``float8_e4m3fn`` | e4m3(max(amax, 6 * 2**-9) / 6), nearest |
| ``fp4_b32`` | E2M1 | ``uint8 [..., N/2]`` | 32 | ``float8_e8m0fnu`` | smallest 2**k >= max(amax, 6 * 2**-126) / 6 |
| ``fp8_w`` | E4M3 | ``float8_e4m3fn [..., out, in]`` | 32x32 tile | ``float8_e8m0fnu [..., ceil(out/32), ceil(in/32)]`` | as ``fp8`` over the tile |
| ``fp4_w`` | E2M1 | ``uint8 [..., out, in/2]`` | 32 inputs | ``float8_e8m0fnu [..., out, in/32]`` | as ``fp4_b32`` |
| ``int8`` | int8 (+-127) | ``int8 [..., N]`` | 32 | ``float8_e8m0fnu [..., N/32]`` | smallest 2**k >= max(amax, 127 * 2**-126) / 127 |
| ``int8_t`` | int8 (+-127) | ``int8 [..., N]`` | the row (N) | ``float32 [..., 1]`` | max(amax, 2**-126) / 127 (fp32 division) |
| ``int8_w`` | int8 (+-127) | ``int8 [..., out, in]`` | the row (in) | ``bfloat16 [..., out, 1]`` | the fp32 quotient max(amax, 2**-126) / 127 rounded to bf16, nearest even |

Elements are ``x / scale`` computed in fp32 (IEEE division), clamped to the element range, rounded
to nearest with ties to even. E2M1 codes index ``E2M1_VALUES``; the sign is bit 3 and follows the
sign bit of the input (``-0.0`` and small negatives that round to zero give code 8, negative
zero). Two codes per byte: element ``2i`` in the low nibble, ``2i+1`` in the high nibble.
The ``fp4_b16`` scale is computed as an fp32 division by 6, clamped to 448 (the largest E4M3),
then rounded to E4M3 to nearest even. NaN inputs are not representable in E2M1 and have no
defined result.

The int8 formats serve devices with no FP8 (Ascend 910B; ``flashrt.backends.ascend``). Elements are
``x / scale`` in fp32, rounded to nearest with ties to even, then clamped to [-127, 127] (-128 is
never produced; ``-0.0`` gives 0). ``int8`` is the window-KV / activation-block format: its
power-of-two scale keeps every dequantized value exact in bf16 (7 significant bits at most), so a
bf16 operator receives exactly the values the format stands for. ``int8_t`` is the per-token
activation format that ``linear`` / ``moe_experts`` use in front of an ``int8_w`` weight (what
``torch_npu.npu_dynamic_quant`` computes: scale = row amax / 127 in fp32). ``int8_w`` is the weight
format consumed by ``torch_npu.npu_quant_matmul`` / ``npu_grouped_matmul`` (one scale per output
channel, in bf16, the scale dtype those operators accept with a bf16 output).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from flashrt import e2m1_words

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E4M3_MAX = 448.0
E2M1_MAX = 6.0


@dataclass(frozen=True)
class FormatSpec:
    """Static description of one quantized format (one row of the table above)."""

    name: str
    element: str  # "e4m3" or "e2m1"
    block: int  # elements per scale along the last dim (tile edge for fp8_w)
    scale_dtype: torch.dtype
    amax_floor: float
    tiled: bool = False  # fp8_w: 2-D tiles over the last two dims
    weight: bool = False  # needs at least [out, in]
    row: bool = False  # one scale per row of the last dim (int8_t, int8_w)

    @property
    def packed(self) -> bool:
        return self.element == "e2m1"

    @property
    def data_dtype(self) -> torch.dtype:
        if self.element == "int8":
            return torch.int8
        return torch.uint8 if self.packed else torch.float8_e4m3fn


MAIN_KV_FORMAT = "fp4_b16"  # the main (compressed) KV's one format everywhere: E2M1, an E4M3 scale per 16

FORMATS: dict[str, FormatSpec] = {
    "fp8": FormatSpec("fp8", "e4m3", 32, torch.float8_e8m0fnu, 1e-4),
    "fp4_b16": FormatSpec("fp4_b16", "e2m1", 16, torch.float8_e4m3fn, 6 * 2.0**-9),
    "fp4_b32": FormatSpec("fp4_b32", "e2m1", 32, torch.float8_e8m0fnu, 6 * 2.0**-126),
    "fp8_w": FormatSpec("fp8_w", "e4m3", 32, torch.float8_e8m0fnu, 1e-4, tiled=True, weight=True),
    "fp4_w": FormatSpec("fp4_w", "e2m1", 32, torch.float8_e8m0fnu, 6 * 2.0**-126, weight=True),
    "int8": FormatSpec("int8", "int8", 32, torch.float8_e8m0fnu, 127 * 2.0**-126),
    "int8_t": FormatSpec("int8_t", "int8", 0, torch.float32, 2.0**-126, row=True),
    "int8_w": FormatSpec("int8_w", "int8", 0, torch.bfloat16, 2.0**-126, weight=True, row=True),
}
INT8_MAX = 127.0


def spec(fmt: str) -> FormatSpec:
    """The FormatSpec of ``fmt``; ``ValueError`` naming the known formats otherwise."""
    try:
        return FORMATS[fmt]
    except (KeyError, TypeError):
        raise ValueError(f"fmt: expected one of {sorted(FORMATS)}, got {fmt!r}") from None


@dataclass
class QTensor:
    """A quantized tensor: ``data`` and ``scale`` in the layout of ``fmt``, logical ``shape``;
    ``scale_max``: the largest scale byte where it was measured (:func:`with_scale_max`), else None;
    ``e2m1_words``: packed fp4 data in the word layout (:mod:`flashrt.e2m1_words`,
    :func:`with_e2m1_words`), not the standard nibbles."""

    data: torch.Tensor
    scale: torch.Tensor
    fmt: str
    shape: torch.Size
    scale_max: int | None = None
    e2m1_words: bool = False

    def __post_init__(self):
        self.shape = torch.Size(self.shape)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes held by data and scale together."""
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()

    def narrow(self, dim: int, start: int, length: int) -> "QTensor":
        """A view of ``length`` entries from ``start`` along a leading (not the last) dim."""
        dim = dim % self.ndim
        if dim == self.ndim - 1:
            raise ValueError("QTensor.narrow: the last (blocked) dim cannot be narrowed")
        shape = list(self.shape)
        shape[dim] = length
        return replace(self, data=self.data.narrow(dim, start, length), scale=self.scale.narrow(dim, start, length),
                       shape=shape)

    def to(self, device) -> "QTensor":
        return replace(self, data=self.data.to(device), scale=self.scale.to(device))

    def __repr__(self) -> str:
        return f"QTensor(fmt={self.fmt!r}, shape={tuple(self.shape)}, device={self.device})"


def with_k_major_scales(w: QTensor) -> QTensor:
    """``w`` with its scale stored K major: the same ``[.., rows, K / block]`` tensor and values, laid
    out ``[.., K / block, rows]`` in memory (one copy of the scales; the data is shared). A kernel
    reading a block of rows' scales at one K group then reads consecutive bytes."""
    if w.scale.dim() < 2:
        raise ValueError(f"with_k_major_scales: expected a scale of at least 2 dims, got shape {tuple(w.scale.shape)}")
    return replace(w, scale=w.scale.transpose(-1, -2).contiguous().transpose(-1, -2))


def with_e2m1_words(w: QTensor) -> QTensor:
    """``w`` (packed fp4) with its data in the word layout (:mod:`flashrt.e2m1_words`: one copy of the
    data, the same shape and values); ``w`` itself when it is already so."""
    if not spec(w.fmt).packed:
        raise ValueError(f"with_e2m1_words: expected a packed fp4 format, got {w.fmt!r}")
    return w if w.e2m1_words else replace(w, data=e2m1_words.to_words(w.data), e2m1_words=True)


def with_nibbles(w: QTensor) -> QTensor:
    """``w`` with packed fp4 data in the standard layout (the inverse of :func:`with_e2m1_words`)."""
    return replace(w, data=e2m1_words.from_words(w.data), e2m1_words=False) if w.e2m1_words else w


def as_expert_stack(w: QTensor, k_major: bool, words: bool = False) -> QTensor:
    """A stacked [E, out, in] expert weight as the MoE layers keep it: its scales K major when
    ``k_major`` (the profile's ``expert_scales``), an fp4_w or fp8_w one's largest scale byte recorded
    (the packed decodes fold their re-bias into scales up to 128 / 134) and, with ``words`` (the
    profile's ``expert_fp4: words``), an fp4_w one's codes in the word layout."""
    w = with_k_major_scales(w) if k_major else w
    if words and w.fmt == "fp4_w":
        w = with_e2m1_words(w)
    return with_scale_max(w) if w.fmt in ("fp4_w", "fp8_w") else w


def with_scale_maxes(weights: dict) -> None:
    """Record ``scale_max`` (:func:`with_scale_max`) on every fp8_w / fp4_w weight of ``weights`` (name ->
    tensor or QTensor) that has none, in place: one reduction each and one read back a device, so the packed
    decodes may fold their re-bias into the scales of a model's own linear weights as of its experts'."""
    todo = [n for n, w in weights.items() if isinstance(w, QTensor) and w.fmt in ("fp4_w", "fp8_w")
            and w.scale_max is None and not w.scale.is_meta and w.scale.numel()]
    by_device: dict = {}
    for n in todo:
        by_device.setdefault(weights[n].scale.device, []).append(n)
    for names in by_device.values():
        tops = torch.stack([weights[n].scale.view(torch.uint8).max() for n in names]).tolist()
        for n, top in zip(names, tops):
            weights[n] = replace(weights[n], scale_max=int(top))


def with_scale_max(w: QTensor) -> QTensor:
    """``w`` (the same tensors) with ``scale_max``, its largest scale byte (one reduction over the
    scales, read back to the host: for weights at load, not per call); ``w`` as it is where the
    scales hold no values (the meta device: shapes only)."""
    if w.scale.is_meta:
        return w
    top = int(w.scale.view(torch.uint8).max()) if w.scale.numel() else 0
    return replace(w, scale_max=top)


def expected_layout(fmt: str, shape) -> tuple[torch.Size, torch.Size]:
    """(data shape, scale shape) that ``fmt`` stores for a logical ``shape``."""
    s = spec(fmt)
    shape = torch.Size(shape)
    n = shape[-1]
    data = shape[:-1] + (n // 2,) if s.packed else shape
    if s.tiled:
        scale = shape[:-2] + (-(-shape[-2] // s.block), -(-n // s.block))
    elif s.row:
        scale = shape[:-1] + (1,)
    else:
        scale = shape[:-1] + (n // s.block,)
    return torch.Size(data), torch.Size(scale)


def check_shape(fmt: str, shape, name: str = "x") -> None:
    """``ValueError`` when a logical ``shape`` cannot be stored in ``fmt``."""
    s = spec(fmt)
    shape = tuple(shape)
    min_rank = 2 if s.weight else 1
    if len(shape) < min_rank:
        raise ValueError(f"{name}: format {fmt!r} expects at least {min_rank} dims, got shape {shape}")
    if s.row and shape[-1] == 0:
        raise ValueError(f"{name}: format {fmt!r} expects a non-empty last dim, got shape {shape}")
    if not (s.tiled or s.row) and shape[-1] % s.block:
        raise ValueError(
            f"{name}: format {fmt!r} expects the last dim to be a multiple of {s.block}, got shape {shape}"
        )


_LAYOUTS: dict = {}  # (fmt, logical shape) -> (data dtype, data shape, scale dtype, scale shape) of valid layouts


def check_qtensor(q: QTensor, name: str) -> None:
    """``ValueError`` unless ``q``'s data and scale match the layout of its format (the layout of a
    valid (fmt, shape) is worked out once: weights are checked on every op call)."""
    try:
        want = _LAYOUTS.get((q.fmt, q.shape))
    except TypeError:  # an unhashable fmt: spec() words the error
        want = None
    if want is None:
        s = spec(q.fmt)
        check_shape(q.fmt, q.shape, name)
        if len(_LAYOUTS) >= 4096:
            _LAYOUTS.clear()
        want = _LAYOUTS[q.fmt, q.shape] = (s.data_dtype, *expected_layout(q.fmt, q.shape), s.scale_dtype)
    data_dtype, want_data, want_scale, scale_dtype = want
    if q.data.dtype != data_dtype or q.data.shape != want_data:
        raise ValueError(
            f"{name}.data: expected {data_dtype} {tuple(want_data)} for {q.fmt} {tuple(q.shape)}, "
            f"got {q.data.dtype} {tuple(q.data.shape)}"
        )
    if q.scale.dtype != scale_dtype or q.scale.shape != want_scale:
        raise ValueError(
            f"{name}.scale: expected {scale_dtype} {tuple(want_scale)} for {q.fmt} {tuple(q.shape)}, "
            f"got {q.scale.dtype} {tuple(q.scale.shape)}"
        )
    if q.scale.device != q.data.device:
        raise ValueError(f"{name}: data on {q.data.device} but scale on {q.scale.device}")


# ---------------------------------------------------------------------------------------------
# scale rules


def pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """Biased exponents (int32) of the smallest power of two >= ``v`` (fp32, positive, normal)."""
    bits = v.contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    return exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def e8m0_from_exponent(biased: torch.Tensor) -> torch.Tensor:
    """UE8M0 scale tensor whose value is 2**(biased - 127)."""
    return biased.clamp(0, 254).to(torch.uint8).view(torch.float8_e8m0fnu)


def _scale(amax: torch.Tensor, s: FormatSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(stored scale, scale as fp32) for fp32 block maxima ``amax``."""
    elem_max = {"e4m3": E4M3_MAX, "e2m1": E2M1_MAX, "int8": INT8_MAX}[s.element]
    v = amax.clamp_min(s.amax_floor) / elem_max
    if s.scale_dtype == torch.float8_e4m3fn:
        stored = v.clamp_max(E4M3_MAX).to(torch.float8_e4m3fn)
    elif s.scale_dtype in (torch.float32, torch.bfloat16):
        stored = v.to(s.scale_dtype)
    else:
        stored = e8m0_from_exponent(pow2_ceil(v))
    return stored, stored.to(torch.float32)


# ---------------------------------------------------------------------------------------------
# elements


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, sign in bit 3) of fp32 ``v``: clamp to +-6, nearest, ties to even."""
    a = v.abs().clamp_max(E2M1_MAX)
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for i, mid in enumerate(_E2M1_MIDPOINTS):
        code += (a > mid).to(torch.uint8)
        if (i + 1) % 2 == 0:  # a tie goes to the even code, here the upper one
            code += (a == mid).to(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


_E2M1_TABLES: dict = {}


def e2m1_values(code: torch.Tensor) -> torch.Tensor:
    """fp32 values of E2M1 ``code`` (uint8 in 0..15)."""
    table = _E2M1_TABLES.get(code.device)
    if table is None:
        table = torch.tensor(E2M1_VALUES + tuple(-x for x in E2M1_VALUES), device=code.device)
        if code.device.type != "meta":
            _E2M1_TABLES[code.device] = table
    return table[code.long()]


def pack_fp4(code: torch.Tensor) -> torch.Tensor:
    """[..., N] codes -> [..., N/2] bytes, element 2i in the low nibble."""
    pairs = code.view(*code.shape[:-1], code.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4(data: torch.Tensor) -> torch.Tensor:
    """[..., N/2] bytes -> [..., N] codes."""
    return torch.stack((data & 0xF, data >> 4), dim=-1).flatten(-2)


# ---------------------------------------------------------------------------------------------
# codec


def _tile_view(x: torch.Tensor, edge: int) -> torch.Tensor:
    """[..., out, in] -> zero-padded [..., out/edge, edge, in/edge, edge] (fp8_w tiles)."""
    *lead, rows, cols = x.shape
    pad_r, pad_c = -rows % edge, -cols % edge
    x = torch.nn.functional.pad(x, (0, pad_c, 0, pad_r))
    return x.view(*lead, (rows + pad_r) // edge, edge, (cols + pad_c) // edge, edge)


def _tile_scale(x: torch.Tensor, s: FormatSpec):
    tiles = _tile_view(x.abs(), s.block)
    stored, scale = _scale(tiles.amax(dim=(-1, -3)), s)
    rows, cols = x.shape[-2:]
    full = scale.repeat_interleave(s.block, -2).repeat_interleave(s.block, -1)
    return stored, full[..., :rows, :cols]


def quantize(x: torch.Tensor, fmt: str) -> QTensor:
    """Quantize ``x`` along its last dim (last two for ``fp8_w``) into ``fmt``."""
    s = spec(fmt)
    check_shape(fmt, x.shape)
    xf = x.to(torch.float32)
    if s.tiled:
        stored, full = _tile_scale(xf, s)
        v = xf / full
    else:
        block = xf.shape[-1] if s.row else s.block
        blocks = xf.view(*xf.shape[:-1], xf.shape[-1] // block, block)
        stored, scale = _scale(blocks.abs().amax(dim=-1), s)
        v = (blocks / scale.unsqueeze(-1)).view(xf.shape)
    if s.packed:
        data = pack_fp4(e2m1_codes(v))
    elif s.element == "int8":
        data = torch.round(v).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)  # round: ties to even
    else:
        data = v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return QTensor(data, stored, fmt, x.shape)


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values ``q`` stands for, as ``dtype`` (computed in fp32)."""
    s = spec(q.fmt)
    q = with_nibbles(q)
    elems = e2m1_values(unpack_fp4(q.data)) if s.packed else q.data.to(torch.float32)
    scale = q.scale.to(torch.float32)
    if s.tiled:
        rows, cols = q.shape[-2:]
        full = scale.repeat_interleave(s.block, -2).repeat_interleave(s.block, -1)
        out = elems * full[..., :rows, :cols]
    else:
        block = elems.shape[-1] if s.row else s.block
        blocks = elems.view(*elems.shape[:-1], elems.shape[-1] // block, block)
        out = (blocks * scale.unsqueeze(-1)).view(q.shape)
    return out.to(dtype)


def dequantize_rows(q: QTensor, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize only rows ``index`` of a [rows, N] (or [B, rows, N] with [B, ...] index) QTensor.

    The gather happens on the stored bytes, so only the selected rows are expanded.
    """
    if q.data.dim() == 2:
        data, scale = q.data[index], q.scale[index]
    else:
        batch = torch.arange(q.data.shape[0], device=index.device).view(-1, *([1] * (index.dim() - 1)))
        data, scale = q.data[batch, index], q.scale[batch, index]
    shape = tuple(index.shape) + tuple(q.shape[-1:])
    return dequantize(replace(q, data=data, scale=scale, shape=shape), dtype)
