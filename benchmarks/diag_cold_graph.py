import sys, torch
import flashrt.graphs.decode_graph as dg
from flashrt.graphs.config import shipped_config
from flashrt.graphs.init_weights import init_weights
from flashrt.graphs.model import Model
from flashrt.kvcache import KVState, entry_bytes, fixed_bytes_for
from flashrt.kernels_cuda import kv_gather
cfg = shipped_config("tiny"); model = Model(cfg, init_weights(cfg, seed=0, device="cuda"))
print("zero_copy_ok", kv_gather.zero_copy_ok(torch.device("cuda")))
for mode in ("global", "relaxed"):
    dg.CAPTURE_ERROR_MODE = mode
    page = 4 * entry_bytes(cfg.head_dim, "fp4_b16")
    budget = fixed_bytes_for(cfg, 1, 200, 4) + page * 6
    state = model.new_state(1, 200, kv_budget=budget, pool=KVState.pool_for(cfg, 1, 200, "cuda", budget, 4))
    ids = torch.randint(0, cfg.vocab_size, (1, 60), device="cuda")
    for c0 in range(0, 60, 8):
        logits = model.forward(ids[:, c0:c0 + 8], state=state)
    print(mode, "cold", state.tier_stats())
    g = dg.DecodeGraphs(model, state)
    for _ in range(6):
        logits = g.step(logits.argmax(-1))
    print(mode, g.stats, flush=True)
