"""Host work of the serving step loop done in batches, checked against the one-at-a-time way it
replaces: sequences joining the decode batch together land in the rows and bucket that one-by-one
joins give them, with one resize; the scheduler's page growth equals the page counts it replaces;
outputs share no list with the engine or with each other."""
import torch

from flashrt.engine import Engine, SamplingParams
from flashrt.engine.scheduler import pages_at
from flashrt.engine.slots import DecodeSlots


class Seq:
    def __init__(self, name):
        self.name, self.slot = name, None


def _slots(model, pool):
    return DecodeSlots(model, pool, 64, cuda_graph=False)


def _one_row(model, pool, position: int):
    st = model.new_state(1, 64, pool=pool)
    st.begin_step(position)  # pages for the row's positions
    st.advance(position)
    return st


def test_joining_together_equals_joining_one_by_one(model, rng):
    pool = model.new_state(1, 8).pool
    draw = lambda hi: int(torch.randint(0, hi, (1,), generator=rng))
    a, b = _slots(model, pool), _slots(model, pool)
    names = iter(range(10_000))
    live = []
    for _ in range(6):  # random joins and leaves, then a group joins at once
        for _ in range(draw(6)):
            seq_a = Seq(next(names))
            seq_b = Seq(seq_a.name)
            pos = draw(40) + 1
            a.add(seq_a, _one_row(model, pool, pos))
            b.add(seq_b, _one_row(model, pool, pos))
            live.append((seq_a, seq_b))
        for _ in range(draw(len(live) + 1)):
            seq_a, seq_b = live.pop(draw(len(live)))
            a.remove(seq_a)
            b.remove(seq_b)
        group = [(Seq(n), draw(40) + 1) for n in [next(names) for _ in range(draw(20) + 1)]]
        a.make_room(len(group))
        resized = a.state
        for seq, pos in group:
            a.add(seq, _one_row(model, pool, pos))
            twin = Seq(seq.name)
            b.add(twin, _one_row(model, pool, pos))
            live.append((seq, twin))
        assert a.state is resized  # the one resize made room for the whole group
        assert a.rows == b.rows
        assert [o and o.name for o in a.owner] == [o and o.name for o in b.owner]
        assert a.state.host_positions == b.state.host_positions
        assert [a.state.row_pages(r) for r in range(a.rows)] == [b.state.row_pages(r) for r in range(b.rows)]


def test_page_growth_equals_the_page_counts(model, rng):
    sch = Engine(model, prefix_cache_bytes=0).step_loop.scheduler
    for _ in range(500):
        seq = Seq(0)
        seq.computed = int(torch.randint(0, 5000, (1,), generator=rng))
        tokens = int(torch.randint(0, 600, (1,), generator=rng))
        want = pages_at(model.cfg, sch.P, seq.computed + tokens) - pages_at(model.cfg, sch.P, seq.computed)
        assert sch.growth(seq, tokens) == want


def test_outputs_share_no_list_with_the_engine(model, rng):
    prompt = torch.randint(0, 256, (9,), generator=rng).tolist()
    engine = Engine(model, prefix_cache_bytes=0)
    req = engine.step_loop.add("r", prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    seen = []
    req.sink = seen.append
    while engine.step_loop.has_work:
        engine._deliver(engine.step_loop.step())
    first, last = seen[0], seen[-1]
    first.prompt_token_ids.append(-1)  # a client changing what it got changes nothing the engine keeps
    first.outputs[0].token_ids.append(-1)
    first.outputs[0].delta_token_ids.append(-1)
    assert req.prompt == prompt and req.seqs[0].tokens[:9] == prompt
    assert last.outputs[0].token_ids == req.seqs[0].output and -1 not in last.outputs[0].token_ids
    assert [t for o in seen for t in o.outputs[0].delta_token_ids if t != -1] == last.outputs[0].token_ids
