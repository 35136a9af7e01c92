"""Plans: the kernel variants a model's runs used on a device, kept so the next cold start
compiles them all in parallel before the first launch asks (:mod:`flashrt.jit_parallel`).

The families' warm-up launches (``warmup_cases``) cover the shapes they list; a run also launches
at its own token counts, page-table sizes and routing counts, which Triton specialises on. So a
run records every variant it loads (Triton's ``jit_post_compile_hook``, which sees each variant a
process compiles or finds in the cache) and adds the new ones to its plan:

    <cache root>/plans/triton-<version>/<arch>-<profile>-<model>.json    written by runs
    core/jit_plans/triton-<version>/<arch>-<profile>-<model>.json        shipped (same format)

An entry is Triton's own specialization data (``serialize_specialization_data``: signature,
constexprs, specialization attributes, options) with the kernel's module and name. A plan is a
hint, never trusted for correctness: what is compiled from it goes through Triton's cache key
(source, options, target), so an entry for a kernel since changed is compiled uselessly at worst,
and one that no longer decodes or resolves is skipped. Files are per Triton version (the format
and the keys change with it), written whole (:func:`flashrt.jit.atomic_write`) under a lock.
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

from .jit import atomic_write, cache_root
from .jit_locks import lock_file
from .jit_parallel import Spec, portable_options
from .jit_targets import Arch

log = logging.getLogger("flashrt")
SHIPPED = Path(__file__).resolve().parent / "jit_plans"
MAX_ENTRIES = 4096  # a plan keeps at most this many variants (the newest runs' first)


def plan_name(arch: Arch, profile: str, model: str) -> str:
    safe = lambda s: "".join(c if c.isalnum() or c in "-_." else "_" for c in str(s))  # noqa: E731
    return f"{safe(arch.name)}-{safe(profile)}-{safe(model)}.json"


def _version_dir() -> str:
    import triton

    return f"triton-{triton.__version__}"


def profile_names(profile) -> tuple[str, ...]:
    """The names whose plans a profile reads: its lineage (``Profile.lineage``: its name, then the
    profiles it extends), or its name alone for a profile made without one."""
    return getattr(profile, "lineage", ()) or (profile.name,)


def plan_paths(arch: Arch, profile: str | Sequence[str], model: str) -> list[Path]:
    """Where the plan of (``arch``, ``profile``, ``model``) is read from: the cache's, the shipped one.
    ``profile`` a profile's lineage (``Profile.lineage``: its name, then the profiles it extends):
    those two of each name in turn, so a profile that extends another reads the other's plans after
    its own."""
    out = []
    for each in [profile] if isinstance(profile, str) else profile:
        name = plan_name(arch, each, model)
        out += [cache_root() / "plans" / _version_dir() / name, SHIPPED / _version_dir() / name]
    return out


def read_entries(path: Path) -> list[dict]:
    """The entries of one plan file; none when it is missing or unreadable (with a warning)."""
    try:
        entries = json.loads(path.read_text())["entries"]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("flashrt.jit: ignoring the plan %s (%s)", path, exc)
        return []
    return [e for e in entries if isinstance(e, dict) and {"module", "name", "data"} <= set(e)] \
        if isinstance(entries, list) else []


def entry_key(entry: dict) -> tuple:
    """What tells two plan entries apart: the kernel and what its compile takes from Triton's
    specialization data (signature, constexprs, attributes, options without the machine's libdevice
    path). Triton's in-memory ``key`` text is left out: it lists the launch's keyword options
    (``launch_pdl`` when a launch passes it) beside the compile options that already carry them, so
    one variant can be recorded under two keys."""
    try:
        data = json.loads(entry["data"])
        data.pop("key", None)
        data["options"] = portable_options(data.get("options") or {})
        data = json.dumps(data, sort_keys=True)
    except (ValueError, TypeError, AttributeError):
        data = entry["data"]
    return entry["module"], entry["name"], data


def plan_text(arch: str, profile: str, model: str, entries: list[dict]) -> bytes:
    """A plan file's contents."""
    return (json.dumps({"arch": arch, "profile": profile, "model": model, "entries": entries}, indent=0)
            + "\n").encode()


def entries(arch: Arch, profile: str | Sequence[str], model: str) -> list[dict]:
    """The entries of every plan of (``arch``, ``profile``, ``model``) (:func:`plan_paths`), the
    cache's first, each variant once (:func:`entry_key`)."""
    found, seen = [], set()
    for path in plan_paths(arch, profile, model):
        for entry in read_entries(path):
            key = entry_key(entry)
            if key not in seen:
                seen.add(key)
                found.append(entry)
    return found


def load(arch: Arch, profile: str | Sequence[str], model: str) -> list[Spec]:
    """The variants of every plan of (``arch``, ``profile``, ``model``), decoded; an entry that
    does not decode is skipped."""
    specs = []
    for entry in entries(arch, profile, model):
        try:
            specs.append(decode(entry, arch))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("flashrt.jit: skipping a plan entry of %s.%s (%s)", entry["module"], entry["name"], exc)
    return specs


def decode(entry: dict, arch: Arch) -> Spec:
    """One entry -> :class:`Spec` for ``arch`` (as Triton's ``JITFunction.preload`` reads it)."""
    import triton.language as tl

    data = json.loads(entry["data"])

    def constant(value):
        if isinstance(value, str) and tl.dtype.is_dtype(value):
            return tl.dtype(value)
        if isinstance(value, dict) and "constexpr" in value:
            return tl.constexpr(value["constexpr"])
        return value

    constexprs = {tuple(k): constant(v) for k, v in zip(data["constant_keys"], data["constant_vals"])}
    attrs = {tuple(k): v for k, v in zip(data["attrs_keys"], data["attrs_vals"])}
    signature = {k: _tuples(v) for k, v in data["signature"].items()}
    options = portable_options({k: _tuples(v) for k, v in data["options"].items()})
    return Spec(str(entry["module"]), str(entry["name"]), signature, constexprs, attrs, options, arch.cc,
                ("plan",), ("plan",))


def _tuples(value):
    """JSON's lists back to the tuples Triton wrote (options and signatures hold no lists)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


class Recorder:
    """Records every variant this process loads, through Triton's ``jit_post_compile_hook`` (a hook
    already set is kept and called first); ``entries()`` lists them, ``close()`` unhooks."""

    def __init__(self):
        from triton import knobs

        self._knobs, self._entries = knobs, {}
        self._previous = knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_post_compile_hook = self._hook

    def _hook(self, *args, **kwargs):
        result = self._previous(*args, **kwargs) if self._previous is not None else None
        fn, compile_ = kwargs.get("fn"), kwargs.get("compile") or {}
        data = compile_.get("specialization_data")
        jit_fn = getattr(fn, "jit_function", None)
        if data is not None and jit_fn is not None:
            name = getattr(jit_fn, "fn", jit_fn).__qualname__
            self._entries[(jit_fn.__module__, name, data)] = None
        return result

    def entries(self) -> list[dict]:
        return [{"module": m, "name": n, "data": d} for m, n, d in self._entries]

    def close(self) -> None:
        if self._knobs.runtime.jit_post_compile_hook == self._hook:
            self._knobs.runtime.jit_post_compile_hook = self._previous


def save(arch: Arch, profile: str, model: str, entries: list[dict], last: bool = False) -> int:
    """Add ``entries`` to the cache's plan of (``arch``, ``profile``, ``model``) (read, merged and
    rewritten under the plan's lock); the number of entries that were new. The new entries go first
    (a pool compiles a plan in order: what the latest run launched comes first), or with ``last``
    after the plan's (a server's warm-up variants: a run's cold start still compiles its own first)."""
    if not entries:
        return 0
    path = plan_paths(arch, profile, model)[0]
    lock = cache_root() / "locks" / f"plan-{path.name}.lock"
    fd = lock_file(lock, deadline=time.monotonic() + float(os.environ.get("FLASHRT_JIT_LOCK_TIMEOUT", "600")))
    if fd is None:
        log.warning("flashrt.jit: waited too long for %s; the plan is not updated", lock)
        return 0
    try:
        old = read_entries(path)
        known = {entry_key(e) for e in old}
        new = [e for e in entries if entry_key(e) not in known]
        if new:
            merged = (old + new) if last else (new + old)
            atomic_write(path, plan_text(arch.name, profile, model, merged[:MAX_ENTRIES]))
        return len(new)
    finally:
        os.close(fd)
