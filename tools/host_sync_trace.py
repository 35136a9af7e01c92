"""Where the DSpark draft waits for the device: runs ``Drafts.draft`` of a shipped model after a
prompt under ``checks.host_syncs_raise`` (a synchronizing CUDA call raises) and prints the
traceback of the first synchronizing call, or "no host sync". A call that syncs cannot be captured
in a CUDA graph and runs eagerly (engine/draft_capture.py). Needs a CUDA device.

    python tools/host_sync_trace.py --model tiny --batch 2
    python tools/host_sync_trace.py --model tiny --batch 2 --prompt 9 --page-entries 4 --rounds 1
"""
from __future__ import annotations

import argparse
import traceback

import torch

import flashrt
from flashrt import checks
from flashrt.engine import spec_costs
from flashrt.engine import speculative as spec
from flashrt.graphs.config import shipped_config
from flashrt.graphs.init_weights import init_weights
from flashrt.graphs.model import Model
from flashrt.kv.state import KVState


def trace(name: str, body) -> bool:
    """Run ``body`` once eagerly (compiles, allocations), then again with host syncs raising."""
    body()
    torch.cuda.synchronize()
    try:
        with checks.host_syncs_raise():
            body()
    except RuntimeError as exc:
        if not checks.is_host_sync_error(exc):
            raise
        print(f"== {name}: host sync\n{''.join(traceback.format_exc(limit=-12))}", flush=True)
        return False
    print(f"== {name}: no host sync", flush=True)
    return True


def prefilled(model, args):
    """(state after a random prompt, the greedy next token), pages of ``--page-entries`` if given."""
    if args.page_entries is None:
        return spec_costs.prefilled(model, args.batch, args.prompt, 64)
    pool = KVState.pool_for(model.cfg, args.batch, args.prompt + 64, model.device, None, args.page_entries)
    state = model.new_state(args.batch, args.prompt + 64, pool=pool)
    ids = torch.randint(0, model.cfg.vocab_size, (args.batch, args.prompt), device=model.device)
    return state, model.forward(ids, state=state).argmax(-1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--page-entries", type=int, default=None, help="main-KV page size (default: the state's)")
    ap.add_argument("--rounds", type=int, default=0, help="eager speculative rounds run before the trace")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("host_sync_trace: needs a CUDA device")
    cfg = shipped_config(args.model)
    model = Model(cfg, init_weights(cfg, seed=0, device="cuda"))
    with flashrt.value_checks(False):
        state, tok = prefilled(model, args)
        dec = spec.Decoder(model, state, draft_tokens="auto")
        for _ in range(args.rounds):
            _, tok = dec.step(tok, 64)
        ok = True
        if model.drafts is not None:
            ok &= trace("draft", lambda: model.drafts.draft(tok, state))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
