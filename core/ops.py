"""The op contract (docs/ops.md): every model graph is written only against these functions.

Each op validates its inputs (``ValueError`` naming the argument, the expected and the given
shape or dtype; out-of-range indices rejected) and then calls the implementation resolved once
for (op, device type) by :mod:`flashrt.dispatch`. Notation: ``B`` batch, ``S`` query positions,
``T`` KV entries, ``H`` heads, ``D`` head dim, ``K`` top-k. Index tensors are int32 unless said.
Ops never mutate their inputs. Outputs live on the device of the inputs.
"""
from __future__ import annotations

import torch

from . import checks as c
from .dispatch import impl as _impl
from .formats import QTensor, check_shape
from .kv.paged import PagedKeys

F32 = (torch.float32,)
I32 = (torch.int32,)
KV_FORMATS = ("fp8", "fp4_b16", "fp4_b32", "int8")  # int8: devices with no FP8 (formats.py)
WEIGHT_FORMATS = ("fp8_w", "fp4_w", "int8_w")  # int8_w: int8_t activations (formats.py)
SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [..., N]`` float, ``weight [N]`` -> like ``x``.

    Computed in fp32: ``x * rsqrt(mean(x**2, -1) + eps) * weight``, cast back to ``x.dtype``.
    """
    c.tensor("x", x, None, {}, c.FLOATS)
    env = {"N": x.shape[-1]} if x.dim() else {}
    c.tensor("weight", weight, "N", env, c.FLOATS, x.device)
    c.number("eps", eps, 0.0)
    return _impl("rms_norm", x.device)(x, weight, eps)


def rope(x: torch.Tensor, freqs_cis: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotary embedding of ``x [S, R]``, ``[B, S, R]`` or ``[B, S, H, R]`` (R even) -> like ``x``.

    Adjacent pairs ``(x[2i], x[2i+1])`` form one complex number multiplied by
    ``freqs_cis [S, P]`` (complex64; ``[B, S, P]`` gives each sequence its own positions),
    or by its conjugate when ``inverse``. ``P = R/2`` rotates every pair; ``1 <= P < R/2`` rotates
    only the last ``2P`` channels (table entry ``i`` on the ``i``-th of the last ``P`` pairs) and
    copies the first ``R - 2P`` unchanged. Computed in fp32, cast back to ``x.dtype``.
    """
    c.tensor("x", x, None, {}, c.FLOATS)
    if x.dim() not in (2, 3, 4) or x.shape[-1] % 2:
        raise ValueError(f"x: expected [S, R], [B, S, R] or [B, S, H, R] with R even, got shape {tuple(x.shape)}")
    seq_axis = 1 if x.dim() >= 3 else 0
    pairs = x.shape[-1] // 2
    fdim = freqs_cis.dim() if isinstance(freqs_cis, torch.Tensor) else 0
    if fdim in (2, 3) and not 1 <= freqs_cis.shape[-1] <= pairs:
        raise ValueError(f"freqs_cis: expected a last dim P in [1, {pairs}] (x's R/2 pairs), got shape "
                         f"{tuple(freqs_cis.shape)}")
    env = {"S": x.shape[seq_axis], "P": freqs_cis.shape[-1] if fdim in (2, 3) else pairs, "B": x.shape[0]}
    spec = "B S P" if fdim == 3 else "S P"
    c.tensor("freqs_cis", freqs_cis, spec, env, (torch.complex64,), x.device)
    if freqs_cis.dim() == 3 and x.dim() == 2:
        raise ValueError(f"freqs_cis: per-sequence [B, S, P] needs x with a batch dim, got x shape {tuple(x.shape)}")
    return _impl("rope", x.device)(x, freqs_cis, bool(inverse))


def quantize(x: torch.Tensor, fmt: str) -> QTensor:
    """Quantize ``x`` float along its last dim (last two for ``fp8_w``) into ``fmt``.

    Formats, scale rules and packing: :mod:`flashrt.formats`.
    """
    c.tensor("x", x, None, {}, c.FLOATS)
    c.fmt("fmt", fmt)
    check_shape(fmt, x.shape, "x")
    return _impl("quantize", x.device)(x, fmt)


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values a ``QTensor`` stands for, as ``dtype`` (computed in fp32)."""
    if not isinstance(q, QTensor):
        raise ValueError(f"q: expected a QTensor, got {type(q).__name__}")
    c.maybe_quantized("q", q, None, {}, c.FORMATS)
    c.choice("dtype", dtype, c.FLOATS)
    return _impl("dequantize", q.device)(q, dtype)


def linear(x: torch.Tensor, weight) -> torch.Tensor:
    """``x [..., in]`` float, ``weight [out, in]`` plain or ``QTensor`` ``fp8_w``/``fp4_w`` -> ``[..., out]``.

    Plain weight: ``x @ weight.T`` accumulated in fp32. Quantized weight: ``x`` is first
    quantized to ``fp8`` (per 32, UE8M0; ``int8_t``, one scale per token, for an ``int8_w``
    weight), then ``dequant(xq) @ dequant(w).T`` accumulated in fp32.
    Output dtype ``x.dtype``.
    """
    c.tensor("x", x, None, {}, c.FLOATS)
    if x.dim() == 0:
        raise ValueError("x: expected at least 1 dim [..., in], got a scalar")
    env = {"in": x.shape[-1]}
    c.maybe_quantized("weight", weight, "out in", env, WEIGHT_FORMATS, x.device)
    if isinstance(weight, QTensor) and x.shape[-1] % 32:
        raise ValueError(f"x: a quantized weight needs in % 32 == 0 (fp8 activations), got in={x.shape[-1]}")
    return _impl("linear", x.device)(x, weight)


def sparse_attention(q, kv, indices, sink, scale: float) -> torch.Tensor:
    """MQA over selected entries: ``q [B, S, H, D]``, ``kv [B, T, D]`` plain or ``QTensor``
    (``fp8``/``fp4_b16``/``fp4_b32``), ``indices [B, S, K]`` int32 in ``[-1, T)`` (``-1`` empty,
    order irrelevant), ``sink [H]`` fp32 or None, ``scale`` float -> ``[B, S, H, D]`` ``q.dtype``.

    ``kv`` may also be a tuple of segments ``[B, T_i, D]`` (each plain or QTensor, e.g. the fp8
    window ring, the fp8 chunk and the fp4 compressed cache) standing for their concatenation
    along T (``T = sum T_i``); nothing is concatenated in memory. A segment whose batch dim is 1
    is shared by every row (the HKCP page pool).

    ``l_j = scale * <q, kv[idx_j]>`` over valid slots, ``m = max(max_j l_j, sink)``;
    ``out = sum_j exp(l_j - m) kv[idx_j] / (sum_j exp(l_j - m) + exp(sink - m))``; no valid slot
    and no sink gives zeros. Math in fp32.
    """
    env: dict = {}
    c.tensor("q", q, "B S H D", env, c.FLOATS)
    if isinstance(kv, (tuple, list)):
        if not kv:
            raise ValueError("kv: expected at least one segment, got an empty tuple")
        total = 0
        for i, seg in enumerate(kv):
            # a segment with batch 1 is shared by every row (e.g. the HKCP device page pool)
            shared = isinstance(seg, (torch.Tensor, QTensor)) and seg.ndim == 3 and seg.shape[0] == 1
            seg_env = {"B": 1 if shared else env["B"], "D": env["D"]}
            c.maybe_quantized(f"kv[{i}]", seg, "B T D", seg_env, KV_FORMATS, q.device)
            total += seg_env["T"]
        env["T"] = total
        kv = tuple(kv)
    else:
        c.maybe_quantized("kv", kv, "B T D", env, KV_FORMATS, q.device)
    c.tensor("indices", indices, "B S K", env, I32, q.device)
    if sink is not None:
        c.tensor("sink", sink, "H", env, F32, q.device)
    c.number("scale", scale)
    c.index_range("indices", indices, -1, env["T"])
    return _impl("sparse_attention", q.device)(q, kv, indices, sink, float(scale))


def index_scores(q, k, weights, visible) -> torch.Tensor:
    """Indexer scores: ``q [B, S, Hi, Di]``, ``k [B, T, Di]`` plain or ``QTensor`` or
    :class:`flashrt.kv.paged.PagedKeys`, ``weights [B, S, Hi]`` fp32, ``visible [B, S]`` int32 in
    ``[0, T]`` -> fp32 ``[B, S, T]``.

    ``score[b,s,t] = sum_h relu(<q[b,s,h], k[b,t]>) * weights[b,s,h]`` for ``t < visible[b,s]``,
    else ``-inf``. Math in fp32.

    Paged ``k`` (HKCP index K): ``PagedKeys(pool, block_table, page_size, length)`` with ``pool``
    ``[1, pages * page_size, Di]`` (plain or QTensor), ``block_table`` int32 ``[B, max_pages]``
    in ``[0, pages)`` and ``T = length``; ``k[b, t]`` is pool row
    ``block_table[b, t // page_size] * page_size + t % page_size``. Backends read the rows in
    place (no gathered copy of the keys, except as a fallback).
    """
    env: dict = {}
    c.tensor("q", q, "B S Hi Di", env, c.FLOATS)
    if isinstance(k, PagedKeys):
        c.paged_keys("k", k, "B T Di", env, KV_FORMATS, q.device)
    else:
        c.maybe_quantized("k", k, "B T Di", env, KV_FORMATS, q.device)
    c.tensor("weights", weights, "B S Hi", env, F32, q.device)
    c.tensor("visible", visible, "B S", env, I32, q.device)
    c.index_range("visible", visible, 0, env["T"] + 1)
    return _impl("index_scores", q.device)(q, k, weights, visible)


def topk_positions(scores, k: int, candidates=None) -> torch.Tensor:
    """``scores [B, S, T]`` fp32, ``k >= 1``, ``candidates [B, S, T]`` bool or None ->
    int32 ``[B, S, min(k, T)]``.

    The positions of the ``k`` largest finite scores of each row (only where ``candidates``, when
    given), in ascending position order, then ``-1`` for each pick left over. Ties between equal
    scores go to the lower position.
    """
    env: dict = {}
    c.tensor("scores", scores, "B S T", env, F32)
    c.integer("k", k, 1)
    if candidates is not None:
        c.tensor("candidates", candidates, "B S T", env, (torch.bool,), scores.device)
    return _impl("topk_positions", scores.device)(scores, k, candidates)


def candidate_blocks(scores, visible, topk_blocks: int, block_size: int) -> torch.Tensor:
    """First level of the two-level top-k: ``scores [B, S, T]`` fp32, ``visible [B, S]`` int32 in
    ``[0, T]`` -> bool ``[B, S, T]``.

    Blocks of ``block_size`` consecutive positions (the last one may be partial) are scored by
    the max of their finite scores. The block holding position ``visible - 1`` (when
    ``visible > 0``) is pinned: it is always kept and counts as one of the ``topk_blocks``, as in
    the published model. The remaining picks go to the best blocks whose score is finite (ties to
    the lower block). Every position of a kept block is marked.
    """
    env: dict = {}
    c.tensor("scores", scores, "B S T", env, F32)
    c.tensor("visible", visible, "B S", env, I32, scores.device)
    c.integer("topk_blocks", topk_blocks, 1)
    c.integer("block_size", block_size, 1)
    c.index_range("visible", visible, 0, env["T"] + 1)
    return _impl("candidate_blocks", scores.device)(scores, visible, topk_blocks, block_size)


def compress_pool(kv, score) -> torch.Tensor:
    """CSA2 compression: ``kv, score [B, G, r, D]`` fp32 -> fp32 ``[B, G, D]``,
    per channel ``sum_r softmax_r(score) * kv``."""
    env: dict = {}
    c.tensor("kv", kv, "B G r D", env, F32)
    c.tensor("score", score, "B G r D", env, F32, kv.device)
    return _impl("compress_pool", kv.device)(kv, score)


def hc_coefficients(x, fn, scale, base, iters: int, eps: float, norm_eps: float):
    """mHC mixing coefficients -> ``(pre [B, S, hc], post [B, S, hc], comb [B, S, hc, hc])`` fp32.

    ``x [B, S, hc, D]`` float, ``fn [(2+hc)*hc, hc*D]`` fp32, ``scale [3]``, ``base [(2+hc)*hc]``.
    With ``v = flatten(x)`` in fp32 and ``m = (v @ fn.T) * rsqrt(mean(v**2) + norm_eps)``:
    ``pre = sigmoid(m[:hc] * scale[0] + base[:hc]) + eps``;
    ``post = 2 * sigmoid(m[hc:2hc] * scale[1] + base[hc:2hc])``;
    ``c = softmax((m[2hc:] * scale[2] + base[2hc:]).view(hc, hc), -1) + eps``,
    ``c = c / (c.sum(-2) + eps)``, then ``iters - 1`` times row- then column-normalised
    (``c / (c.sum(-1) + eps)``, ``c / (c.sum(-2) + eps)``); ``comb = c``.
    """
    env: dict = {}
    c.tensor("x", x, "B S hc D", env, c.FLOATS)
    hc, d = env["hc"], env["D"]
    env.update({"M": (2 + hc) * hc, "hcD": hc * d})
    c.tensor("fn", fn, "M hcD", env, F32, x.device)
    c.tensor("scale", scale, "3", env, F32, x.device)
    c.tensor("base", base, "M", env, F32, x.device)
    c.integer("iters", iters, 1)
    c.number("eps", eps, 0.0)
    c.number("norm_eps", norm_eps, 0.0)
    return _impl("hc_coefficients", x.device)(x, fn, scale, base, iters, eps, norm_eps)


def hc_collapse(x, pre) -> torch.Tensor:
    """``x [B, S, hc, D]``, ``pre [B, S, hc]`` fp32 -> ``[B, S, D]``: ``sum_k pre[k] * x[k]`` in
    fp32, cast to ``x.dtype``."""
    env: dict = {}
    c.tensor("x", x, "B S hc D", env, c.FLOATS)
    c.tensor("pre", pre, "B S hc", env, F32, x.device)
    return _impl("hc_collapse", x.device)(x, pre)


def hc_expand(y, residual, post, comb) -> torch.Tensor:
    """``y [B, S, D]``, ``residual [B, S, hc, D]``, ``post [B, S, hc]``, ``comb [B, S, hc, hc]``
    fp32 -> ``[B, S, hc, D]``: ``out[k] = post[k] * y + sum_j comb[j, k] * residual[j]`` in fp32,
    cast to ``y.dtype``."""
    env: dict = {}
    c.tensor("y", y, "B S D", env, c.FLOATS)
    c.tensor("residual", residual, "B S hc D", env, c.FLOATS, y.device)
    c.tensor("post", post, "B S hc", env, F32, y.device)
    c.tensor("comb", comb, "B S hc hc", env, F32, y.device)
    return _impl("hc_expand", y.device)(y, residual, post, comb)


def engram_lookup(table: QTensor, ids) -> torch.Tensor:
    """``table`` ``QTensor`` ``fp8 [rows, Dh]``, ``ids [B, S, C]`` int64 in ``[0, rows)`` ->
    bf16 ``[B, S, C, Dh]`` (the dequantized rows)."""
    env: dict = {}
    if not isinstance(table, QTensor):
        raise ValueError(f"table: expected a QTensor in 'fp8', got {type(table).__name__}")
    c.maybe_quantized("table", table, "rows Dh", env, ("fp8",))
    c.tensor("ids", ids, "B S C", env, (torch.int64,), table.device)
    c.index_range("ids", ids, 0, env["rows"])
    return _impl("engram_lookup", ids.device)(table, ids)


def engram_gate(h, key, value, weight, eps: float) -> torch.Tensor:
    """``h, key [B, S, hc, D]``, ``value [B, S, D]``, ``weight [hc, D]`` -> ``[B, S, hc, D]``.

    Per stream ``k``: ``r = rsqrt(mean(h_k**2) + eps) * rsqrt(mean(key_k**2) + eps)``,
    ``d = sum(h_k * weight_k * key_k) * r / sqrt(D)``,
    ``g = sigmoid(copysign(sqrt(max(|d|, 1e-6)), d))``, ``out_k = h_k + g * value``.
    Computed in fp32, cast to ``h.dtype``.
    """
    env: dict = {}
    c.tensor("h", h, "B S hc D", env, c.FLOATS)
    c.tensor("key", key, "B S hc D", env, c.FLOATS, h.device)
    c.tensor("value", value, "B S D", env, c.FLOATS, h.device)
    c.tensor("weight", weight, "hc D", env, c.FLOATS, h.device)
    c.number("eps", eps, 0.0)
    return _impl("engram_gate", h.device)(h, key, value, weight, eps)


def engram_hash(seq, multipliers, primes, offsets, pad: int) -> torch.Tensor:
    """Engram n-gram bucket ids: ``seq [B, N-1+S]`` int64 (compressed token ids, -1 for none;
    the ``N-1`` tokens before the chunk first), ``multipliers [L, N]``, ``primes`` and
    ``offsets [L, C]`` int64 (``C = (N-1) * H``, n-gram-size-major, head-minor), ``pad >= 0``
    -> int64 ``[B, S, L, C]``.

    At chunk position ``s`` and shift ``j`` (the token ``j`` back) the value is ``pad`` once that
    token or a newer one is -1, else the token; ``h_n = xor_{j<n} value_j * multipliers[l, j]``
    (int64, wrapping); column ``(n-2) * H + k`` holds ``remainder(h_n, prime) + offset``.
    """
    env: dict = {}
    c.tensor("seq", seq, "B T", env, (torch.int64,))
    c.tensor("multipliers", multipliers, "L N", env, (torch.int64,), seq.device)
    c.tensor("primes", primes, "L C", env, (torch.int64,), seq.device)
    c.tensor("offsets", offsets, "L C", env, (torch.int64,), seq.device)
    N, C = env["N"], env["C"]
    if N < 2:
        raise ValueError(f"multipliers: expected [L, N] with N >= 2 (n-gram sizes 2..N), got N={N}")
    if C % (N - 1):
        raise ValueError(f"primes: expected [L, C] with C a multiple of N - 1 = {N - 1}, got C={C}")
    if env["T"] < N - 1:
        raise ValueError(f"seq: expected [B, T] with T >= N - 1 = {N - 1} (the history), got T={env['T']}")
    c.integer("pad", pad, 0)
    c.index_range("seq", seq, -1, 2 ** 63 - 1)
    return _impl("engram_hash", seq.device)(seq, multipliers, primes, offsets, int(pad))


def moe_route(x, weight, bias, topk: int, score_func: str, norm_topk: bool, route_scale: float):
    """Expert choice: ``x [N, D]``, ``weight [E, D]``, ``bias [E]`` fp32 or None ->
    ``(weights fp32 [N, topk], indices int32 [N, topk])``.

    ``s = f(x @ weight.T)`` in fp32, ``f`` softmax / sigmoid / sqrtsoftplus (``sqrt(softplus)``);
    ``indices = topk(s + bias)`` (the bias picks, it does not scale; ties to the lower expert);
    ``weights = s[indices]``, divided by their sum (+1e-20) when ``norm_topk`` and ``topk > 1``,
    times ``route_scale``.
    """
    env: dict = {}
    c.tensor("x", x, "N D", env, c.FLOATS)
    c.tensor("weight", weight, "E D", env, c.FLOATS, x.device)
    if bias is not None:
        c.tensor("bias", bias, "E", env, F32, x.device)
    c.integer("topk", topk, 1, env["E"])
    c.choice("score_func", score_func, SCORE_FUNCS)
    c.number("route_scale", route_scale)
    return _impl("moe_route", x.device)(x, weight, bias, topk, score_func, bool(norm_topk), float(route_scale))


def moe_experts(x, weights, indices, w1, w3, w2, swiglu_limit: float) -> torch.Tensor:
    """Routed SwiGLU experts: ``x [N, D]``, ``weights [N, k]`` fp32, ``indices [N, k]`` int32 in
    ``[0, E)``, ``w1, w3 [E, I, D]``, ``w2 [E, D, I]`` plain or ``QTensor`` (``fp4_w``/``fp8_w``)
    -> fp32 ``[N, D]``.

    ``out = sum_e W2_e(weights_e * silu(min(W1_e x, L)) * clamp(W3_e x, -L, L))`` with
    ``L = swiglu_limit`` (no clamp when 0). Each projection is an :func:`linear` (so quantized
    weights see fp8-quantized inputs); the routing weight multiplies W2's input before it is
    quantized, as the published model does.
    """
    env: dict = {}
    c.tensor("x", x, "N D", env, c.FLOATS)
    c.tensor("weights", weights, "N k", env, F32, x.device)
    c.tensor("indices", indices, "N k", env, I32, x.device)
    for name, w, spec in (("w1", w1, "E I D"), ("w3", w3, "E I D"), ("w2", w2, "E D I")):
        c.maybe_quantized(name, w, spec, env, WEIGHT_FORMATS, x.device)
        if isinstance(w, QTensor) and w.shape[-1] % 32:  # its input is fp8-quantized, as in linear
            raise ValueError(f"{name}: a quantized weight needs its input dim % 32 == 0 (fp8 activations), "
                             f"got shape {tuple(w.shape)}")
    c.number("swiglu_limit", swiglu_limit, 0.0)
    c.index_range("indices", indices, 0, env["E"])
    return _impl("moe_experts", x.device)(x, weights, indices, w1, w3, w2, float(swiglu_limit))


def sample(logits, temperature, generator=None) -> torch.Tensor:
    """``logits [B, V]`` float, ``temperature`` float >= 0 or fp32 ``[B]`` -> int64 ``[B]``.

    Greedy (argmax, ties to the lower id) where ``temperature == 0``, else Gumbel-max over
    ``softmax(logits / temperature)``: ``argmax(p / E)`` with ``E ~ Exp(1)`` drawn from
    ``generator``.
    """
    env: dict = {}
    c.tensor("logits", logits, "B V", env, c.FLOATS)
    if isinstance(temperature, torch.Tensor):
        c.tensor("temperature", temperature, "B", env, F32, logits.device)
        if c.values_checked() and bool((temperature < 0).any()):
            raise ValueError("temperature: expected values >= 0, got a negative temperature")
    else:
        c.number("temperature", temperature, 0.0)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator: expected a torch.Generator or None, got {type(generator).__name__}")
    return _impl("sample", logits.device)(logits, temperature, generator)


def gather_cold_rows(host: QTensor, host_ids, picks, index, offset: int):
    """HKCP cold fetch: the picked KV entries that live on host pages, staged on the compute device.

    ``host`` ``QTensor`` ``[pages, P, D]`` in a KV format (the host pages), ``host_ids`` int64
    ``[B, W]`` in ``[-1, pages)`` (host page of each logical page of each row, ``-1`` where the
    page is not on the host), ``picks`` int32 or int64 ``[B, N]`` logical entries in
    ``[-1, W * P)`` (``-1`` empty), ``index`` int32 ``[B, N]``, ``offset`` int >= 0 ->
    ``(staging, index)``: ``QTensor`` ``[1, B * N, D]`` in ``host``'s format and int32 ``[B, N]``.

    Pick ``i = b * N + j`` with entry ``e = picks[b, j]`` is cold when ``e >= 0`` and
    ``hp = host_ids[b, e // P] >= 0``: staging row ``i`` holds the stored bytes of host entry
    ``host[hp, e % P]`` (data and scale, exactly) and the output index is ``offset + i``. Every
    other pick keeps ``index[b, j]`` and its staging row is zero bytes.

    The compute device is that of ``picks`` (``host_ids`` and ``index`` live there too); the
    outputs live there. ``host`` lives on the CPU, page-locked (pinned) when the compute device is
    an accelerator, or on the compute device. A backend that reads pinned host memory in place,
    with no host synchronisation, declares the op zero-copy (``flashrt.dispatch.zero_copy``): a
    CUDA-graph step may then contain the call.
    """
    env: dict = {}
    if not isinstance(host, QTensor):
        raise ValueError(f"host: expected a QTensor in {list(KV_FORMATS)}, got {type(host).__name__}")
    c.maybe_quantized("host", host, "pages P D", env, KV_FORMATS)
    c.tensor("picks", picks, "B N", env, (torch.int32, torch.int64))
    device = picks.device
    c.tensor("host_ids", host_ids, "B W", env, (torch.int64,), device)
    c.tensor("index", index, "B N", env, I32, device)
    c.integer("offset", offset, 0)
    c.host_memory("host", host, device)
    c.index_range("host_ids", host_ids, -1, env["pages"])
    c.index_range("picks", picks, -1, env["W"] * env["P"])
    return _impl("gather_cold_rows", device)(host, host_ids, picks, index, offset)


def store_rows(dst: QTensor, batch, slot, src: QTensor) -> QTensor:
    """Store KV rows at (row, slot) pairs, in place (a window ring's new tokens), with no host sync.

    ``dst`` ``QTensor`` ``[Bd, S, D]`` in a KV format, ``batch`` int64 ``[n]`` in ``[0, Bd)``,
    ``slot`` int64 ``[n]`` in ``[0, S)``, ``src`` ``QTensor`` ``[n, D]`` in ``dst``'s format ->
    ``dst``: ``dst[batch[i], slot[i]]`` takes the stored bytes of ``src[i]`` (data and scale,
    exactly). Two pairs must not name the same row.
    """
    env: dict = {}
    for name, q in (("dst", dst), ("src", src)):
        if not isinstance(q, QTensor):
            raise ValueError(f"{name}: expected a QTensor in {list(KV_FORMATS)}, got {type(q).__name__}")
    c.maybe_quantized("dst", dst, "Bd S D", env, KV_FORMATS)
    c.tensor("batch", batch, "n", env, (torch.int64,), dst.device)
    c.tensor("slot", slot, "n", env, (torch.int64,), dst.device)
    c.maybe_quantized("src", src, "n D", env, (dst.fmt,), dst.device)
    c.index_range("batch", batch, 0, env["Bd"])
    c.index_range("slot", slot, 0, env["S"])
    return _impl("store_rows", dst.device)(dst, batch, slot, src)


def resolve_paged(table, picks, page_entries: int, offset: int = 0) -> torch.Tensor:
    """Pool rows of logical KV entries through a block table (the page lookup before a paged
    attention read), with no host sync.

    ``table`` int32 or int64 ``[B, W]`` (the pool page of each logical page of each row, ``< 0``
    where none), ``picks`` int32 or int64 ``[B, N]`` logical entries in ``[-1, W * P)`` (``-1``
    empty), ``page_entries`` P >= 1, ``offset`` >= 0 (where the pool's rows start among the
    attention's KV rows) -> int32 ``[B, N]``: for ``e = picks[b, j]`` and ``page = table[b,
    min(max(e, 0) // P, W - 1)]``, ``offset + page * P + e % P`` where ``e >= 0`` and
    ``page >= 0``, else ``-1``. Rows must fit in int32 (``offset + page * P + P <= 2**31``).
    """
    env: dict = {}
    c.tensor("picks", picks, "B N", env, (torch.int32, torch.int64))
    c.tensor("table", table, "B W", env, (torch.int32, torch.int64), picks.device)
    c.integer("page_entries", page_entries, 1)
    c.integer("offset", offset, 0, 2 ** 31 - 1)
    c.index_range("picks", picks, -1, env["W"] * page_entries)
    c.index_range("table", table, -(2 ** 31), (2 ** 31 - offset) // page_entries)
    return _impl("resolve_paged", picks.device)(table, picks, page_entries, offset)


def store_paged(pool: QTensor, table, entry, mask, values: QTensor, page_entries: int, trash_row: int) -> QTensor:
    """Store KV rows into a paged pool, in place: the block-table lookup and the scatter of a
    decode step's new entries, with no host sync (a CUDA-graph step may hold the call).

    ``pool`` ``QTensor`` ``[1, R, D]`` in a KV format (pages of ``page_entries`` rows, one after
    another), ``table`` int32 or int64 ``[B, W]`` (the pool page of each logical page of each row,
    ``< 0`` where none), ``entry`` int32 or int64 ``[B, n]`` logical entries in ``[-1, W * P)``,
    ``mask`` bool ``[B, n]``, ``values`` ``QTensor`` ``[B, n, D]`` in ``pool``'s format,
    ``page_entries`` P >= 1 with ``R % P == 0``, ``trash_row`` in ``[0, R)`` -> ``pool``.

    Pair ``(b, j)`` with ``e = max(entry[b, j], 0)`` and ``page = table[b, min(e // P, W - 1)]``
    is stored when ``mask[b, j]`` and ``page >= 0``: pool row ``page * P + e % P`` takes the stored
    bytes of ``values[b, j]`` (data and scale, exactly). Every other pair is written to
    ``trash_row``, whose content afterwards is one of theirs (which one is unspecified). Two
    stored pairs must not share a pool row.
    """
    env: dict = {}
    for name, q in (("pool", pool), ("values", values)):
        if not isinstance(q, QTensor):
            raise ValueError(f"{name}: expected a QTensor in {list(KV_FORMATS)}, got {type(q).__name__}")
    c.maybe_quantized("pool", pool, "one R D", env, KV_FORMATS)
    device = pool.device
    if env["one"] != 1:
        raise ValueError(f"pool: expected shape [1, R, D], got {list(pool.shape)}")
    c.tensor("table", table, "B W", env, (torch.int32, torch.int64), device)
    c.tensor("entry", entry, "B n", env, (torch.int32, torch.int64), device)
    c.tensor("mask", mask, "B n", env, (torch.bool,), device)
    c.maybe_quantized("values", values, "B n D", env, (pool.fmt,), device)
    c.integer("page_entries", page_entries, 1)
    if env["R"] % page_entries:
        raise ValueError(f"page_entries: expected a divisor of the pool's {env['R']} rows, got {page_entries}")
    c.integer("trash_row", trash_row, 0, env["R"] - 1)
    c.index_range("entry", entry, -1, env["W"] * page_entries)
    c.index_range("table", table, -(2 ** 31), env["R"] // page_entries)
    return _impl("store_paged", device)(pool, table, entry, mask, values, page_entries, trash_row)


def dense_attention(q, k, v, scale: float) -> torch.Tensor:
    """Bidirectional attention (every query sees every key; e.g. the ViT over an image's patches):
    ``q [B, S, H, D]``, ``k, v [B, T, H, D]`` (``T >= 1``), all one float dtype, ``scale`` float
    -> ``[B, S, H, D]`` ``q.dtype``.

    ``out[b, s, h] = sum_t softmax_t(scale * <q[b, s, h], k[b, t, h]>) v[b, t, h]``. Math in fp32.
    """
    env: dict = {}
    c.tensor("q", q, "B S H D", env, c.FLOATS)
    c.tensor("k", k, "B T H D", env, c.FLOATS, q.device)
    c.tensor("v", v, "B T H D", env, c.FLOATS, q.device)
    c.same_dtype("k", k, q.dtype)
    c.same_dtype("v", v, q.dtype)
    if env["T"] < 1:
        raise ValueError(f"k: expected at least one key (T >= 1), got shape {tuple(k.shape)}")
    c.number("scale", scale)
    return _impl("dense_attention", q.device)(q, k, v, float(scale))


OPS = (
    "rms_norm", "rope", "quantize", "dequantize", "linear", "sparse_attention", "index_scores",
    "topk_positions", "candidate_blocks", "compress_pool", "hc_coefficients", "hc_collapse",
    "hc_expand", "engram_lookup", "engram_gate", "engram_hash", "moe_route", "moe_experts", "sample", "gather_cold_rows",
    "dense_attention", "store_paged", "resolve_paged", "store_rows",
)
