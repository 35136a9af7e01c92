"""HKCP: a row's partly filled last main-KV page must be on the device when a step writes into it.

Prompts of different lengths are prefilled apart (one state per length, one page pool); under a
small device budget the later prefill spills the earlier rows' pages, their partly filled last
page included. Decoding then writes new entries into that page: it must come back to the device
first (and stay there while other rows allocate), or the entries land in a page the row does not
own. Every decode step's logits must equal those of a run with all pages on the device.
"""
import torch

from flashrt.engine import generate
from flashrt.kv.sizes import entry_bytes, fixed_bytes_for


def test_ragged_rows_under_a_small_budget_decode_exactly(model, rng):
    cfg = model.cfg
    lengths = sorted(int(n) for n in torch.randint(140, 200, (2,), generator=rng))
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=rng).tolist() for n in lengths]
    cap = lengths[-1] + 8
    main = sum(-(-cap // cfg.ratio(l)) for l in cfg.kv_source_layers) * entry_bytes(cfg.head_dim, "fp4_b16") * 2
    # 16 device pages of 8 entries: room for one step's new entries at any drawn length, and under
    # half of what the rows hold (so pages spill)
    pages16 = 16 * 8 * entry_bytes(cfg.head_dim, "fp4_b16")
    assert pages16 < main // 2
    budget = fixed_bytes_for(cfg, 2, cap, page_entries=8) + pages16
    cold = generate(model, prompts, 1, prefill_chunk=32, kv_page_entries=8, kv_budget=budget)
    full = generate(model, prompts, 1, prefill_chunk=32, kv_page_entries=8)
    assert cold.state.tier_stats()["cold_pages"] > 0
    assert torch.equal(cold.first_logits, full.first_logits)
    tok = full.first_logits.argmax(-1, keepdim=True)  # rows in prompt order (lengths ascending)
    for step in range(8):
        a = model.forward(tok, state=cold.state)
        b = model.forward(tok, state=full.state)
        assert torch.equal(a, b), f"decode step {step}: logits differ with host-tier pages"
        tok = b.argmax(-1, keepdim=True)
