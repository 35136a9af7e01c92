"""Helpers of the static-step tests: a CPU stand-in for the CUDA graph recorder, cache comparison."""
import torch


class FakeRecorder:
    """``record(body) -> (replay, outputs)`` on the CPU: replay re-runs ``body`` into ``outputs``."""

    def __init__(self):
        self.recorded = self.commits = 0

    def __call__(self, body):
        out = body()
        if out is None:  # a commit (VerifyCapture.keep): replay re-runs it, writing the same values
            self.commits += 1
            return body, None
        self.recorded += 1

        def replay():
            logits, staged = body()
            out[0].copy_(logits)
            for (_, s0, kv0), (_, s1, kv1) in zip(out[1].rings, staged.rings, strict=True):
                for a, b in zip((*s0, kv0.data, kv0.scale), (*s1, kv1.data, kv1.scale)):
                    a.copy_(b)
            for p0, p1 in zip(out[1].partials, staged.partials, strict=True):
                for a, b in zip(p0[1:], p1[1:]):
                    a.copy_(b)
        return replay, out


def same_caches(model, a, b):
    assert a.host_positions == b.host_positions
    assert torch.equal(a.positions, b.positions)
    for l in a.rings:
        assert torch.equal(a.rings[l].data.view(torch.uint8), b.rings[l].data.view(torch.uint8)), l
    for l in model.cfg.kv_source_layers:
        ca, cb = a.compressed[l], b.compressed[l]
        if ca.kv_state is not None:
            assert torch.equal(ca.kv_state, cb.kv_state) and torch.equal(ca.score_state, cb.score_state)
        for row, pos in enumerate(a.host_positions):
            n = pos // model.cfg.ratio(l)
            ka, kb = ca.index_k.read_row(row, 0, n), cb.index_k.read_row(row, 0, n)
            assert torch.equal(ka.data.view(torch.uint8), kb.data.view(torch.uint8))
            assert torch.equal(ca.main.read_row(row, n).data, cb.main.read_row(row, n).data)
