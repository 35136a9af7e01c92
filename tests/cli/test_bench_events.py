"""``flashrt bench serve``'s reader of server-sent events: whatever the network's split of the
stream, every ``data:`` payload comes out once, in order."""
import json

from hypothesis import given, settings, strategies as st

from flashrt.bench.serve import EventReader

payloads = st.lists(st.dictionaries(st.sampled_from("abcxyz"), st.integers() | st.text(max_size=8), max_size=3),
                    min_size=1, max_size=12)


def read(pieces) -> tuple[list[bytes], EventReader]:
    reader, got = EventReader(), []
    for piece in pieces:
        got += reader.feed(piece)
    return got, reader


@settings(max_examples=300, deadline=None)
@given(payloads, st.data(), st.sampled_from([b"\n", b"\r\n"]))
def test_events_survive_any_split(objs, data, eol):
    wire = b"".join(b"data: " + json.dumps(o).encode() + eol + eol for o in objs) + b"data: [DONE]" + eol + eol
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=10)))
    got, reader = read(wire[a:b] for a, b in zip([0, *cuts], [*cuts, len(wire)]))
    assert got[-1] == b"[DONE]" and not reader.buffer and not reader.cr
    assert [json.loads(g) for g in got[:-1]] == objs


def test_crlf_split_between_its_bytes():
    got, reader = read([b"data: 1\r\n\r", b"\n", b"data: 2\r", b"\n\r\n"])
    assert got == [b"1", b"2"] and not reader.buffer


def test_comment_lines_and_partial_events_wait():
    reader = EventReader()
    assert reader.feed(b": keep-alive\n\ndata: {\"a\": 1}\n\ndata: {\"b\"") == [b'{"a": 1}']
    assert reader.feed(b": 2}\n\n") == [b'{"b": 2}'] and not reader.buffer
