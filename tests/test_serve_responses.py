"""SSE chunks of a request with n = 2 whose sequences end at different steps: one finish chunk per
choice, the role once per choice, deltas that add up to the texts, logprob offsets that add up."""
import json

from flashrt.engine.request import CompletionOutput, RequestOutput, TokenLogprob
from flashrt.engine.server.responses import Renderer
from flashrt.engine.text import ByteTokenizer


def out(texts, finished, deltas, lps=None):
    outs = [CompletionOutput(i, t, list(t.encode()), lps, f, delta_text=d, delta_token_ids=list(d.encode()),
                             delta_logprobs=[TokenLogprob(b, -1.0, []) for b in d.encode()] if lps is not None else [])
            for i, (t, f, d) in enumerate(zip(texts, finished, deltas))]
    return RequestOutput("r", [1, 2], outs, all(finished))


def events(render, outputs):
    got = []
    for o in outputs:
        got += [json.loads(e[6:]) for e in render.chunks(0, o)]
    return got


def test_chat_chunks_end_each_choice_once():
    render = Renderer("chat", "id", "tiny", ByteTokenizer(320), n=2)
    steps = [out(["a", "x"], [None, None], ["a", "x"]), out(["ab", "xy"], ["length", None], ["b", "y"]),
             out(["ab", "xyz"], ["length", None], ["", "z"]), out(["ab", "xyzw"], ["length", "stop"], ["", "w"])]
    chunks = events(render, steps)
    per = {0: [], 1: []}
    for c in chunks:
        (choice,) = c["choices"]
        per[choice["index"]].append(choice)
    for i, text in ((0, "ab"), (1, "xyzw")):
        assert "".join(ch["delta"]["content"] for ch in per[i]) == text
        assert [ch["finish_reason"] for ch in per[i]][-1] is not None
        assert sum(ch["finish_reason"] is not None for ch in per[i]) == 1
        assert sum("role" in ch["delta"] for ch in per[i]) == 1 and "role" in per[i][0]["delta"]


def test_completion_chunk_logprob_offsets():
    render = Renderer("completion", "id", "tiny", ByteTokenizer(320), n=1)
    steps = [out(["hel"], [None], ["hel"], lps=[]), out(["hello"], ["length"], ["lo"], lps=[])]
    chunks = events(render, steps)
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens == list("hello") and offsets == [0, 1, 2, 3, 4]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "hello"
