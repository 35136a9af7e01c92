"""``flashrt serve --model tiny`` in a subprocess on 127.0.0.1, driven by the official ``openai``
client: completions (text through the model's tokenizer, BOS included), chat in the model's chat
format (prompt ids equal ``chat_format.encode``; reasoning / content split; thinking and effort
switches), streaming (deltas add up to the whole text, CJK and emoji included), n > 1, logprobs,
stop strings, token-id prompts (each greedy result equals ``Engine.generate`` of the same prompt
alone, in this process); a bounded load test
(64 requests, 16 at a time, some abandoned mid-stream: the rest complete, none lost or duplicated,
no KV page left in use); SIGTERM ends the server with exit status 0."""
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

KEY = "sk-test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-cache")
    old = os.environ.get("FLASHRT_CACHE_DIR")
    os.environ["FLASHRT_CACHE_DIR"] = str(root)
    yield {"FLASHRT_CACHE_DIR": str(root)}
    if old is None:
        os.environ.pop("FLASHRT_CACHE_DIR")
    else:
        os.environ["FLASHRT_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def reference(cache_env):
    """The served model loaded here the way the server loads it, in an engine with its settings."""
    import torch

    from flashrt.engine import Engine
    from flashrt.engine.run import load_model

    model = load_model("tiny", torch.device("cpu"), quiet=True)  # creates the checkpoint the server loads
    return Engine(model)


@pytest.fixture(scope="module")
def server(reference, cache_env):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "flashrt.cli", "serve", "--model", "tiny", "--port", str(port),
                             "--api-key", KEY, "--log-level", "warning", "--grace-s", "20"],
                            env={**os.environ, **cache_env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"flashrt serve exited early:\n{proc.stdout.read()}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.3)
    else:
        proc.kill()
        pytest.fail("flashrt serve did not come up within 120 s")
    yield base, proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)


def alone(reference, prompt, **params):
    from flashrt.engine import SamplingParams

    return reference.generate(prompt, SamplingParams(**params))[0]


def test_models_and_completions_equal_the_engine_alone(client, reference):
    from flashrt.graphs.tokenizer import Tokenizer

    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert isinstance(reference.tokenizer, Tokenizer)  # the built-in checkpoint's BPE, not bytes
    prompt = "The quick brown fox"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    want = alone(reference, prompt, max_tokens=8, temperature=0).outputs[0]
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
    ids = reference.tokenizer.encode(prompt)
    assert ids[0] == reference.tokenizer.bos_id and want.token_ids == alone(reference, ids, max_tokens=8, temperature=0).outputs[0].token_ids
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(want.token_ids))
    ids = [5, 77, 300, 12, 9]  # a token-id prompt
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0, logprobs=3)
    want = alone(reference, ids, max_tokens=6, temperature=0, logprobs=3).outputs[0]
    lp = r.choices[0].logprobs
    assert r.choices[0].text == want.text and len(lp.tokens) == 6 and all(len(t) == 3 for t in lp.top_logprobs)
    assert lp.token_logprobs == pytest.approx([x.logprob for x in want.logprobs], abs=1e-6)


def chat_message(reference, ids, thinking, **params):
    from flashrt.engine.server.chat import message

    want = alone(reference, ids, **params).outputs[0]
    return want, message(want.text, thinking)


@pytest.mark.parametrize("extra, options", [
    ({}, {"thinking": True}),
    ({"reasoning_effort": "low"}, {"thinking": True, "effort": "low"}),
    ({"extra_body": {"chat_template_kwargs": {"thinking": False}}}, {"thinking": False}),
])
def test_chat_in_the_models_format(client, reference, extra, options):
    from flashrt.graphs import chat_format

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello 北京 😀"}]
    ids = chat_format.encode(reference.tokenizer, messages, **options)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                       logprobs=True, top_logprobs=2, **extra)
    want, msg = chat_message(reference, ids, options["thinking"], max_tokens=10, temperature=0)
    got = r.choices[0].message
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want.token_ids)
    assert (got.role, got.content, (got.model_extra or {}).get("reasoning_content")) == \
        ("assistant", msg["content"], msg.get("reasoning_content"))
    assert len(r.choices[0].logprobs.content) == len(want.token_ids)
    assert all(len(t.top_logprobs) == 2 for t in r.choices[0].logprobs.content)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}, **extra))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == (msg["content"] or "")
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == \
        (msg.get("reasoning_content") or "")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    assert chunks[-1].usage.prompt_tokens == len(ids) and not chunks[-1].choices


@pytest.mark.parametrize("prompt, params", [("天气 北京 😀😀 é", dict(temperature=0)),
                                            ("emoji 😀 北", dict(temperature=1.0, seed=7))])
def test_streamed_completion_equals_whole(client, reference, prompt, params):
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, **params)
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=24, stream=True, **params))
    want = alone(reference, prompt, max_tokens=24, **params).outputs[0]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text == want.text
    assert want.text == reference.tokenizer.decode(want.token_ids[:-1] if want.finish_reason == "stop"
                                                   else want.token_ids)


def test_stop_strings(client, reference):
    prompt = "The quick brown fox 北京"
    full = alone(reference, prompt, max_tokens=10, temperature=0).outputs[0].text
    stop = next((full[i:i + 2] for i in range(2, len(full) - 1) if "\ufffd" not in full[i:i + 2]), None)
    if stop is not None:  # a stop string taken from the greedy text: the output ends before it
        s = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                      stop=[stop, "never-there"])
        assert s.choices[0].text == full[:full.find(stop)] and s.choices[0].finish_reason == "stop"


def test_n_and_seeds(client, reference):
    args = dict(model="tiny", prompt="seeded", max_tokens=6, temperature=1.0, seed=42, n=3)
    a, b = client.completions.create(**args), client.completions.create(**args)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    want = alone(reference, "seeded", max_tokens=6, temperature=1.0, seed=42, n=3)
    assert [c.text for c in a.choices] == [c.text for c in want.outputs]
    g = client.completions.create(model="tiny", prompt=["one", "two"], max_tokens=4, temperature=0, n=2)
    assert len(g.choices) == 4
    by_index = {c.index: c.text for c in g.choices}
    assert by_index[0] == by_index[1] == alone(reference, "one", max_tokens=4, temperature=0).outputs[0].text
    assert by_index[2] == by_index[3] == alone(reference, "two", max_tokens=4, temperature=0).outputs[0].text


def test_auth_and_raw_errors(server):
    base = server[0]
    r = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{base}/v1/completions", content=b"{not json", headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": [7] * 5000},
                   headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and "context of 4096 tokens" in r.json()["error"]["message"]
    assert httpx.get(f"{base}/metrics").status_code == 200  # no key needed for health and metrics


def metric(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_load_64_requests_16_concurrent_some_abandoned(server, reference):
    base = server[0]
    aclient = openai.AsyncOpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)
    before = metric(base, "flashrt_requests_finished_total")
    abandon = set(range(3, 64, 8))  # 8 streams closed after their first chunk

    async def one(i, sem):
        async with sem:
            prompt = "load test " + "x" * (i * 7 % 41)
            n_tok = 3 + i % 4
            if i % 2 == 0:
                r = await aclient.completions.create(model="tiny", prompt=prompt, max_tokens=n_tok, temperature=0)
                return i, r.id, r.choices[0].text, r.usage.completion_tokens
            stream = await aclient.completions.create(model="tiny", prompt=prompt, max_tokens=n_tok,
                                                      temperature=0, stream=True)
            parts, ids, usage = [], set(), None
            async for chunk in stream:
                ids.add(chunk.id)
                if chunk.choices:
                    parts.append(chunk.choices[0].text)
                if chunk.usage:
                    usage = chunk.usage.completion_tokens
                if i in abandon:
                    await stream.close()
                    return i, None, None, None
            assert len(ids) == 1
            return i, ids.pop(), "".join(parts), usage

    async def main():
        sem = asyncio.Semaphore(16)
        return await asyncio.gather(*(one(i, sem) for i in range(64)))

    results = asyncio.run(main())
    done = [r for r in results if r[1] is not None]
    assert len(done) == 64 - len(abandon)
    assert len({r[1] for r in done}) == len(done)  # no response id twice
    for i, _, text, tokens in done:
        assert tokens == 3 + i % 4
    spot = [r for r in done if r[0] in (0, 1, 10, 33)]
    for i, _, text, _ in spot:
        want = alone(reference, "load test " + "x" * (i * 7 % 41), max_tokens=3 + i % 4, temperature=0)
        assert text == want.outputs[0].text
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and metric(base, "flashrt_requests_running") + metric(base, "flashrt_requests_waiting") > 0:
        time.sleep(0.2)
    finished = metric(base, "flashrt_requests_finished_total") - before
    aborted = metric(base, "flashrt_requests_aborted_total")
    assert finished + aborted >= 64 and finished >= 64 - len(abandon)
    assert metric(base, 'flashrt_kv_pages_used{tier="device"}') == 0
    assert metric(base, 'flashrt_kv_pages_used{tier="index"}') == 0
    assert metric(base, "flashrt_time_to_first_token_seconds_count") >= 64 - len(abandon)


def test_bench_serve_sweep(server, tmp_path):
    from flashrt.bench.serve import sweep

    logged = []
    report = sweep(server[0], concurrency=[1, 4], request_rate=[float("inf")], num_prompts=6, input_len=10,
                   output_len=3, range_ratio=0.5, api_key=KEY, log=logged.append)
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 4, None] and len(logged) == 3
    for lv in report["levels"]:
        assert (lv["completed"], lv["failed"], lv["output_tokens"]) == (6, 0, 18)
        assert lv["output_throughput"] > 0 and 5 * 6 <= lv["input_tokens"] <= 15 * 6
        for key in ("ttft_s", "tpot_s", "latency_s"):
            assert 0 < lv[key]["p50"] <= lv[key]["p99"]
        assert lv["ttft_s"]["p99"] <= lv["latency_s"]["p99"]


def test_sigterm_exits_zero_after_finishing_running_requests(server):
    base, proc = server
    hdr = {"authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "prompt": "last one", "max_tokens": 12, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=hdr, timeout=60) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        proc.send_signal(signal.SIGTERM)  # mid-stream: the request still finishes
        rest = [line for line in lines if line.startswith("data:")]
    assert first and rest[-1] == "data: [DONE]"
    assert proc.wait(timeout=60) == 0
