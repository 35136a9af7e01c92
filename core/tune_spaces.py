"""What ``flashrt tune`` sweeps: per kernel, a tile space and a case (an op call at model shapes).

Each :class:`Space` names the kernel module (``tiles.<module>`` in a profile), its TILES key, the
rule for rule lists (``[[largest rows, tile], ...]``: ``linear``, ``moe`` experts) and the candidate
values per parameter; the other parameters keep the profile's values. A case returns (op name,
args): decode-sized on the GPU (the V4.1-Flash dims), tiny under the Triton interpreter
(``small``). Where a case may take one of several launches, each reading knobs of its own (``linear``
and ``moe`` experts rules, the attention's plain and warp-specialized kernels), the space sweeps the
knobs of the launch its case takes under the profile (its ``paths``, under their own TILES key where
``path_keys`` names one; the kernel family's ``paths`` name that launch). Spaces are kept to at most 24
candidates so the whole sweep stays a few minutes on an H200 (``flashrt tune --budget`` bounds it in any
case).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import torch

from . import formats, ops
from .dtypes import MAIN_KV_FORMAT


@dataclass(frozen=True)
class Space:
    module: str  # kernels_cuda module: tiles.<module> in the profile
    key: str  # its TILES key
    params: dict  # parameter -> candidate values (the MMA tile's launch, ``tile``)
    case: Callable  # (device, small) -> (op name, args)
    # for rule lists: the index of the [limit, tile] rule swept among the kernels' default rules (a profile's
    # own rule list is searched by the case's rows: tune.rule_index)
    rule: int | None = None
    # launch name (the family's ``paths``: the launch the case takes under the profile) -> the parameters that
    # launch reads, or None where it reads no tile (nothing to sweep); other launches sweep ``params``
    paths: Mapping[str, dict | None] = field(default_factory=dict)
    # launch name -> the TILES key its ``paths`` parameters live in, where not ``key`` (a dict, not a rule list)
    path_keys: Mapping[str, str] = field(default_factory=dict)

    def params_for(self, path: str) -> dict | None:
        """The parameters to sweep where the case takes launch ``path``."""
        return self.paths.get(path, self.params)

    def for_path(self, path: str) -> Space:
        """The space as swept where its case takes launch ``path``: its parameters, under their own TILES key
        where they have one."""
        if path not in self.path_keys:
            return self
        return replace(self, key=self.path_keys[path], rule=None, params=self.paths[path], paths={}, path_keys={})

    @property
    def size(self) -> int:
        """Candidates of the largest parameter set."""
        return max(_size(p) for p in (self.params, *self.paths.values()) if p is not None)


def _size(params: dict) -> int:
    n = 1
    for values in params.values():
        n *= len(values)
    return n


def _attention(batch: int):
    def case(dev, small):
        """Decode: each query attends to a window (fp8) and top-k compressed entries (the main-KV format)."""
        B, W, T, K = (batch, 8, 40, 24) if small else (batch, 128, 65536, 640)
        H, D = (16, 64) if small else (64, 512)
        q = torch.randn(B, 1, H, D, device=dev).to(torch.bfloat16)
        window = ops.quantize(torch.randn(B, W, D, device=dev), "fp8")
        main = ops.quantize(torch.randn(B, T, D, device=dev), MAIN_KV_FORMAT)
        idx = torch.cat([torch.arange(W, device=dev).expand(B, 1, W),
                         W + torch.randint(0, T, (B, 1, K - W), device=dev)], dim=-1).to(torch.int32)
        return "sparse_attention", (q, (window, main), idx, torch.zeros(H, device=dev), D ** -0.5)
    return case


def _linear(rows: int, small_rows: int):
    def case(dev, small):
        """x [rows, K] bf16 @ an fp8_w weight [N, K] (block-scaled FP8 GEMM)."""
        M, N, K = (small_rows, 64, 128) if small else (rows, 4096, 5120)
        x = torch.randn(M, K, device=dev).to(torch.bfloat16)
        return "linear", (x, formats.quantize(torch.randn(N, K, device=dev) * K ** -0.5, "fp8_w"))
    case.rows = {False: rows, True: small_rows}  # rows the tile rules see (M), by ``small``
    case.weights = {False: 4096 * 5120, True: 64 * 128}  # the weight's elements (N x K: a rule's max_weights)
    return case


def _moe(tokens: int, small_tokens: int):
    def case(dev, small):
        """Routed fp4_w experts: ``tokens`` tokens, top-6 of 32 experts (decode: ~12 rows per expert)."""
        n, E, k, D, I = (small_tokens, 4, 2, 64, 64) if small else (tokens, 32, 6, 4096, 2048)
        x = torch.randn(n, D, device=dev).to(torch.bfloat16)
        idx = torch.rand(n, E, device=dev).argsort(dim=1)[:, :k].to(torch.int32)  # k distinct experts per token
        w = [formats.quantize(torch.randn(E, *shape, device=dev) * shape[1] ** -0.5, "fp4_w")
             for shape in ((I, D), (I, D), (D, I))]
        return "moe_experts", (x, torch.rand(n, k, device=dev), idx, *w, 10.0)
    case.rows = {False: tokens * 6 / 32, True: small_tokens * 2 / 4}  # mean rows per expert, by ``small``
    return case


def _indexer(dev, small):
    B, S, T = (1, 2, 256) if small else (8, 1, 131072)
    q = torch.randn(B, S, 32, 128, device=dev).to(torch.bfloat16)
    k = ops.quantize(torch.randn(B, T, 128, device=dev), "fp4_b32")
    return "index_scores", (q, k, torch.rand(B, S, 32, device=dev), torch.full((B, S), T, device=dev, dtype=torch.int32))


def _quant(dev, small):
    return "quantize", (torch.randn(64 if small else 16384, 512, device=dev).to(torch.bfloat16), "fp8")


def _norm(dev, small):
    n, d = (16, 1024) if small else (8192, 5120)
    return "rms_norm", (torch.randn(n, d, device=dev).to(torch.bfloat16), torch.ones(d, device=dev), 1e-6)


def _topk(dev, small):
    return "topk_positions", (torch.randn(2 if small else 64, 1, 512 if small else 131072, device=dev), 64 if small else 512)


# the knobs of the launches a linear rule may send its case to besides its MMA tile (kernels_cuda/linear.py):
# the fp8 warpgroup MMA at decode rows (K split to programs an SM) and at many rows, mma.sync with the weights
# as its M, the GEMV; the bf16 GEMM reads no tile
_LINEAR_DECODE_PATHS = {
    "qgmma": {"qgmma_per_sm": [2, 3, 4], "qgmma_warps": [4, 8], "qgmma_stages": [3, 4]},
    "gemv_mma": {"gemv_mma_per_sm": [2, 4, 8], "gemv_mma_stages": [3, 4], "gemv_mma_kw": [4, 8]},
    "gemv": {"BLOCK_N": [32, 64, 128], "BLOCK_K": [128, 256], "num_warps": [4, 8]},
    "bf16_gemm": None,
}
_LINEAR_LARGE_PATHS = {**_LINEAR_DECODE_PATHS, "qgmma": {"qgmma_tokens": [64, 128], "qgmma_warps": [4, 8],
                                                         "qgmma_stages": [3, 4], "qgmma_inflight": [1, 2]}}
# the routed experts' launches besides the MMA tile (kernels_cuda/moe.py): the fp8 warpgroup MMA with the weights
# in registers (K split), a prefill chunk's streamed launches, mma.sync; the grouped bf16 GEMMs read no rule
_MOE_PATHS = {
    "qgmma": {"qgmma_per_sm": [8, 16, 24], "qgmma_stages": [0, 4], "qgmma_max_k": [512, 1024]},
    "qgmma_stream": {"qgmma_warps": [4, 8], "qgmma_stages": [2, 3, 4], "qgmma_inflight": [1, 2]},
    "gemv_mma": {"gemv_mma_per_sm": [2, 4, 8], "gemv_mma_stages": [3, 4]},
    "grouped": None,
}

# name -> Space; linear / moe rules are those of the kernels' TILES (rows per rule: 16, 64, more)
SPACES = {
    # not swept: H_BLOCK below 64 (no wgmma, heavy spills), K_BLOCK 64 (spills or exceeds shared memory)
    # and the two-pass variant, all slower on the H200 (docs/performance.md, sparse_attention)
    # the decode case of 8 queries: the plain kernel's tiles, or where the profile sends it to the warp-specialized
    # kernel (tiles.attention.ws) its ring and overlap
    "attention": Space("attention", "attention", {"H_BLOCK": [64], "K_BLOCK": [16, 32], "num_warps": [4, 8],
                                                  "num_stages": [2, 3], "D_SPLIT": [1, 2]}, _attention(8),
                       paths={"ws": {"RAW_STAGES": [2, 3], "STAGES": [2, 3], "overlap": [False, True],
                                     "CW": [128, 256]}}, path_keys={"ws": "ws"}),
    "attention_split": Space("attention", "split", {"programs": [0, 264], "min_blocks": [1, 2, 4],
                                                    "max_splits": [16, 32]}, _attention(1)),
    "linear_decode": Space("linear", "linear", {"BLOCK_N": [32, 64, 128], "BLOCK_K": [128, 256],
                                                "num_warps": [4], "num_stages": [3, 4, 5]}, _linear(16, 4), rule=0,
                           paths=_LINEAR_DECODE_PATHS),
    "linear_small": Space("linear", "linear", {"BLOCK_M": [32, 64], "BLOCK_N": [64, 128], "BLOCK_K": [128],
                                               "num_warps": [4, 8], "num_stages": [3, 4]}, _linear(64, 24), rule=1,
                          paths=_LINEAR_DECODE_PATHS),
    "linear_large": Space("linear", "linear", {"BLOCK_M": [64, 128], "BLOCK_N": [128, 256], "BLOCK_K": [64, 128],
                                               "num_warps": [8], "num_stages": [3, 4]}, _linear(4096, 80), rule=2,
                          paths=_LINEAR_LARGE_PATHS),
    "moe_decode": Space("moe", "experts", {"BLOCK_N": [64, 128], "BLOCK_K": [64, 128], "num_warps": [4, 8],
                                           "num_stages": [3, 4]}, _moe(64, 3), rule=0, paths=_MOE_PATHS),
    "moe_prefill": Space("moe", "experts", {"BLOCK_M": [32, 64], "BLOCK_N": [64, 128], "BLOCK_K": [64, 128],
                                            "num_warps": [4, 8], "num_stages": [3]}, _moe(4096, 40), rule=1,
                         paths=_MOE_PATHS),
    "indexer": Space("indexer", "index_scores", {"block_t": [64, 128, 256], "num_warps": [4, 8]}, _indexer),
    "quant": Space("quant", "quantize", {"ELEMS": [2048, 4096, 8192], "num_warps": [2, 4, 8]}, _quant),
    "norm_rope": Space("norm_rope", "rms_norm", {"ROW_ELEMS": [2048, 4096], "num_warps": [4, 8, 16]}, _norm),
    "topk": Space("topk", "select", {"num_warps": [4, 8], "summary": [2048, 4096], "radix_bits": [1, 2, 4]}, _topk),
}
