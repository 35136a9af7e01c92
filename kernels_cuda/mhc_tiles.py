"""The tiles of the mHC kernel family (``mhc``: mhc.py, mhc_coefficients.py) and their launch plans."""
from __future__ import annotations

from flashrt.kernels_cuda.launch import PlanCache

TILES = {
    # bf16 x on the GPU (tensor cores); BLOCK_T 128 (8 warps) only from BIG_T tokens on. PROGRAMS:
    # the programs a split launch aims at (an H200's 132 SMs); few tokens take SPLIT_BLOCK_T-token
    # tiles and SPLIT_BLOCK_K-wide K blocks (capped at BLOCK_K) with SPLIT_WARPS warps; the
    # finishing program of a SPLIT_BLOCK_T-token tile sums SUM_SPLITS partials a round (wider tiles
    # proportionally fewer)
    "hc_coefficients": {"BLOCK_K": 128, "FN_PARTS": 3, "PROGRAMS": 132, "BLOCK_T_MAX": 64, "BIG_T": 2048,
                        "SPLIT_BLOCK_T": 16, "SPLIT_BLOCK_K": 32, "SPLIT_WARPS": 4, "SUM_SPLITS": 32},
    "hc_coefficients_fp32": {"BLOCK_K": 64, "BLOCK_T_MAX": 32},  # fp32 FMA dot (ieee): 64 tokens spill
    "hc_finish": {"BLOCK_T": 32, "num_warps": 4, "in_kernel": True},  # in_kernel: the last split program finishes
    "hc_mix": {"BLOCK_D": 1024, "num_warps": 4},
    # in_kernel: collapse + norm in one program per token (else hc_collapse, then rms_norm)
    "hc_collapse_norm": {"MAX_BLOCK_D": 8192, "num_warps": 4, "in_kernel": True},
}


PLANS = PlanCache("mhc", TILES)  # the active tiles (and launch plans made with them)
_tiles = PLANS.tiles
