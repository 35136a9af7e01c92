"""Hardware profiles: the YAML schema, loading, device matching and the active profile.

A profile is one flat YAML file whose keys map one-to-one onto :class:`Profile`. Shipped files
live in ``flashrt.hwconfigs``; a user directory (``FLASHRT_PROFILE_DIR``, default
``~/.config/flashrt/profiles``) overrides a shipped file of the same name. The active profile is
chosen once: ``--profile`` / ``FLASHRT_PROFILE`` (a name or a path) if given, else by matching the
detected device (:class:`DeviceFacts`); a broken profile is skipped by the matching (and
reported), never fatal unless it is the one asked for. Tile defaults live with their kernel
family; a profile's ``tiles`` hold only what differs on its device, validated against the
family's declarations when the profile loads (:mod:`flashrt.tile_checks`). Kernels read their
tiles only through :func:`tiles`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Literal, Mapping, Union

from . import tile_checks
from .dtypes import COMPUTE, MAIN_KV_FORMAT, STORAGE
from .errors import ProfileError
from .profile_schema import VALUE_CHECKS, convert, read_yaml, type_name
from .profile_match import DeviceFacts, detect_device, mapping_matches, match_profile, match_reasons

log = logging.getLogger("flashrt")

StorageDtype = Literal[tuple(STORAGE)]  # flashrt.dtypes: fp4, fp8, int8, bf16
ComputeDtype = Literal[COMPUTE]
# keys of older profiles that nothing reads any more: the value they may still hold, and why
OBSOLETE = {"kv_main_dtype": ("fp4", f"the main KV is always stored as fp4 (format {MAIN_KV_FORMAT})"),
            "kv_window_compute_dtype": (None, "attention computes in the activation dtype (compute_dtype)")}
TileParam = Union[bool, int, float, str, None]
# one entry of a kernel module's TILES: parameters, [largest size the rule serves (null: any), parameters]
# rules (the first match applies), or a single setting
TileRules = list[tuple[Union[int, None], dict[str, TileParam]]]
TileSpec = Union[dict[str, TileParam], TileRules, bool, int, float, str, None]


@dataclass(frozen=True)
class Profile:
    """One hardware profile; every field is a key of the YAML file (units in the names)."""

    name: str                                   # must equal the file name without .yaml
    backend: str                                # reference | cuda | ascend | a plugin's name
    match_device_type: Literal["cpu", "cuda", "npu"]
    kv_window_dtype: StorageDtype               # window ring storage
    weight_dtype: StorageDtype                  # dense weight storage
    compute_dtype: ComputeDtype                 # activations / accumulation inputs
    tiles: dict[str, dict[str, TileSpec]] = field(hash=False)  # kernel family -> what differs from its defaults
    hkcp_hot_fraction: float                    # of the KV budget: window rings + recent pages
    hkcp_warm_fraction: float                   # of the KV budget: compressed pages on the device
    hkcp_cold_host_gib: float                   # pinned host memory for cold main-KV pages
    hkcp_persistent_disk_gib: float             # on-disk prefix cache
    hkcp_page_entries: int                      # KV entries per page (a power of two)
    hkcp_prefix_ttl_hours: float                # persistent prefix cache entry lifetime
    hkcp_window_pool_ttl_minutes: float         # idle window rings kept for reuse
    engram_placement: Literal["device", "host", "host_pinned"]
    engram_prefetch_depth: int                  # blocks ahead that Engram rows are copied
    memory_utilization: float                   # fraction of device memory flashrt may use
    device_memory_gib: float | None             # nominal memory of the class (None: system RAM)
    description: str = ""
    # the name of a profile whose keys this one takes where it does not set them (not its name,
    # description or match keys); each tiles.<family>.<entry> it sets replaces the base's
    extends: str | None = None
    serve_max_step_tokens: int = 2048           # tokens per serving-engine step (decodes + prefill chunks)
    # forwards of up to this many tokens (rows x chunk) run each block's mHC coefficients on a second
    # CUDA stream, beside the attention / MoE that does not read them (graphs/mix_stream.py; 0: never)
    hc_mix_stream_max_tokens: int = 0
    # forwards of up to this many tokens run each attention layer's compressed-entry selection (the
    # compressor and the indexer) on a third CUDA stream, beside the query heads and the window KV
    # (graphs/mix_stream.py; 0: never)
    indexer_stream_max_tokens: int = 0
    # chunks of up to this many queries a sequence (a speculative verify's) take the decode path's
    # attention, the indexer's top-k and sparse_attention over explicit indices, where longer chunks
    # take prefix_attention over the window and every visible entry: the same attention either way
    # (graphs/attention.py); 1: decode steps only
    sparse_max_queries: int = 1
    # how the MoE layers store their quantized expert weights' block scales: "row" as quantized and
    # loaded, "k_major" the same tensor laid out [.., K / 32, rows] (formats.with_k_major_scales),
    # which the CUDA GEMMs read in consecutive bytes (docs/kernels.md)
    expert_scales: Literal["row", "k_major"] = "row"
    # how the MoE layers store fp4 expert codes: "nibbles" as quantized and loaded, "words" with each
    # 4-byte word's bits rearranged (flashrt.e2m1_words), which the CUDA packed decode turns into bf16
    # registers with fewer instructions (docs/kernels.md)
    expert_fp4: Literal["nibbles", "words"] = "nibbles"
    match_name: str | None = None               # regex searched in the device name (no case)
    match_capability: tuple[str, ...] = ()      # CUDA compute capabilities, e.g. ["9.0"]
    match_soc: str | None = None                # regex searched in the NPU SoC version
    match_min_memory_gib: float | None = None
    match_max_memory_gib: float | None = None
    # speculative decoding: batch size -> {"verify": [time of a verify step with k = 0, 1, ... drafts],
    # "draft": time of the draft}, relative to a plain decode step (benchmarks/speculative.py)
    speculative_costs: dict[int, dict[str, Union[float, list[float]]]] = field(default_factory=dict, hash=False)
    source: str = field(default="", compare=False)  # the file it was read from (not a YAML key)
    # its name, then the profiles it extends, nearest first (not a YAML key): whose JIT plans it reads
    lineage: tuple[str, ...] = field(default=(), compare=False)

    @property
    def cold_host_bytes(self) -> int:
        return int(self.hkcp_cold_host_gib * 2**30)

    @property
    def persistent_disk_bytes(self) -> int:
        return int(self.hkcp_persistent_disk_gib * 2**30)

    def to_dict(self) -> dict:
        """The YAML keys and values (what a tuner writes back)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in NOT_KEYS}
        d["match_capability"] = list(self.match_capability)
        d["tiles"] = {k: dict(v) for k, v in self.tiles.items()}
        d["speculative_costs"] = {b: dict(v) for b, v in self.speculative_costs.items()}
        return d


@functools.lru_cache(maxsize=None)
def _hints() -> dict:
    return typing.get_type_hints(Profile)


def _check_values(p: Profile, file: str) -> None:
    """Ranges of the non-tile keys (:data:`flashrt.profile_schema.VALUE_CHECKS`, one per key group)."""
    for check in VALUE_CHECKS:
        check(p, file)


def profile_from_mapping(data, file: str) -> Profile:
    """A validated :class:`Profile` from a parsed YAML mapping; ``file`` names it in errors."""
    if not isinstance(data, Mapping):
        raise ProfileError(f"{file}: expected a mapping of keys at the top level, found {type(data).__name__}")
    data, lineage = _with_bases(_without_obsolete(data, file), file)
    try:
        return _validated(data, file, lineage)
    except ProfileError as exc:
        if not lineage:
            raise
        where = " then ".join(f"{b} ({available_profiles().get(b, '?')})" for b in lineage)
        raise ProfileError(f"{exc} (the keys it does not set come from {where})") from None


def _validated(data: dict, file: str, lineage: tuple[str, ...]) -> Profile:
    """The :class:`Profile` of a mapping its bases are merged into (``lineage``: their names)."""
    hints = _hints()
    fields = {f.name: f for f in dataclasses.fields(Profile) if f.name not in NOT_KEYS}
    for key in data:
        if key not in fields:
            raise ProfileError(f"{file}: unknown key {key!r}: expected one of {', '.join(sorted(fields))}")
    missing = [n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ProfileError(f"{file}: missing key {missing[0]}: expected {type_name(hints[missing[0]])}")
    values = {k: convert(v, hints[k], k, file) for k, v in data.items()}
    stem = Path(file).name.removesuffix(".yaml")
    if file.endswith(".yaml") and values["name"] != stem:
        raise ProfileError(f"{file}: key name: expected {stem!r} (the file name), found {values['name']!r}")
    profile = Profile(**values, source=file, lineage=(values["name"], *lineage))
    _check_values(profile, file)
    tile_checks.check_profile(profile, file)
    return profile


NOT_KEYS = ("source", "lineage")  # Profile fields that are not YAML keys
NOT_INHERITED = ("name", "description", "extends")  # with every match_* key: what a base does not pass on


def _with_bases(data: dict, file: str, seen: tuple[str, ...] = ()) -> tuple[dict, tuple[str, ...]]:
    """(``data`` over the keys of the profile it ``extends`` and of that one's bases, the names of
    those bases nearest first); ``data`` and no bases where it extends none. A base is found by
    name as :func:`load_profile` finds it (a user file over the shipped one)."""
    base = data.get("extends")
    if base is None:
        return data, ()
    available = available_profiles()
    if not isinstance(base, str) or base not in available:
        raise ProfileError(f"{file}: key extends: expected the name of a profile ({', '.join(available)}), "
                           f"found {base!r}")
    if base in seen or base == data.get("name"):
        raise ProfileError(f"{file}: key extends: {base!r} extends itself through "
                           f"{' -> '.join((*seen, str(data.get('name')), base))}")
    path = available[base]
    parent = read_yaml(path)
    if not isinstance(parent, Mapping):
        raise ProfileError(f"{path}: expected a mapping of keys at the top level, found {type(parent).__name__}")
    parent, bases = _with_bases(_without_obsolete(parent, path), path, (*seen, str(data.get("name"))))
    merged = {k: v for k, v in parent.items() if k not in NOT_INHERITED and not k.startswith("match_")}
    for key, value in data.items():
        if key == "tiles" and isinstance(value, Mapping) and isinstance(merged.get("tiles"), Mapping):
            tiles = dict(merged["tiles"])
            for family, entries in value.items():
                below = tiles.get(family)
                tiles[family] = {**below, **entries} if isinstance(below, Mapping) and isinstance(entries, Mapping) \
                    else entries
            merged["tiles"] = tiles
        else:
            merged[key] = value
    return merged, (base, *bases)


def _without_obsolete(data: Mapping, file: str) -> dict:
    """``data`` without the obsolete keys; one still holding what the runtime does is dropped with
    a warning, one asking for something else is a ProfileError (it would be silently ignored)."""
    out = dict(data)
    for key, (allowed, why) in OBSOLETE.items():
        if key not in out:
            continue
        value = out.pop(key)
        ok = value == allowed if allowed is not None else value in COMPUTE
        if not ok:
            expected = repr(allowed) if allowed is not None else "one of " + ", ".join(map(repr, COMPUTE))
            raise ProfileError(f"{file}: key {key}: expected {expected} (the key is obsolete: {why}; delete it), "
                               f"found {value!r}")
        log.warning("flashrt: %s: key %s is obsolete and ignored (%s); delete it", file, key, why)
    return out


def load_profile_file(path) -> Profile:
    path = str(path)
    return profile_from_mapping(read_yaml(path), path)


def user_profile_dir() -> Path:
    env = os.environ.get("FLASHRT_PROFILE_DIR")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "flashrt" / "profiles"


def available_profiles() -> dict[str, str]:
    """Profile name -> file; a user file overrides the shipped one of the same name."""
    root = resources.files("flashrt.hwconfigs")
    found = {p.name.removesuffix(".yaml"): str(p) for p in root.iterdir() if p.name.endswith(".yaml")}
    user = user_profile_dir()
    if user.is_dir():
        found.update({p.stem: str(p) for p in sorted(user.glob("*.yaml"))})
    return dict(sorted(found.items()))


def load_profile(name_or_path: str) -> Profile:
    """A profile by name (user dir, then shipped) or by path to a YAML file."""
    available = available_profiles()
    if name_or_path in available:
        return load_profile_file(available[name_or_path])
    if name_or_path.endswith((".yaml", ".yml")) or os.sep in name_or_path:
        return load_profile_file(Path(name_or_path).expanduser())
    raise ProfileError(f"unknown profile {name_or_path!r}: available {', '.join(available)} "
                       f"(or a path to a .yaml file; user profiles in {user_profile_dir()})")


_WARNED: set[str] = set()


def load_all(facts: DeviceFacts | None = None) -> list[Profile]:
    """Every available profile that loads. A file that does not is skipped with a warning (once
    per process; :func:`broken_profiles` lists them), unless its match keys select the device of
    ``facts``: then it was meant for this device and its error is raised."""
    out = []
    for path in available_profiles().values():
        try:
            out.append(load_profile_file(path))
        except ProfileError as exc:
            if facts is not None and _meant_for(path, facts):
                raise ProfileError(f"{exc} (the profile matches this device, {facts.describe()}: fix it, "
                                   f"or pass --profile / FLASHRT_PROFILE)") from None
            if str(exc) not in _WARNED:
                _WARNED.add(str(exc))
                log.warning("flashrt: profile skipped: %s", exc)
    return out


def broken_profiles() -> dict[str, str]:
    """File -> error of each available profile that does not load (``flashrt doctor`` lists them)."""
    out = {}
    for path in available_profiles().values():
        try:
            load_profile_file(path)
        except ProfileError as exc:
            out[path] = str(exc)
    return out


def _meant_for(path: str, facts: DeviceFacts) -> bool:
    """Whether the match keys of a profile file that does not load select ``facts``."""
    try:
        data = read_yaml(path)
    except ProfileError:
        return False
    return mapping_matches(data, facts, _hints(), path)


_ACTIVE: tuple[Profile, str] | None = None


def select_profile(device=None, facts: DeviceFacts | None = None, override: str | None = None) -> tuple[Profile, str]:
    """(profile, why): ``override`` or ``FLASHRT_PROFILE`` if set, else the best match for the device."""
    override = override or os.environ.get("FLASHRT_PROFILE") or None
    if override:
        profile = load_profile(override)
        why = f"explicit profile {override!r} (--profile / FLASHRT_PROFILE) from {profile.source}"
        facts = facts or detect_device(device)
        if match_reasons(profile, facts) is None:
            why += f"; note: it does not match the detected device {facts.describe()}"
        return profile, why
    facts = facts or detect_device(device)
    return match_profile(facts, load_all(facts))


def active_profile() -> Profile:
    """The profile chosen for this process (selected once, then cached)."""
    return active_selection()[0]


def active_selection() -> tuple[Profile, str]:
    global _ACTIVE
    if _ACTIVE is None:
        _ACTIVE = select_profile()
    return _ACTIVE


def use_profile(profile: Profile | str | None) -> Profile | None:
    """Make ``profile`` (a Profile, name or path) active; None goes back to automatic selection."""
    global _ACTIVE
    if profile is None:
        _ACTIVE = None
        return None
    if isinstance(profile, str):
        profile = load_profile(profile)
    _ACTIVE = (profile, f"use_profile({profile.name!r})")
    return profile


@contextlib.contextmanager
def using(profile: Profile | str):
    """``profile`` active inside the block; the previous choice comes back after it."""
    global _ACTIVE
    saved = _ACTIVE
    try:
        yield use_profile(profile)
    finally:
        _ACTIVE = saved


def tiles(module: str, defaults: Mapping | None = None) -> dict:
    """The tile parameters of kernel family ``module``: its tile defaults (``defaults``, the
    family's ``TILES``) with the active profile's ``tiles.<module>`` merged over them. Kernels read
    it through their ``PlanCache`` (``kernels_cuda/launch.py``). Cached per active profile, so a
    launcher may call it on every launch; treat the result as read-only. A profile entry
    ``defaults`` lacks, or of another shape or type, is a ProfileError naming the key."""
    profile = _ACTIVE[0] if _ACTIVE is not None else active_profile()  # (inlined: once per launch)
    hit = _TILES_CACHE.get((module, id(defaults)))
    if hit is None or hit[0] is not profile or hit[1] is not defaults:
        given = profile.tiles.get(module)
        if given is None and defaults is None:
            raise ProfileError(f"{profile.source}: key tiles.{module}: missing (profile {profile.name!r} "
                               f"has tiles for {', '.join(sorted(profile.tiles)) or 'no kernel module'})")
        where = f"tiles.{module}"
        merged = dict(given) if defaults is None else tile_checks.merge(defaults, given or {}, where, profile)
        hit = _TILES_CACHE[module, id(defaults)] = (profile, defaults, merged)
    return hit[2]


_TILES_CACHE: dict[tuple, tuple] = {}  # (module, id(defaults)) -> (profile, defaults, merged)
