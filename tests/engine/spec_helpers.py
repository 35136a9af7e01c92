"""Shared helpers of the speculative-decoding tests.

:class:`OracleDraft` replaces ``Drafts.draft`` so that acceptance is neither ~0 (random draft
weights) nor total: it proposes the target's known greedy continuation, each position corrupted
with probability ``corrupt`` (a random other id), so batches see ragged acceptance. Logits and
confidence stay the real draft's.
"""
import torch


def batch_order(prompts) -> list[int]:
    """Prompt index of each batch row of ``generate`` (no prefix cache): by length, then index."""
    return sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))


class OracleDraft:
    def __init__(self, model, prompts, reference, rng, corrupt: float):
        self.model, self.real = model, model.drafts.draft
        self.prompts, self.reference, self.rng, self.corrupt = prompts, reference, rng, corrupt
        self.order = batch_order(prompts)

    def __call__(self, next_ids, state, temperature=0.0, generator=None):
        out, logits, confidence = self.real(next_ids, state, temperature, generator)
        out = out.clone()
        V, K = self.model.cfg.vocab_size, out.shape[1] - 1
        for row, pos in enumerate(state.host_positions):
            i = self.order[row]
            ref = self.reference[i]
            t = pos - len(self.prompts[i])  # next_ids is the row's t-th new token
            for j in range(1, K + 1):
                want = ref[t + j] if t + j < len(ref) else int(torch.randint(0, V, (1,), generator=self.rng))
                if float(torch.rand(1, generator=self.rng)) < self.corrupt:
                    want = (want + 1 + int(torch.randint(0, V - 1, (1,), generator=self.rng))) % V
                out[row, j] = want
        return out, logits, confidence


def shortfalls(model, tokens: list[int], ids) -> list[float]:
    """How far below the target's largest logit after ``tokens`` (a fresh prefill) each of ``ids`` is."""
    logits = model.forward(torch.tensor([tokens]))[0]
    return [float(logits.max() - logits[i]) for i in ids]


def assert_same_greedy(model, prompts, want, got, tie: float = 0.05):
    """``got`` == ``want`` token for token, except that a row may part from ``want`` where the
    tokens both runs chose are within ``tie`` of the target's largest logit (a near-tie): a verify chunk
    and a one-token step (or another batch mix) round differently, and the KV quantization can turn
    such a rounding difference into a visible one. The rest of that row is then not compared."""
    assert len(want) == len(got)
    for i, (w, g) in enumerate(zip(want, got)):
        assert len(w) == len(g), f"prompt {i}: {len(g)} tokens, expected {len(w)}"
        j = next((j for j, (a, b) in enumerate(zip(w, g)) if a != b), None)
        if j is not None:
            short = shortfalls(model, prompts[i] + w[:j], (w[j], g[j]))
            assert max(short) < tie, \
                f"prompt {i}: token {j} is {g[j]}, expected {w[j]} (below the target's best by {short}: no tie)"
