"""``generate()``'s decode loop runs one step ahead of the host: each step is launched from the
previous step's tokens on the device before the host reads them. The tokens are those of a loop
that reads first (greedy against a manual loop in test_generate.py; seeded draws here against the
same draws made one by one); no step is launched for nothing when the length ends the run; when
every row meets EOS, exactly one step is."""
import torch

from flashrt import ops
from flashrt.engine import generate
from flashrt.engine import sampling as sampling_mod


def _watch(monkeypatch, model) -> dict:
    """Counts forwards, and those launched while a copy of drawn tokens was still unread."""
    seen = {"forwards": 0, "ahead": 0}
    copies = []
    forward, init, lists = model.forward, sampling_mod.HostCopy.__init__, sampling_mod.HostCopy.lists

    def counting_forward(*a, **k):
        seen["forwards"] += 1
        seen["ahead"] += any(not c.read for c in copies)
        return forward(*a, **k)

    def made(self, *a):
        init(self, *a)
        self.read = False
        copies.append(self)

    def read(self):
        self.read = True
        return lists(self)

    monkeypatch.setattr(model, "forward", counting_forward)
    monkeypatch.setattr(sampling_mod.HostCopy, "__init__", made)
    monkeypatch.setattr(sampling_mod.HostCopy, "lists", read)
    return seen


def test_steps_run_ahead_and_the_length_wastes_none(model, cfg, rng, monkeypatch):
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=rng).tolist() for n in (9, 9, 14)]
    n_new = int(torch.randint(3, 9, (), generator=rng))
    seen = _watch(monkeypatch, model)
    res = generate(model, prompts, n_new)
    assert [len(t) for t in res.tokens] == [n_new] * 3
    decode = seen["forwards"] - 2  # two prefill forwards: one per prompt length
    assert decode == n_new - 1 and seen["ahead"] == n_new - 1


def test_seeded_draws_are_those_of_a_step_by_step_loop(model, cfg, rng):
    prompt = torch.randint(0, cfg.vocab_size, (12,), generator=rng).tolist()
    seed, n_new = int(torch.randint(0, 1 << 30, (), generator=rng)), 6
    got = generate(model, [prompt], n_new, temperature=0.9, seed=seed).tokens[0]
    gen = torch.Generator().manual_seed(seed)
    logits, want, pos = model.forward(torch.tensor([prompt])), [], len(prompt)
    for _ in range(n_new):
        tok = ops.sample(logits, 0.9, gen)
        want.append(int(tok))
        logits = model.forward(tok.reshape(1, 1), start_pos=pos)
        pos += 1
    assert got == want


def test_every_row_at_eos_launches_one_step_for_nothing(model, cfg, rng, monkeypatch):
    prompt = torch.randint(0, cfg.vocab_size, (10,), generator=rng).tolist()
    free = generate(model, [prompt], 8).tokens[0]
    k = int(torch.randint(1, 6, (), generator=rng))
    eos = free[k]
    k = free.index(eos)
    seen = _watch(monkeypatch, model)
    cut = generate(model, [prompt], 8, eos_token_id=eos).tokens[0]
    assert cut == free[:k + 1]
    assert seen["forwards"] - 1 == k + 1  # k steps made the tokens after the first, one more ran ahead
