"""A request's times (``Finished`` records, ``/metrics``): time to first token splits into the time
in the queue (arrival to its first prompt chunk planned) and the prefill time (from there to the
first token)."""
import torch
from prometheus_client.parser import text_string_to_metric_families

from flashrt.engine import Engine, SamplingParams
from flashrt.engine.server.metrics import Metrics


def histograms(text: bytes) -> dict:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            if s.name.endswith(("_sum", "_count")):
                out[s.name] = s.value
    return out


def test_queue_and_prefill_times_add_up_to_ttft(model, rng):
    engine = Engine(model, prefill_chunk=16, max_step_tokens=40, max_running=2)
    metrics, records = Metrics(engine), []
    engine.on_finish(records.append)
    draw = lambda lo, hi: int(torch.randint(lo, hi, (), generator=rng))  # noqa: E731
    n = draw(4, 7)
    prompts = [torch.randint(0, model.cfg.vocab_size, (draw(5, 30),), generator=rng).tolist() for _ in range(n)]
    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=draw(2, 5), ignore_eos=True))
    assert len(records) == n
    for r in records:
        assert r.arrival <= r.scheduled_time <= r.first_token_time <= r.finish_time
    # two slots: a request past the first two is planned only after an earlier one finished
    firsts = sorted(records, key=lambda r: r.scheduled_time)
    earliest_finish = min(r.finish_time for r in firsts[:2])
    assert all(r.scheduled_time >= earliest_finish for r in firsts[2:])
    h = histograms(metrics.render())
    for name in ("time_to_first_token", "request_queue_time", "request_prefill_time"):
        assert h[f"flashrt_{name}_seconds_count"] == n
    ttft = sum(r.first_token_time - r.arrival for r in records)
    assert abs(h["flashrt_time_to_first_token_seconds_sum"] - ttft) < 1e-6
    split = h["flashrt_request_queue_time_seconds_sum"] + h["flashrt_request_prefill_time_seconds_sum"]
    assert abs(split - ttft) < 1e-6
    assert h["flashrt_request_queue_time_seconds_sum"] > 0
