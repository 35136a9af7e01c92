"""``FLASHRT_STEP_TRACE``: the engine's loop writes one line per step, and the lines account for
every request, prompt token and decode row the engine ran."""
import pytest
import torch

from flashrt.engine import Engine, SamplingParams
from flashrt.engine import step_trace


def test_trace_accounts_for_every_step(model, rng, tmp_path, monkeypatch):
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(step_trace.ENV, str(path))
    draw = lambda lo, hi: int(torch.randint(lo, hi, (), generator=rng))  # noqa: E731
    n, max_tokens = draw(3, 6), draw(2, 5)
    prompts = [torch.randint(0, model.cfg.vocab_size, (draw(5, 40),), generator=rng).tolist() for _ in range(n)]
    engine = Engine(model, prefill_chunk=16, max_step_tokens=40, max_running=2, overlap=False)
    engine.start()
    try:
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    finally:
        engine.shutdown()
    steps = step_trace.read(str(path))
    assert len(steps) == engine.stats()["steps"]
    assert sum(s["arrived"] for s in steps) == n
    # [rows, tokens a row] per prefill forward: every prompt token once
    assert sum(r * t for s in steps for r, t in s["prefill"]) == sum(len(p) for p in prompts)
    assert all(t <= 16 for s in steps for _, t in s["prefill"])
    # every output token but each request's first (drawn from its prompt's last chunk) came from a decode row
    assert sum(s["decode"] for s in steps) == sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    assert max(s["decode"] for s in steps) <= 2
    # each step's phases: host times within the step's wall time; a decode phase where it decoded,
    # prefix snapshots where it prefilled
    for s in steps:
        phases = s["phase_ms"]
        assert sum(phases.values()) <= s["ms"] + 1e-3 and "device_ms" not in s  # no device timing on CPU
        assert ("decode" in phases) == bool(s["decode"]) and ("prefix" in phases) == bool(s["prefill"])
    times = [s["t"] for s in steps]
    assert times == sorted(times)
    summary = step_trace.summary(steps)
    assert summary["steps"] == len(steps) and summary["arrived"] == n
    assert summary["step_s"] == pytest.approx(sum(s["ms"] for s in steps) / 1e3, abs=1e-3)
    assert sum(summary["phase_s"].values()) <= summary["step_s"] + 1e-3 and summary["device_s"] == {}


def test_an_existing_file_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "steps.jsonl"
    path.write_text("mine\n")
    monkeypatch.setenv(step_trace.ENV, str(path))
    with pytest.raises(ValueError, match="does not exist yet"):
        step_trace.trace_path()
    assert path.read_text() == "mine\n"


def test_allocator_counts_are_named_and_summed(tmp_path):
    """A step's allocator deltas (``StepTimer.allocs``: counts in ``step_timing.alloc_counts``' order)
    are written under their names, and the summary adds them up per phase and counter."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    trace = step_trace.StepTrace(str(tmp_path / "steps.jsonl"))
    given = []
    for i in range(int(torch.randint(2, 6, (), generator=g))):
        allocs = {p: torch.randint(0, 3, (4,), generator=g).tolist() for p in ("join", "prefill")
                  if torch.rand((), generator=g) < 0.7}
        given.append(allocs)
        trace.record(float(i), i + 0.5, 1, [], 0, 0, {"join": 0.1}, None, allocs)
    trace.close()
    steps = step_trace.read(str(tmp_path / "steps.jsonl"))
    for s, allocs in zip(steps, given):
        assert s.get("allocs", {}) == {p: dict(zip(step_trace.ALLOC_NAMES, c)) for p, c in allocs.items()}
    want = {}
    for allocs in given:
        for p, counts in allocs.items():
            for name, v in zip(step_trace.ALLOC_NAMES, counts):
                if v:
                    want.setdefault(p, {})[name] = want.get(p, {}).get(name, 0) + v
    assert step_trace.summary(steps)["allocs"] == want
