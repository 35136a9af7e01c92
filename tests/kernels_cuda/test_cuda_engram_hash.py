"""``engram_hash`` (kernels_cuda/engram_hash.py): the one-launch n-gram bucket ids against the
reference (the graph's former torch code, now ``refmath.engram_hash``) and against ids computed
position by position in plain Python, on fresh random sequences with -1 entries (odd batches,
chunk lengths, head counts and layer counts; n-gram sizes 2 to 5; int64 multipliers whose
products wrap); one launch, and the switch ``engram_hash.in_kernel`` off launches none."""
import pytest
import torch

import flashrt
from flashrt import ops
from kernel_check import DEVICE, assert_error, launches, pinned_tiles, requires_kernels, run_both  # noqa: F401

pytestmark = requires_kernels
eng = pytest.importorskip("flashrt.kernels_cuda.engram")

MASK64 = (1 << 64) - 1


def _case(rng, B, S, N, H, L, dead=0.15):
    seq = torch.randint(0, 100_000, (B, N - 1 + S), generator=rng)
    seq[torch.rand(B, N - 1 + S, generator=rng) < dead] = -1
    mult = torch.randint(0, 2 ** 62, (L, N), generator=rng) * 2 + 1  # wraps on multiply
    primes = torch.randint(100_003, 200_003, (L, (N - 1) * H), generator=rng)  # any positive modulus
    offsets = primes.cumsum(1) - primes
    pad = int(torch.randint(0, 100_000, (1,), generator=rng))
    return tuple(t.to(DEVICE) for t in (seq, mult, primes, offsets)) + (pad,)


def _signed(v: int) -> int:
    v &= MASK64
    return v - (1 << 64) if v >> 63 else v


def _by_hand(seq, mult, primes, offsets, pad):
    """Nested Python loops over (row, position, layer, n-gram size, head), 64-bit wrapping by hand."""
    seq, mult, primes, offsets = (t.cpu().tolist() for t in (seq, mult, primes, offsets))
    L, N = len(mult), len(mult[0])
    H, S = len(primes[0]) // (N - 1), len(seq[0]) - (N - 1)
    out = torch.zeros(len(seq), S, L, (N - 1) * H, dtype=torch.int64)
    for b, row in enumerate(seq):
        for s in range(S):
            for l in range(L):
                h, blocked = 0, False
                for j in range(N):
                    tok = row[N - 1 + s - j]
                    blocked = blocked or tok == -1
                    h = _signed(h ^ _signed((pad if blocked else tok) * mult[l][j]))
                    for k in range(H if j else 0):
                        c = (j - 1) * H + k
                        out[b, s, l, c] = h % primes[l][c] + offsets[l][c]  # Python %: non-negative
    return out


@pytest.mark.parametrize("B,S,N,H,L", [(1, 1, 3, 8, 2), (3, 5, 2, 3, 1), (2, 7, 4, 5, 3), (5, 1, 5, 1, 2),
                                       (1, 19, 3, 17, 1)])
def test_kernel_matches_the_reference_and_ids_by_hand(rng, B, S, N, H, L):
    args = _case(rng, B, S, N, H, L)
    got, want = run_both("engram_hash", *args)
    assert got.dtype == torch.int64 and tuple(got.shape) == (B, S, L, (N - 1) * H)
    assert torch.equal(got, want)
    assert torch.equal(got.cpu(), _by_hand(*args))


def test_all_dead_and_no_dead_rows(rng):
    seq, mult, primes, offsets, pad = _case(rng, 3, 4, 3, 2, 2, dead=0.0)
    seq[1] = -1  # every shift reads pad
    seq[2, :2] = -1  # a fresh sequence: the history is empty
    got, want = run_both("engram_hash", seq, mult, primes, offsets, pad)
    assert torch.equal(got, want) and torch.equal(got.cpu(), _by_hand(seq, mult, primes, offsets, pad))


def test_one_launch_and_the_switch_off_is_the_same(rng, launches):
    args = _case(rng, 2, 3, 4, 3, 2)
    with pinned_tiles(engram=dict(engram_hash=dict(in_kernel=True))), flashrt.use_backend("cuda"):
        fused = ops.engram_hash(*args)
    assert launches == ["_engram_hash_kernel"]
    with pinned_tiles(engram=dict(engram_hash=dict(in_kernel=False))), flashrt.use_backend("cuda"):
        plain = ops.engram_hash(*args)
    assert launches == ["_engram_hash_kernel"]  # the switch off launched no kernel
    assert torch.equal(fused, plain)


def test_empty_chunk_and_bad_arguments_are_named(rng):
    seq, mult, primes, offsets, pad = _case(rng, 2, 3, 3, 2, 2)
    got, want = run_both("engram_hash", seq[:, :2], mult, primes, offsets, pad)  # S = 0
    assert tuple(got.shape) == (2, 0, 2, 4) and torch.equal(got, want)
    call = lambda **kw: ops.engram_hash(**{"seq": seq, "multipliers": mult, "primes": primes,
                                           "offsets": offsets, "pad": pad, **kw})
    assert_error(lambda: call(seq=seq.int()), "seq", "int64")
    assert_error(lambda: call(primes=primes[:, :3], offsets=offsets[:, :3]), "primes", "C=3")
    assert_error(lambda: call(offsets=offsets[:1]), "offsets", "L=2")
    assert_error(lambda: call(multipliers=mult[:, :1]), "multipliers", "N=1")
    assert_error(lambda: call(seq=seq[:, :1]), "seq", "T=1")
    assert_error(lambda: call(pad=-1), "pad", ">= 0")
    below = seq.clone()
    below[0, 0] = -2  # under -1 (no token): out of range whatever the draw
    assert_error(lambda: call(seq=below), "seq", "values in")


@pytest.mark.parametrize("B,S", [(1, 1), (3, 6)])
def test_the_models_hasher_is_the_same_on_both_backends(rng, B, S):
    """``EngramHasher.hash_ids`` of ``tiny``'s layout (identity token map), with a dead-position
    mask and a history that starts mid-sequence: the ids and the next history agree exactly."""
    from flashrt.graphs.config import shipped_config
    from flashrt.graphs.engram_hash import EngramHasher, EngramLayout, TokenMap

    cfg = shipped_config("tiny")
    layout = EngramLayout.from_config(cfg)
    hasher = EngramHasher(layout, TokenMap.identity(layout.compressed_vocab_size))
    tokens = torch.randint(0, layout.compressed_vocab_size, (B, S), generator=rng).to(DEVICE)
    history = torch.randint(-1, layout.compressed_vocab_size, (B, layout.max_ngram - 1), generator=rng).to(DEVICE)
    mask = (torch.rand(B, S, generator=rng) > 0.2).to(DEVICE)
    out = {}
    for backend in ("cuda", "reference"):
        with flashrt.use_backend(backend):
            out[backend] = hasher.hash_ids(tokens, history, mask)
    assert torch.equal(out["cuda"][0], out["reference"][0]) and torch.equal(out["cuda"][1], out["reference"][1])
