"""Which CUDA kernel makes a model's logits differ from the reference? One op at a time on the
kernels, every other op on the reference, same weights and tokens.

    python tools/op_bisect.py --model tiny
"""
from __future__ import annotations

import argparse

import torch

import flashrt
from flashrt import dispatch
from flashrt.backends import cuda as cuda_backend
from flashrt.families import family_tables
from flashrt.graphs.config import shipped_config
from flashrt.graphs.init_weights import init_weights
from flashrt.graphs.model import Model
from flashrt.hookspecs import Backend, hookimpl


class One:
    def __init__(self, op, fn, pred):
        self.backend = Backend(name="one", device_types=("cuda",), ops={op: fn},
                               supports={op: pred} if pred else {}, priority=100)

    @hookimpl
    def flashrt_backend(self):
        return self.backend


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tokens", type=int, default=40)
    args = ap.parse_args()
    cfg = shipped_config(args.model)
    model = Model(cfg, init_weights(cfg, seed=0, device="cuda"))
    ids = torch.randint(0, cfg.vocab_size, (2, args.tokens), generator=torch.Generator().manual_seed(0)).cuda()
    with flashrt.use_backend("reference"):
        want = model.forward(ids, all_positions=True)
    tables = family_tables(cuda_backend.kernel_families())
    ops, supports = tables["ops"], tables["supports"]
    dispatch.unregister(dispatch._manager().get_plugin("flashrt.backends.cuda"))
    for op in sorted(ops):
        plugin = One(op, ops[op], supports.get(op))
        dispatch.register(plugin, name=f"one-{op}")
        got = model.forward(ids, all_positions=True)
        dispatch.unregister(plugin)
        print(f"{op:18} rel L2 vs reference {float((got - want).norm() / want.norm()):.2e}", flush=True)


if __name__ == "__main__":
    main()
