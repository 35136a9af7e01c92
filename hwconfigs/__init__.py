"""Shipped hardware profiles: one YAML per device class (package data).

The profile schema, validation and device matching live in ``flashrt.profiles``.
"""
from __future__ import annotations

from importlib import resources


def profile_files() -> dict[str, str]:
    """Shipped profile name -> path of its YAML file."""
    root = resources.files(__name__)
    return {p.name[: -len(".yaml")]: str(p) for p in root.iterdir() if p.name.endswith(".yaml")}
