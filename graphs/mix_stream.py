"""A block's mHC coefficients on a second CUDA stream, beside the work that does not read them.

In a block (graphs/block.py) the coefficients of a mix (``hc_coefficients`` over the residual
streams: a GEMV and a Sinkhorn loop) are read only by the expand after the sublayer (``post``,
``comb``) and by the next collapse (``pre``); the sublayer in between (the attention input's
collapse and the attention, or the FFN's collapse and the MoE) reads the previous mix. So the
coefficients can run on a second stream while the sublayer runs on the current one: at decode, where
each of these kernels occupies a few SMs, the coefficients then leave the step's critical path.

:meth:`MixStream.fork` starts ``fn(*args)`` on the second stream after everything already queued on
the current one (``wait_stream``) and returns a :class:`Fork`; :meth:`Fork.join` makes the current
stream wait for it and returns the result. Under CUDA-graph capture the second stream joins the
capture through that wait and leaves it at the join, so the graph holds both branches (a fork must
be joined before the capture ends). Memory: the outputs and workspaces are allocated on the second
stream; every later use of that stream starts with a wait on the current one, which by then has
queued every reader of the earlier outputs, so the allocator never hands their memory to a kernel
that could overlap a reader. Kernels that sum split-K partials through ticket counters take a
pool of counters per stream (kernels_cuda/splitk.py): the two streams never share a counter.

Whether a forward forks is the profile's ``hc_mix_stream_max_tokens`` (rows x chunk tokens up to
which it does; 0: never) on CUDA devices; elsewhere, and above it, :meth:`MixStream.fork` runs
``fn`` inline. Either way the kernels and their inputs are the same: the results are bit-identical.

The same mechanism, on a stream of its own, runs an attention layer's compressed-entry selection
(graphs/attention.py: the compressor, the indexer's query, scores and top-k) beside the query heads
and the window KV, which do not read it; the attention joins it before it reads the picks
(``indexer_stream_max_tokens``). Its inputs (``h``, the query latent, the caches) are made before the
fork and stay referenced until the join; what it writes (compressed entries, the published picks)
is read only after the join.
"""
from __future__ import annotations

import torch

from flashrt import profiles


class Fork:
    """A result being computed on the mix stream (or already computed inline)."""

    __slots__ = ("value", "stream")

    def __init__(self, value, stream=None):
        self.value, self.stream = value, stream

    def join(self):
        """The result, the current stream ordered after the work that made it."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self.stream = None
        return self.value


class MixStream:
    """The second stream of one device (a CUDA stream made with it: never inside a capture)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @staticmethod
    def wanted(device: torch.device, tokens: int, setting: str = "hc_mix_stream_max_tokens") -> bool:
        """Whether a forward of ``tokens`` tokens on ``device`` forks (the active profile's ``setting``:
        ``hc_mix_stream_max_tokens`` for the mixes, ``indexer_stream_max_tokens`` for the attention's
        selection; CUDA devices only)."""
        return device.type == "cuda" and 0 < tokens <= getattr(profiles.active_profile(), setting)

    def fork(self, fn, *args) -> Fork:
        """``fn(*args)`` on the mix stream, after the work queued on the current stream."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            value = fn(*args)
        return Fork(value, self.stream)


def run_inline(fn, *args) -> Fork:
    """``fn(*args)`` on the current stream, as a :class:`Fork` already joined."""
    return Fork(fn(*args))
