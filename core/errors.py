"""Typed exceptions of flashrt.

Three tiers (docs/design.md): ``assert`` for internal invariants, ``ValueError`` for bad user input,
and these typed errors for a named plugin, op, profile file or checkpoint tensor.
"""


class FlashrtError(Exception):
    """Base class of every flashrt-specific error."""


class BackendError(FlashrtError):
    """A backend was asked for that is not registered, not available, or cannot serve a call."""


class ProfileError(FlashrtError):
    """A hardware profile file is malformed: names the file, the key, expected and found."""


class CheckpointError(FlashrtError):
    """A checkpoint tensor is missing, extra, mis-shaped or mis-typed: names the tensor."""


class DeviceError(FlashrtError, ValueError):
    """A device was asked for that this machine does not have: names the devices it has."""


class CollectiveError(FlashrtError):
    """A collective of a multi-device run failed: a peer rank died or did not answer within the
    collective timeout. Names the rank that raised it and the collective."""

    def __init__(self, message: str, rank: int | None = None, collective: str | None = None):
        super().__init__(message)
        self.rank, self.collective = rank, collective
