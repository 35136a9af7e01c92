"""Sharded loading of a published-layout checkpoint: what each rank makes resident in host memory,
and the values (the ones a whole load cuts out).

Two parts, measured in a fresh process per rank. Private memory (``RssAnon``, read after every
stored tensor is read and after it is decoded, the two points where a load holds the most): its
peak above the start must be at most the bytes of the rank's sliced reads (the only copies a load
makes) plus the largest tensor plus 4 MiB of interpreter noise. Checkpoint pages (the ``Rss`` of
the checkpoint's memory mappings in ``/proc/self/smaps``, after touching every weight; a tensor
read whole stays backed by the file, and those pages only accumulate while the weights are held):
with the private part, at least the rank's stored bytes and well under the whole checkpoint. The
mapped part is not bounded by the shard alone: the kernel also maps page-cache pages around each
faulting page (fault-around), which adds a sizable part here because the test's expert tensors are
small and other ranks' tensors sit next to them. A whole load measured the same way
copies nothing and maps the whole checkpoint, so the measurement sees what it claims to."""
import dataclasses
import multiprocessing
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from published_layout import with_vision, write_published  # noqa: E402

from flashrt.graphs.config import shipped_config  # noqa: E402

NOISE = 4 << 20


def _anon() -> int:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(status["RssAnon"].split()[0]) * 1024


def _mapped(ckpt: str) -> int:
    """Resident bytes of the checkpoint's memory-mapped files in this process (``/proc/self/smaps``)."""
    total, mine = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if len(head) >= 5 and "-" in head[0] and ":" not in head[0]:  # a mapping's first line
            mine = len(head) >= 6 and head[5].startswith(ckpt)
        elif mine and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    return total


def _measure(path, tp, ep, rank):
    """In a fresh process: (peak private bytes above the start, checkpoint bytes mapped, stored bytes
    of the rank's shard, bytes of its sliced (copied) reads, the largest tensor's bytes)."""
    import contextlib

    import torch

    from flashrt.graphs import checkpoint, shard_load
    from flashrt.graphs.parallel import Layout
    from flashrt.graphs.shard import nbytes

    torch.set_num_threads(1)
    samples, largest, sliced = [], [0], [0]
    read, decode = shard_load._read, checkpoint.decode

    def reading(handle, name, cut, index):
        t = read(handle, name, cut, index)
        samples.append(_anon())
        largest[0] = max(largest[0], nbytes(t))
        sliced[0] += nbytes(t) if cut is not None else 0
        return t

    def decoding(spec, data, scale):
        v = decode(spec, data, scale)
        samples.append(_anon())
        largest[0] = max(largest[0], nbytes(data) + (nbytes(scale) if scale is not None else 0) + nbytes(v))
        return v

    shard_load._read, checkpoint.decode = reading, decoding
    with contextlib.ExitStack() as stack:  # warm-up (imports, safetensors) without holding any weight
        where = checkpoint.open_shards(Path(path), stack)
        name = min(where, key=lambda k: where[k].get_slice(k).get_shape())
        where[name].get_tensor(name)
    start, mapped = _anon(), _mapped(str(path))
    _, weights, stored = shard_load.load_shard(path, Layout(tp, ep, rank))
    for v in weights.values():  # a weight read whole is mapped lazily: touch every page, as its use would
        for t in (v.data, v.scale) if hasattr(v, "scale") else (v,):
            t.reshape(-1).view(torch.uint8)[::4096].sum()
    mapped = _mapped(str(path)) - mapped  # only grows while the weights are held: its final value is its peak
    return max(samples) - start, mapped, stored, sliced[0], largest[0]


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    from flashrt.graphs.init_weights import init_weights

    cfg = dataclasses.replace(shipped_config("tiny"), n_routed_experts=8, n_activated_experts=4, moe_inter_dim=8192,
                              name="tiny-wide")
    weights = init_weights(cfg, seed=int.from_bytes(__import__("os").urandom(3), "little"))
    return cfg, weights, write_published(weights, with_vision(cfg), tmp_path_factory.mktemp("pub") / "ckpt")


def test_published_shards_load_as_a_whole_load_cuts_them(published):
    import torch

    from flashrt.graphs import checkpoint
    from flashrt.graphs.parallel import Layout
    from flashrt.graphs.shard import shard_weights
    from flashrt.graphs.shard_load import load_shard

    cfg, _, path = published
    _, whole = checkpoint.load(path)
    for tp, ep, rank in [(2, 1, 1), (1, 2, 0)]:
        _, mine, _ = load_shard(path, Layout(tp, ep, rank))
        want = shard_weights(whole, cfg.replace(vision_n_layers=0), Layout(tp, ep, rank))
        assert mine.keys() == want.keys()
        for k, v in want.items():  # wo_a read FP8 on whole 32x32 tiles, then dequantized
            got = mine[k]
            same = torch.equal(got.data, v.data) and torch.equal(got.scale.view(torch.uint8), v.scale.view(
                torch.uint8)) if hasattr(v, "scale") else torch.equal(got, v)
            assert same, f"tp={tp} ep={ep} rank {rank}: {k} differs from the whole load's slice"


def test_peak_host_memory_per_rank_is_its_shard_plus_one_tensor(published):
    _, _, path = published
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1, maxtasksperchild=1) as pool:  # a fresh process per measurement
        anon, mapped, total, sliced, largest = pool.apply(_measure, (path, 1, 1, 0))
        ranks = {(tp, ep, r): pool.apply(_measure, (path, tp, ep, r)) for tp, ep in ((1, 2), (2, 1)) for r in (0, 1)}
    assert sliced == 0 and anon <= largest + NOISE  # a whole load copies nothing: its weights are the mapped file
    assert mapped >= 0.9 * total  # and the measurement sees all of it
    for (tp, ep, r), (anon, mapped, stored, sliced, largest) in ranks.items():
        where = f"tp={tp} ep={ep} rank {r}"
        assert stored < 0.75 * total, where  # the experts dominate: a rank holds little more than half
        assert anon <= sliced + largest + NOISE, f"{where}: private peak {anon} > slices {sliced} + tensor {largest}"
        assert (sliced > 0) == (tp > 1), where  # tensor parallelism cuts tensors: those reads are copies
        assert stored <= anon + mapped < 0.85 * total, f"{where}: resident {anon + mapped} of {total} stored"
