"""Writing benchmark results: one JSON file per run, ratios against a baseline row, and profile
copies carrying a benchmark's pick."""
from __future__ import annotations

import json
from pathlib import Path

from flashrt.jit import atomic_write


def write_json(path: str | None, result: dict) -> None:
    """Write ``result`` to ``path`` (nothing when ``path`` is None), atomically: a run killed while
    writing leaves the previous file whole."""
    if path:
        atomic_write(Path(path), (json.dumps(result, indent=2, default=str) + "\n").encode())


def add_ratio(rows: list[dict], key: str, value: str, name: str, match: str, base_value, invert: bool = False) -> None:
    """``row[name] = row[value] / base[value]`` with ``base`` the row sharing ``row[match]`` whose
    ``key`` equals ``base_value`` (``base / row`` with ``invert``)."""
    for r in rows:
        base = next(x for x in rows if x[key] == base_value and x[match] == r[match])
        r[name] = base[value] / r[value] if invert else r[value] / base[value]


def profile_copy(path: str, edit) -> None:
    """Write a copy of the active profile's YAML file to ``path`` (a ``.yaml`` name, which becomes the
    copy's profile name) after ``edit(data)`` changed its parsed mapping in place."""
    import os

    import yaml

    from flashrt import profiles

    with open(profiles.active_profile().source) as f:
        data = yaml.safe_load(f)
    data["name"] = os.path.basename(path).removesuffix(".yaml")
    edit(data)
    with open(path, "w") as f:
        yaml.safe_dump(data, f, sort_keys=False)
