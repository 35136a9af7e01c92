"""Helpers ops.md names under ``flashrt.core``: the rotary table builder."""
from .rope import YaRN, rope_frequencies, rope_table

__all__ = ["YaRN", "rope_frequencies", "rope_table"]
