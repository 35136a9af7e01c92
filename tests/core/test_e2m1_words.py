"""The E2M1 word layout (``flashrt.e2m1_words``, ``formats.with_e2m1_words``): every code's bits land
where ``WORD_BITS`` says, the layout round-trips, and a QTensor in it stands for the same values
through every path that reads packed fp4 on the CPU (dequantize, rows, narrow, device copies, the
MoE layer's per-expert views)."""
import dataclasses

import pytest
import torch

from flashrt import e2m1_words, formats


def test_the_bit_positions_are_a_permutation_of_the_word():
    bits = [b for code in e2m1_words.WORD_BITS for b in code]
    assert sorted(bits) == list(range(32)) and len(e2m1_words.WORD_BITS) == 8


def test_each_code_moves_where_the_table_says(rng):
    """Independent of the grouped shifts: code j of a word (nibble j of the little-endian standard
    word) has its bit i at WORD_BITS[j][i] of the rearranged word."""
    data = torch.randint(0, 256, (4096, 4), generator=rng, dtype=torch.uint8)
    data[:64] = torch.arange(256, dtype=torch.uint8).view(64, 4)
    std = data.to(torch.int64)
    std = std[:, 0] | std[:, 1] << 8 | std[:, 2] << 16 | std[:, 3] << 24
    out = e2m1_words.to_words(data).to(torch.int64)
    out = out[:, 0] | out[:, 1] << 8 | out[:, 2] << 16 | out[:, 3] << 24
    for j, positions in enumerate(e2m1_words.WORD_BITS):
        for i, p in enumerate(positions):
            assert torch.equal((out >> p) & 1, (std >> (4 * j + i)) & 1), (j, i)


def test_round_trip_any_shape(rng, monkeypatch):
    for shape in ((8,), (3, 5, 64), (2, 1, 4)):
        data = torch.randint(0, 256, shape, generator=rng, dtype=torch.uint8)
        assert torch.equal(e2m1_words.from_words(e2m1_words.to_words(data)), data)
    whole = e2m1_words.to_words(data := torch.randint(0, 256, (7, 12), generator=rng, dtype=torch.uint8))
    monkeypatch.setattr(e2m1_words, "_CHUNK_WORDS", 5)  # words rearranged 5 at a time: the same bytes
    assert torch.equal(e2m1_words.to_words(data), whole) and torch.equal(e2m1_words.from_words(whole), data)


def test_bytes_at_any_offset(rng):
    """A view whose first byte is not at a multiple of 4 in its storage gives the same words as a copy."""
    big = torch.randint(0, 256, (3, 41), generator=rng, dtype=torch.uint8)
    for view in (big.view(-1)[1:33], big[:, 1:9], big[1:, 5:37]):
        assert torch.equal(e2m1_words.to_words(view), e2m1_words.to_words(view.clone()))
        assert torch.equal(e2m1_words.from_words(e2m1_words.to_words(view)), view)


@pytest.mark.parametrize("data", [torch.zeros(6, dtype=torch.uint8), torch.zeros(8, dtype=torch.int8),
                                  torch.tensor(3, dtype=torch.uint8)])
def test_bad_bytes_are_refused(data):
    with pytest.raises(ValueError, match="to_words: expected packed fp4 bytes"):
        e2m1_words.to_words(data)


def test_a_qtensor_in_words_stands_for_the_same_values(rng):
    w = formats.quantize(torch.randn(4, 32, 96, generator=rng), "fp4_w")
    words = formats.with_e2m1_words(w)
    assert words.e2m1_words and not w.e2m1_words and not torch.equal(words.data, w.data)
    assert formats.with_e2m1_words(words) is words and torch.equal(formats.with_nibbles(words).data, w.data)
    assert torch.equal(formats.dequantize(words), formats.dequantize(w))
    for view in (words.narrow(0, 1, 2), words.to("cpu"), formats.with_k_major_scales(words),
                 formats.with_scale_max(words)):
        assert view.e2m1_words
    assert torch.equal(formats.dequantize(words.narrow(0, 1, 2)), formats.dequantize(w)[1:3])
    rows = formats.quantize(torch.randn(40, 64, generator=rng), "fp4_b16")
    idx = torch.randint(0, 40, (7,), generator=rng)
    got = formats.dequantize_rows(formats.with_e2m1_words(rows), idx)
    assert torch.equal(got, formats.dequantize_rows(rows, idx))
    with pytest.raises(ValueError, match="expected a packed fp4 format, got 'fp8_w'"):
        formats.with_e2m1_words(formats.quantize(torch.randn(32, 32, generator=rng), "fp8_w"))


def test_the_expert_stack_and_its_views_keep_the_layout(rng):
    from flashrt.graphs.moe import expert_view

    w = formats.quantize(torch.randn(3, 64, 64, generator=rng), "fp4_w")
    stack = formats.as_expert_stack(w, k_major=True, words=True)
    assert stack.e2m1_words and stack.scale_max == int(w.scale.view(torch.uint8).max())
    one = expert_view(stack, 2)
    assert one.e2m1_words and torch.equal(formats.dequantize(one), formats.dequantize(w)[2])
    fp8 = formats.quantize(torch.randn(2, 64, 64, generator=rng), "fp8_w")
    assert not formats.as_expert_stack(fp8, k_major=False, words=True).e2m1_words  # fp4 codes only
    assert dataclasses.replace(stack, fmt="fp4_b32").e2m1_words
