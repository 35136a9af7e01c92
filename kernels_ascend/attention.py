"""sparse_attention on torch_npu.npu_gather_sparse_index + npu_sparse_flash_attention; index_scores in
plain torch."""
from __future__ import annotations

import torch

from flashrt import refmath as ref
from flashrt.conformance import note_route
from flashrt.formats import QTensor
from flashrt.kv.paged import PagedKeys

from .npu_runtime import bf16_exact, declined, fallback, float_of, gather_rows, npu_family, operator

SFA_DIM, SFA_ROPE = 512, 64  # npu_sparse_flash_attention: D fixed at 512, D_rope at 64
SFA_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
CHUNK_BYTES = 256 << 20  # cap on one gathered key block
KV_QUANT_SFA = "npu_kv_quant_sparse_flash_attention"
KV_QUANT_SFA_WHY = ("it reads int8 KV with one fp32 scale per 128-element tile stored inside the key rows; "
                    "our segments are int8 with e8m0 scales per 32 (window) or fp4_b16 (main), which it cannot read")
INDEXER_WHY = ("npu_lightning_indexer / npu_quant_lightning_indexer return top-k positions, not the fp32 scores "
               "index_scores returns (and take bf16/fp16 or per-token-head int8 keys, not fp4_b32)")


def sparse_attention_plan(q, kv, indices, sink, scale) -> str | None:
    B, S, H, D = q.shape
    K = sum(p.shape[-1] for p in indices) if isinstance(indices, tuple) else indices.shape[-1]
    segs = kv if isinstance(kv, tuple) else (kv,)
    if D != SFA_DIM:
        return f"npu_sparse_flash_attention needs D == {SFA_DIM}, got {D}"
    if H not in SFA_HEADS:
        return f"npu_sparse_flash_attention needs H in {SFA_HEADS}, got {H}"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return "npu_sparse_flash_attention takes only bf16/fp16"
    if K == 0 or sum(s.shape[1] for s in segs) == 0:
        return "no slot to attend (K == 0 or T == 0)"
    if not all(bf16_exact(s, q.dtype) for s in segs):
        return f"a KV segment is not exactly representable in {q.dtype}"
    if sink is not None and scale == 0:
        return "a sink needs scale != 0 (its logit is carried as sink / scale)"
    return None


def _split3(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., 3] in ``dtype`` whose fp32 sum is ``v`` to fp32 precision (3 x 8 significant bits)."""
    a0 = v.to(dtype)
    r = v - a0.to(torch.float32)
    a1 = r.to(dtype)
    a2 = (r - a1.to(torch.float32)).to(dtype)
    return torch.stack((a0, a1, a2), -1)


def _chunk(q, kv, idx, sink, scale):
    """One operator call for ``q [B, s, H, 512]`` and ``idx [B, s, K]`` (rows gathered first)."""
    B, S, H, D = q.shape
    K = idx.shape[-1]
    valid = idx >= 0
    rows = gather_rows("sparse_attention", kv, idx.clamp_min(0).long()).to(q.dtype)  # [B, s, K, D], exact (see plan)
    key = rows.reshape(B, S * K, 1, D)
    local = torch.arange(S * K, device=q.device, dtype=torch.int32).view(1, S, K)
    local = torch.where(valid, local, -1).sort(-1, descending=True).values  # valid first, -1 last
    q_rope = torch.zeros(B, S, H, SFA_ROPE, dtype=q.dtype, device=q.device)
    k_rope = torch.zeros(B, S * K, 1, SFA_ROPE, dtype=q.dtype, device=q.device)
    if sink is not None:  # one extra entry: key 0, rope (1, 1, 1, 0...), logit scale * sink / scale
        key = torch.cat((key, key.new_zeros(B, 1, 1, D)), 1)
        sink_rope = k_rope.new_zeros(B, 1, 1, SFA_ROPE)
        sink_rope[..., :3] = 1
        k_rope = torch.cat((k_rope, sink_rope), 1)
        q_rope[..., :3] = _split3(sink / scale, q.dtype)
        first = torch.full((B, S, 1), S * K, dtype=torch.int32, device=q.device)
        local = torch.cat((first, local), -1)
    out = operator("sparse_attention", "npu_sparse_flash_attention")(
        q.contiguous(), key, key, local.unsqueeze(2).contiguous(), scale, query_rope=q_rope, key_rope=k_rope,
        sparse_block_size=1, layout_query="BSND", layout_kv="BSND", sparse_mode=0, attention_mode=2)[0]
    if sink is None:  # no valid slot and no sink gives zeros (the operator's value there is undefined)
        out = torch.where(valid.any(-1)[..., None, None], out, torch.zeros_like(out))
    return out


def sparse_attention(q, kv, indices, sink, scale):
    """``sparse_attention`` -> ``torch_npu.npu_gather_sparse_index`` + ``npu_sparse_flash_attention``
    (MLA-absorb, attention_mode=2).

    Layout: the selected rows are gathered first with ``npu_gather_sparse_index`` from ``[B * T,
    ...]`` views (bytes for a QTensor, data and scale, then decoded exactly, e.g.
    the ``fp4_b16`` main KV and the ``int8`` window ring: this is where they are dequantized on the
    way into the operator) into a compact ``key = value [B, s*K (+1), 1, 512]`` in ``q.dtype``; the
    operator's ``sparse_indices [B, s, 1, K]`` point into it with the valid slots first (the operator
    wants valid values before the -1 padding; docs/ops.md's order is irrelevant). Our latent has no
    separate rope part, so ``query_rope``/``key_rope`` are zeros, except for the sink: an extra entry
    with key 0 (so value 0) and key_rope ``(1, 1, 1, 0, ...)`` against query_rope = ``sink[h] /
    scale`` split into three bf16 terms, whose logit is ``sink[h]`` to fp32 precision: the
    operator's softmax then has exactly docs/ops.md's extra ``exp(sink - m)`` in its denominator.
    ``sparse_mode=0`` (no causal mask: the indices say what is visible), ``scale_value = scale``.
    Rows with no valid slot and no sink are set to zero. Query positions are chunked so a gathered
    block stays under 256 MiB. Falls back to plain torch when D != 512, H is not a power of two
    <= 128, q is fp32, K == 0 or T == 0, a sink comes with scale 0, or a segment's values are not
    exact in ``q.dtype`` (fp32 KV; fp16 q with quantized KV). ``npu_kv_quant_sparse_flash_attention``
    is not used: it reads int8 KV with an fp32 scale per 128-element tile inside the key rows, a
    format neither KV segment has (re-quantizing would change the values). The schema's ``sinks``
    argument is undocumented, so the sink goes through the rope entry above. Indices given in
    parts are concatenated first.
    """
    why = sparse_attention_plan(q, kv, indices, sink, scale)
    if why:
        fallback("sparse_attention", why)
        return ref.sparse_attention(q, kv, indices, sink, scale)
    if isinstance(indices, tuple):  # parts of the indices: one [B, S, K] for the gather
        indices = torch.cat(indices, dim=-1)
    if any(isinstance(seg, QTensor) for seg in (kv if isinstance(kv, tuple) else (kv,))):
        declined("sparse_attention", KV_QUANT_SFA, KV_QUANT_SFA_WHY)
    B, S, H, D = q.shape
    step = max(1, min(S, CHUNK_BYTES // max(1, B * indices.shape[-1] * D * q.element_size())))
    parts = [_chunk(q[:, s0:s0 + step], kv, indices[:, s0:s0 + step], sink, scale) for s0 in range(0, S, step)]
    return torch.cat(parts, 1) if len(parts) > 1 else parts[0]


def prefix_attention(q, kv, positions, ring_start, window, entries, visible, sink, scale):
    """``prefix_attention``: the indices it implies built on the device (window indices and the
    visible prefix of the entries, plain torch), then :func:`sparse_attention` above (its operator
    where it applies)."""
    note_route("prefix_attention", "its indices in torch, then sparse_attention")
    return sparse_attention(q, kv, ref.prefix_indices(positions, ring_start, window, entries, visible), sink, scale)


def index_scores(q, k, weights, visible, weight_scale=1.0):
    """``index_scores``: plain torch (an fp32 einsum, relu, weighted head sum, ``-inf`` mask).

    ``torch_npu.npu_lightning_indexer`` and ``npu_quant_lightning_indexer`` fuse this score with their
    own top-k and return positions, not the fp32 ``[B, S, T]`` scores docs/ops.md returns; they also
    take bf16/fp16 keys (or int8 keys with per-token-head scales), not the ``fp4_b32`` index cache.
    So no operator: a quantized ``k`` (the ``fp4_b32``
    index cache) is decoded exactly, then the reference math runs on the device. Paged keys
    (:class:`flashrt.kv.paged.PagedKeys`) are gathered into a contiguous copy first.
    """
    fallback("index_scores", INDEXER_WHY)
    if isinstance(k, PagedKeys):  # paged index K: gathered into one [B, T, Di] copy first
        k = k.gather()
    return ref.index_scores(q, float_of(k), weights, visible, weight_scale)


PLANS = {"sparse_attention": sparse_attention_plan, "index_scores": lambda *a: INDEXER_WHY}


FAMILY = npu_family("attention", {"sparse_attention": sparse_attention, "prefix_attention": prefix_attention,
                                  "index_scores": index_scores},
                    "sparse attention (npu_gather_sparse_index + npu_sparse_flash_attention) and index scores")
