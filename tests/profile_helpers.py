"""Shared by the profile tests: a clean profile environment and the shipped profiles' YAML."""
from pathlib import Path

import pytest
import yaml

from flashrt import profiles
from flashrt.hwconfigs import profile_files


@pytest.fixture(autouse=True)
def _clean_profiles(monkeypatch, tmp_path):
    """No FLASHRT_PROFILE, an empty user profile dir, no cached active profile (autouse in every
    module that imports it)."""
    monkeypatch.delenv("FLASHRT_PROFILE", raising=False)
    monkeypatch.setenv("FLASHRT_PROFILE_DIR", str(tmp_path / "user-profiles"))
    profiles.use_profile(None)
    yield
    profiles.use_profile(None)


def shipped_data(name: str) -> dict:
    """The parsed YAML of shipped profile ``name``."""
    return yaml.safe_load(Path(profile_files()[name]).read_text())
