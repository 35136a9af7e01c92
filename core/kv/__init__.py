"""HKCP, the tiered KV cache: per-sequence state (``state``), device page pools (``pages``,
``main_kv``, ``index``, ``paged``), the persistent prefix cache on disk (``prefix_cache``) and the
host-memory window pool (``window_pool``)."""
