"""flashrt: a hardware-abstracted inference runtime for DeepSeek-V4.1-Flash-class models.

``flashrt.ops`` is the op contract; backends plug in through ``flashrt.hookspecs``.
"""
from . import backends, formats, ops, profiles
from .checks import value_checks
from .dispatch import use_backend
from .errors import BackendError, CheckpointError, FlashrtError, ProfileError
from .formats import QTensor
from .profiles import active_profile, select_profile, use_profile
from .rope import rope_table

__version__ = "0.1.0"


def load(path, device=None, profile=None, verify: bool = False, progress=None):
    """Load a checkpoint directory (``config.json`` + safetensors shards) -> ``Model``.

    See :func:`flashrt.graphs.loader.load`."""
    from .graphs.loader import load as _load

    return _load(path, device=device, profile=profile, verify=verify, progress=progress)

__all__ = [
    "BackendError", "CheckpointError", "FlashrtError", "ProfileError", "QTensor", "active_profile", "backends",
    "formats", "ops", "profiles", "select_profile", "use_profile",
    "load", "rope_table", "use_backend", "value_checks", "__version__",
]
