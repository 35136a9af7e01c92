"""flashrt: a hardware-abstracted inference runtime for DeepSeek-V4.1-Flash-class models.

``flashrt.ops`` is the op contract; backends plug in through ``flashrt.hookspecs``.
"""
from . import backends, formats, ops
from .checks import value_checks
from .dispatch import use_backend
from .errors import BackendError, CheckpointError, FlashrtError, ProfileError
from .formats import QTensor
from .rope import rope_table

__version__ = "0.1.0"

__all__ = [
    "BackendError", "CheckpointError", "FlashrtError", "ProfileError", "QTensor", "backends", "formats", "ops",
    "rope_table", "use_backend", "value_checks", "__version__",
]
