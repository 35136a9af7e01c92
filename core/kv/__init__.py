"""HKCP, the tiered KV cache: per-sequence state (``state``, with its row moves in ``rows`` and
its staged ring and partial-group writes in ``window_writes``), device page pools (``pages``,
``main_kv``, ``index``, ``paged``), the persistent prefix cache on disk (``prefix_cache``) and the
host-memory window pool (``window_pool``)."""
