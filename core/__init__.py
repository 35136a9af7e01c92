"""flashrt: a hardware-abstracted inference runtime for DeepSeek-V4.1-Flash-class models.

``flashrt.ops`` is the op contract; backends plug in through ``flashrt.hookspecs``.
"""
from . import formats, ops, profiles
from .checks import value_checks
from .dispatch import use_backend
from .errors import BackendError, CheckpointError, FlashrtError, ProfileError
from .formats import QTensor
from .profiles import active_profile, select_profile, use_profile
from .rope import rope_table

__version__ = "0.1.0"


# The user API's entry points live in the layers above core; the package root names them lazily
# (PEP 562) so that importing flashrt loads no model code.
# ``backends`` (the plugin package) is named the same way: core never imports a backend.
_FACADE = {"load": ("flashrt.graphs.loader", "load"), "generate": ("flashrt.engine.generation", "generate"),
           "Engine": ("flashrt.engine.engine", "Engine"), "SamplingParams": ("flashrt.engine.sampling", "SamplingParams"),
           "backends": ("flashrt.backends", None)}


def __getattr__(name):
    if name in _FACADE:
        import importlib

        module, attr = _FACADE[name]
        found = importlib.import_module(module)
        return found if attr is None else getattr(found, attr)
    raise AttributeError(f"module 'flashrt' has no attribute {name!r}")

__all__ = [
    "BackendError", "CheckpointError", "FlashrtError", "ProfileError", "QTensor", "active_profile", "backends",
    "formats", "ops", "profiles", "select_profile", "use_profile",
    "Engine", "SamplingParams", "generate", "load", "rope_table", "use_backend", "value_checks", "__version__",
]
