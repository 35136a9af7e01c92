"""Host syncs of a prefill forward (tools/host_syncs.py): on a GPU each waits for the device's whole
queue, so a prefill chunk makes none but its value checks (token-id range, staged compressor
inputs), which ``flashrt.value_checks(False)`` turns off."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from test_arch_compile import ROOT, needs_ptxas  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from host_syncs import HostSyncs  # noqa: E402


def test_counter_finds_each_kind_of_sync_and_nothing_else():
    t = torch.randint(0, 5, (6,))
    with HostSyncs() as syncs:
        (t * 2 + 1).sort()                                    # no sync
        torch.repeat_interleave(t, 2)                         # int repeats: no sync
        torch.repeat_interleave(t, t, output_size=int(t.sum()))  # the int() is one
        t.sum().item()
        bool(t[0] > 1)
        t.nonzero()
        t[t > 2]
        t.tolist()
        torch.repeat_interleave(t, t)
        torch.tensor([1, 2], device=t.device)
        rows = torch.randperm(6)[:3]
        t[rows] = 0                                           # a number put by a tensor index: one
        t[rows] = t.flip(0)[rows]                             # a tensor put: no sync
        t.index_fill_(0, rows, 1)                             # no sync
        t[1] = 3                                              # a basic index: a fill, no sync
    ops = sorted(site.rsplit(" ", 1)[-1] for site in syncs.sites.elements())
    assert syncs.total == 9, syncs.sites
    assert ops == sorted(["_local_scalar_dense"] * 3 + ["nonzero", "index", "tolist", "repeat_interleave",
                                                        "device)", "number"]), ops


SCRIPT = textwrap.dedent('''
    import json, os, sys
    sys.path.insert(0, os.path.join(sys.argv[1], "tools"))
    import host_cost as hc
    import torch
    import flashrt
    from flashrt import profiles
    from flashrt.graphs.config import shipped_config
    from flashrt.graphs.init_weights import init_weights
    from flashrt.graphs.model import Model
    from flashrt.jit_targets import ARCHS
    from host_syncs import HostSyncs

    out = {"checked": [], "unchecked": []}
    cfg = shipped_config("tiny")
    with profiles.using("h200"), hc.cuda_on_cpu(), hc.empty_as_zeros(), hc.warm_launches(ARCHS["sm_90"]):
        model = Model(cfg, init_weights(cfg, seed=0, device="cpu"))
        for chunks in ((16,), (7, 9), (5, 11, 3)):  # later chunks start mid compression group
            ids = torch.randint(0, cfg.vocab_size, (2, sum(chunks)), generator=torch.Generator().manual_seed(len(chunks)))
            state, start = model.new_state(2, sum(chunks) + 4), 0
            for n in chunks:
                with HostSyncs() as checked:
                    model.forward(ids[:, start:start + n], state=state)
                with flashrt.value_checks(False), HostSyncs() as unchecked:
                    model.forward(ids[:, start:start + n], state=model.new_state(2, n + 4))
                start += n
                out["checked"] += list(checked.sites.elements())
                out["unchecked"] += list(unchecked.sites.elements())
    print(json.dumps(out))
''')


@needs_ptxas
def test_prefill_chunks_sync_only_in_the_id_check(tmp_path):
    """A tiny prefill in one and in several chunks on the CUDA backend's launchers (kernels not
    run, as tools/host_cost.py does): syncs only in value checks, none with them off."""
    script = tmp_path / "syncs.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(script), str(ROOT)], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["unchecked"] == [], out["unchecked"]
    value_checks = ("core/checks.py", "core/kv/staged.py")  # the id range; staged inputs reaching the kept group
    assert len(out["checked"]) >= 6 and all(s.startswith(value_checks) for s in out["checked"]), out["checked"]
