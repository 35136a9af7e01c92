"""Model graphs written only against flashrt.ops (the V4.1 model lands here)."""
