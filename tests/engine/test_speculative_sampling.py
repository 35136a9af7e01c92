"""Lossless speculative sampling: emitted tokens are distributed as the target's, not the draft's.

Seeded (deterministic) but not trivially true: the draft's distribution is far from the target's
(total variation > 0.3), so keeping drafted tokens without the rejection rule fails the same bound.
- The rule alone (engine/accept.py), 200k rows, vocabulary 6, k = 3: a target and a draft whose
  per-position distributions do not depend on the prefix, so the first two tokens a row emits
  (the second drawn from the next position's target when the round emitted one) must follow
  ``p_0 x p_1``.
- End to end on the tiny model with a 12-token vocabulary: 1500 copies of one prefilled sequence
  draft and verify one round; the first emitted token must follow the target's distribution.
"""
import dataclasses

import torch

from flashrt import ops
from flashrt.engine import accept
from flashrt.engine import speculative as spec

TEMPERATURE = 0.8


def tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def test_rejection_rule_joint_distribution():
    g = torch.Generator().manual_seed(1234)
    N, V, k = 200_000, 6, 3
    target_logits = torch.randn(k + 1, V, generator=g) * 1.5
    draft_logits = torch.randn(k, V, generator=g) * 1.5
    p = torch.softmax(target_logits / TEMPERATURE, -1)
    q = torch.softmax(draft_logits / TEMPERATURE, -1)
    assert 0.5 * float((p[:k] - q).abs().sum(-1).min()) > 0.1
    drafts = torch.multinomial(q, N, replacement=True, generator=g).T  # [N, k]
    target = target_logits.expand(N, k + 1, V)
    accepted, after = accept.rejection(drafts, draft_logits.expand(N, k, V), target, TEMPERATURE, g)
    first = torch.where(accepted > 0, drafts[:, 0], after)
    fresh = ops.sample(target_logits[1].expand(N, V), TEMPERATURE, g)  # the next round's token
    second = torch.where(accepted > 1, drafts[:, 1], torch.where(accepted == 1, after, fresh))
    joint = torch.bincount(first * V + second, minlength=V * V).to(torch.float64)
    want = (p[0].unsqueeze(1) * p[1].unsqueeze(0)).reshape(-1).to(torch.float64)
    assert tv(joint, want) < 0.01
    assert 0 < float(accepted.float().mean()) < k  # some rejections, some acceptances
    naive = torch.bincount(drafts[:, 0] * V + drafts[:, 1], minlength=V * V).to(torch.float64)
    assert tv(naive, want) > 0.1  # the bound would catch a rule that kept the drafts


def test_greedy_rule_is_prefix_of_argmax():
    g = torch.Generator().manual_seed(5)
    target = torch.randn(4, 4, 9, generator=g)
    best = target.argmax(-1)
    drafts = best[:, :3].clone()
    drafts[0, 0] = (drafts[0, 0] + 1) % 9  # row 0 rejects at once, row 1 at its third draft
    drafts[1, 2] = (drafts[1, 2] + 1) % 9
    accepted, after = accept.greedy(drafts, target)
    assert accepted.tolist() == [0, 2, 3, 3]
    assert after.tolist() == [best[0, 0], best[1, 2], best[2, 3], best[3, 3]]


def test_model_first_token_follows_target(cfg):
    from flashrt.graphs.init_weights import init_weights
    from flashrt.graphs.model import Model

    small = dataclasses.replace(cfg, vocab_size=12, engram_compressed_vocab_size=12)
    model = Model(small, init_weights(small, seed=0))
    g = torch.Generator().manual_seed(77)
    N, V = 1500, 12
    state = model.new_state(N, 16)
    model.forward(torch.tensor([[4, 9]]).expand(N, 2), state=state)
    next_ids = torch.full((N,), 5)
    dec = spec.Decoder(model, state, TEMPERATURE, g, draft_tokens=2)
    real, seen = model.drafts.draft, {}

    def draft(*args):
        out = real(*args)
        seen["q"] = torch.softmax(out[1][0, 0] / TEMPERATURE, -1)
        return out
    model.drafts.draft = draft
    emitted, _ = dec.step(next_ids, 3)
    probe = model.new_state(1, 16)
    model.forward(torch.tensor([[4, 9]]), state=probe)
    p = torch.softmax(model.forward(torch.tensor([[5]]), state=probe)[0] / TEMPERATURE, -1)
    first = torch.tensor([row[0] for row in emitted])
    counts = torch.bincount(first, minlength=V).to(torch.float64)
    assert 0.5 * float((p - seen["q"]).abs().sum()) > 0.3  # the draft alone would fail the bound
    assert tv(counts, p.to(torch.float64)) < 0.08
    assert dec.stats.accepted > 0 and dec.stats.accepted < dec.stats.drafted
