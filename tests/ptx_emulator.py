"""A small emulator of the PTX instructions the packed E2M1 decodes and encoder use (``mov``, ``prmt``,
shifts, masks, ``lop3``, ``mul.rn.bf16x2``, ``set.gt.u32.bf16x2``) on uint32 numpy arrays, so their text
is checked without a GPU."""
import numpy as np
import torch


def _lanes(x: np.ndarray) -> torch.Tensor:
    """The two bf16 lanes of each uint32 (low half first), [..., 2]."""
    halves = np.stack([x & 0xFFFF, x >> 16], axis=-1).astype(np.uint16)
    return torch.from_numpy(halves.view(np.int16).copy()).view(torch.bfloat16)


def _bf16x2_mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Two bf16 lanes per uint32, multiplied lane by lane with round to nearest even."""
    prod = (_lanes(a).float() * _lanes(b).float()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return prod[..., 0].astype(np.uint32) | (prod[..., 1].astype(np.uint32) << 16)


def _bf16x2_gt(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Two bf16 lanes per uint32 compared lane by lane (ordered: NaN is never greater): 0xFFFF where
    ``a``'s lane is greater, else 0."""
    gt = (_lanes(a).float() > _lanes(b).float()).numpy()
    return np.where(gt[..., 0], 0xFFFF, 0).astype(np.uint32) | np.where(gt[..., 1], 0xFFFF0000, 0).astype(np.uint32)


def _lop3(a: np.ndarray, b: np.ndarray, c: np.ndarray, lut: int) -> np.ndarray:
    """Bitwise function of three inputs by its truth table (``lut`` bit ``(a << 2) | (b << 1) | c``,
    read as the value the table has for the operand patterns 0xF0, 0xCC, 0xAA)."""
    a, b, c = (np.broadcast_to(v, np.broadcast(a, b, c).shape).astype(np.uint32) for v in (a, b, c))
    out = np.zeros(a.shape, dtype=np.uint32)
    for bit in range(8):
        if lut >> bit & 1:
            ta, tb, tc = (0xF0 >> bit) & 1, (0xCC >> bit) & 1, (0xAA >> bit) & 1
            out |= (a if ta else ~a) & (b if tb else ~b) & (c if tc else ~c)
    return out


def _prmt(a: np.ndarray, b: np.ndarray, sel: int) -> np.ndarray:
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = np.zeros_like(a)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = pool[nib & 7]
        if nib & 8:  # the default mode's sign replicate: the selected byte's bit 7 in all eight bits
            byte = np.where(byte & 0x80, 0xFF, 0).astype(a.dtype)
        out |= byte << (8 * i)
    return out


def run_ptx(text: str, operands: dict) -> dict:
    """Execute ``text`` (the instructions the packed E2M1 decodes use) on uint32 arrays; ``operands`` maps
    ``$n`` to its input array; returns every register, ``$n`` outputs included."""
    regs = {f"${k}": v.astype(np.uint32) for k, v in operands.items()}

    def val(tok):
        tok = tok.strip()
        return regs[tok] if tok in regs else np.uint32(int(tok, 0))

    for line in text.strip().splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        if op == "mov.b32":
            regs[dst] = np.broadcast_to(val(src[0]), next(iter(operands.values())).shape).astype(np.uint32)
        elif op == "prmt.b32":
            regs[dst] = _prmt(val(src[0]), val(src[1]), int(src[2], 0))
        elif op == "shl.b32":
            regs[dst] = (val(src[0]) << np.uint32(int(src[1], 0))) & np.uint32(0xFFFFFFFF)
        elif op == "shr.b32":
            regs[dst] = val(src[0]) >> np.uint32(int(src[1], 0))
        elif op == "and.b32":
            regs[dst] = val(src[0]) & val(src[1])
        elif op == "or.b32":
            regs[dst] = val(src[0]) | val(src[1])
        elif op == "mul.rn.bf16x2":
            regs[dst] = _bf16x2_mul(val(src[0]), val(src[1]))
        elif op == "set.gt.u32.bf16x2":
            regs[dst] = _bf16x2_gt(val(src[0]), val(src[1]))
        elif op == "lop3.b32":
            regs[dst] = _lop3(val(src[0]), val(src[1]), val(src[2]), int(src[3], 0))
        else:
            raise AssertionError(f"instruction not emulated: {line}")
    return regs


def bf16_bits(values: torch.Tensor) -> np.ndarray:
    """bf16 bit patterns (uint32) of ``values``."""
    return values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).astype(np.uint32)


def bf16_values(bits: np.ndarray) -> torch.Tensor:
    """float64 values of bf16 bit patterns (uint, any shape)."""
    return torch.from_numpy(bits.astype(np.int32).astype(np.int16)).view(torch.bfloat16).double()


def e2m1_in_order(data: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """The bf16 bits (uint32 [n, 8]) of the eight E2M1 codes of ``data`` [n, 4] (uint8, code 2i byte i's low
    nibble) in element order, each times its byte pair's scale (``scales`` [n, 2] float64: bytes 0, 1 and
    2, 3), computed from the codes' value table: what an ordered decode's registers hold, lane by lane."""
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    codes = torch.stack([data & 15, data >> 4], dim=-1).reshape(-1, 8).long()
    values = table[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    return bf16_bits(values * scales.repeat_interleave(4, dim=1))


def lanes(regs: dict, n_regs: int = 4) -> np.ndarray:
    """The 16-bit lanes (uint32 [n, 2 * n_regs]) of output registers $0.. in order, the low half first."""
    return np.stack([(regs[f"${r}"] >> (16 * h)) & 0xFFFF for r in range(n_regs) for h in (0, 1)], axis=1)


def words_of(data: torch.Tensor) -> np.ndarray:
    """uint32 little-endian words of ``data`` [n, 4] (uint8): the register four packed bytes make."""
    w = data.numpy().astype(np.uint32)
    return w[:, 0] | w[:, 1] << 8 | w[:, 2] << 16 | w[:, 3] << 24


def assert_fold_exact(rng, plain: str, folded: str, power: int, max_byte: int, regs: tuple, n_out: int) -> None:
    """``folded`` (its scale operands ``2**(u - 127 + power)``, the bits ``(u + power) << 7``) gives
    ``plain``'s output registers (scales ``2**(u - 127)``, a multiply by ``2**power``) for every byte
    and scale bytes ``u`` in 0..``max_byte``; ``regs``: the numbers of the word's and the two scale
    pairs' registers, ``n_out`` the outputs'."""
    n = 4096
    data = torch.randint(0, 256, (n, 4), generator=rng, dtype=torch.uint8)
    data[:64] = torch.arange(256, dtype=torch.uint8).view(64, 4)
    scale_bytes = torch.randint(0, max_byte + 1, (n, 2), generator=rng)
    scale_bytes[:2] = torch.tensor([[0, 1], [max_byte - 1, max_byte]])
    base = bf16_bits(torch.exp2(scale_bytes.double() - 127))
    moved = bf16_bits(torch.exp2(scale_bytes.double() - 127 + power))
    np.testing.assert_array_equal(moved, ((scale_bytes.numpy() + power) << 7).astype(np.uint32))
    w, s0, s1 = regs
    want = run_ptx(plain, {w: words_of(data), s0: base[:, 0] * 0x10001, s1: base[:, 1] * 0x10001})
    got = run_ptx(folded, {w: words_of(data), s0: moved[:, 0] * 0x10001, s1: moved[:, 1] * 0x10001})
    for reg in range(n_out):
        np.testing.assert_array_equal(got[f"${reg}"], want[f"${reg}"], err_msg=f"${reg}")
