"""Fuzzing every command's options (hypothesis): no traceback, and no invalid value accepted.

Each option has values that must work here and values that must be refused, written out below
(not derived from the parser). An example draws some options of one command, each valid or not,
and runs ``flashrt.cli.commands.main`` in this process: with any invalid value it must exit 2 with
a last stderr line ``flashrt ...: error: ...`` naming one of the invalid options; with none it must
succeed. Nothing may escape ``main`` and stderr never holds a traceback. The slow work behind a
few commands is cut short (conformance checks two ops, tune times no candidate).
"""
from __future__ import annotations

import io
import itertools
import json
import os
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from flashrt import profiles
from flashrt.cli import commands

FUZZ = settings(max_examples=25, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # no shrinking: slow here
FLAG = st.just(None)  # an option without a value
GARBAGE = st.text(alphabet="abx.-_ ", max_size=4)  # never a number
SEEDS_BAD = st.one_of(st.integers(max_value=-1), st.integers(min_value=2**63)).map(str) | GARBAGE
NUM_BAD = st.sampled_from(["nan", "inf", "-inf", "1e400"]) | GARBAGE


def ints(low, high):
    return st.integers(low, high).map(str)


def floats(low, high):
    return st.floats(low, high, allow_nan=False).map(repr)


def nonpositive_ints():
    return st.integers(max_value=0).map(str) | GARBAGE


def options(**table):
    """``--name-with-dashes`` -> (valid strategy or None, invalid strategy or None)."""
    return {"--" + name.replace("_", "-"): value for name, value in table.items()}


NO_CUDA = not torch.cuda.is_available()
DEVICES_BAD = st.sampled_from(["tpu", "", "gpu", "cuda:x", "cuda:99", "cpu:", "npu:99"]
                              + (["cuda", "cuda:0"] if NO_CUDA else []))

RUN = options(
    prompt=(st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=16), st.just("")),
    max_new_tokens=(ints(1, 3), nonpositive_ints()),
    temperature=(floats(0.0, 2.0), st.floats(max_value=-1e-9).map(repr) | NUM_BAD),
    seed=(ints(0, 2**63 - 1), SEEDS_BAD),
    weights_seed=(st.just("0"), SEEDS_BAD),
    threads=(ints(1, 2), nonpositive_ints()),
    device=(st.just("cpu"), DEVICES_BAD),
    prefill=(st.sampled_from(["exact", "ced"]), st.sampled_from(["fast", "", "EXACT"])),
    kv_budget=(ints(10**8, 10**9), nonpositive_ints() | st.sampled_from(["5", "1000"])),
    prefill_chunk=(ints(8, 64), nonpositive_ints()),
    backend=(st.just("reference"), st.sampled_from(["", "nope", "Reference"])),
    model=(st.just("tiny"), st.sampled_from(["", "nope", "v4.1-flash", "/nonexistent"])),
    prefix_cache=(st.just("PREFIX_DIR"), st.just("")),
    cuda_graph=(None if NO_CUDA else FLAG, FLAG if NO_CUDA else None),
    json=(FLAG, None),
)
PLAN = options(
    model=(st.just("tiny"), st.sampled_from(["", "bogus", "/nonexistent"])),
    context=(ints(1, 4096), nonpositive_ints()),
    profile=(st.sampled_from(["cpu", "h200", "rtx4090"]), st.sampled_from(["", "nope", "/nonexistent.yaml"])),
    memory_gib=(floats(0.5, 1024.0), st.floats(max_value=0.0).map(repr) | NUM_BAD),
    memory_utilization=(floats(0.01, 1.0), st.sampled_from(["0", "-0.5", "1.01", "2"]) | NUM_BAD),
    json=(FLAG, None),
)
CONFORMANCE = options(device=(st.just("cpu"), DEVICES_BAD), seed=(ints(0, 2**63 - 1), SEEDS_BAD),
                      out=(st.just("OUT_FILE"), st.just("")))
TUNE = options(out=(st.just("OUT_FILE"), st.just("")),
               kernels=(st.sampled_from(["attention", "linear_decode"]).map(lambda k: [k]),
                        st.sampled_from([["nope"], ["attention", "bogus"]])),
               budget=(floats(0.5, 100.0), st.floats(max_value=0.0).map(repr) | NUM_BAD))
WARMUP = options(shapes=(st.sampled_from([["tiny"], ["small", "tiny"]]), st.sampled_from([["huge"], ["tiny", "x"]])),
                 profile=(st.just("cpu"), st.sampled_from(["", "nope"])), json=(FLAG, None))
COMMANDS = {("run",): RUN, ("plan",): PLAN, ("conformance",): CONFORMANCE, ("tune",): TUNE,
            ("jit", "warmup"): WARMUP, ("doctor",): options(json=(FLAG, None)),
            ("jit", "ls"): options(json=(FLAG, None)), ("jit", "clear"): options(yes=(FLAG, None)),
            ("bench", "kernels"): options(families=(st.just(["gemm"]), st.just(["nope"])),
                                          out=(st.just("OUT_FILE"), st.just("")))}
GLOBAL = options(profile=(st.just("cpu"), st.sampled_from(["", "nope", "/nonexistent.yaml"])))
REQUIRED = {("tune",): ["--out"], ("jit", "clear"): ["--yes"]}  # always given (their absence is tested apart)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")  # the tiny model's weights are made once


@pytest.fixture(autouse=True)
def _fast_and_isolated(monkeypatch, tmp_path, cache_dir):
    import flashrt.conformance as conformance
    import flashrt.tune as tune

    monkeypatch.setenv("FLASHRT_CACHE_DIR", str(cache_dir))
    monkeypatch.setenv("FLASHRT_PROFILE_DIR", str(tmp_path / "user-profiles"))
    monkeypatch.delenv("FLASHRT_PROFILE", raising=False)
    cases = conformance._cases
    monkeypatch.setattr(conformance, "_cases", lambda dev, g: itertools.islice(cases(dev, g), 2))

    def no_timing(name, *args):
        sp = tune.SPACES[name]
        return {"name": name, "module": sp.module, "key": sp.key, "rule": sp.rule, "winner": None,
                "candidates": 0, "notes": []}

    monkeypatch.setattr(tune, "tune_kernel", no_timing)


_OUT_FILES = itertools.count()


def draw_args(data, command: tuple, table: dict, tmp_path) -> tuple[list[str], set[str]]:
    """An argument list for ``command`` and the options in it given invalid values."""
    argv, invalid = [], set()
    names = sorted(table)
    chosen = data.draw(st.lists(st.sampled_from(names), unique=True, max_size=4), label="options")
    chosen = sorted(set(chosen) | set(REQUIRED.get(command, ())))
    for name in chosen:
        valid, bad = table[name]
        use_bad = bad is not None and (valid is None or data.draw(st.integers(0, 3), label="bad?") == 0)
        value = data.draw(bad if use_bad else valid, label=name)
        if use_bad:
            invalid.add(name)
        if value is None:
            argv.append(name)
        elif isinstance(value, list):
            argv += [name, *value]
        else:
            # a valid --out is a new file (another command's earlier output there is refused: core/out_files.py)
            fresh = str(tmp_path / f"out-{next(_OUT_FILES)}.txt")
            value = {"PREFIX_DIR": str(tmp_path / "prefix"), "OUT_FILE": fresh}.get(value, value)
            argv.append(f"{name}={value}")
    return argv, invalid


def run_main(argv: list[str]) -> tuple[object, str, str]:
    out, err = io.StringIO(), io.StringIO()
    env, threads = dict(os.environ), torch.get_num_threads()
    try:
        with redirect_stdout(out), redirect_stderr(err), profiles.using(profiles.active_profile()):
            try:
                code = commands.main(argv)
            except SystemExit as exc:
                code = exc.code
            except BaseException as exc:  # noqa: BLE001 (escaping main: the user sees a traceback)
                code = f"escaped main: {type(exc).__name__}: {exc}"
    finally:
        os.environ.clear()
        os.environ.update(env)
        torch.set_num_threads(threads)
    return code, out.getvalue(), err.getvalue()


def names_one_of(line: str, invalid: set[str]) -> bool:
    return any(n in line or n.lstrip("-").replace("-", "_") in line or n.lstrip("-") in line for n in invalid)


def check(command: tuple, argv: list[str], invalid: set[str]) -> None:
    event("invalid" if invalid else "valid")
    code, out, err = run_main(argv)
    assert "Traceback" not in err, (argv, err)
    last = (err.strip().splitlines() or [""])[-1]
    if command == ("doctor",) and invalid == {"--profile"} and code == 1:  # doctor reports a bad profile
        reported = json.loads(out)["profiles"]["error"] if "--json" in argv else "profile: error: " in out
        assert reported, (argv, out)
    elif invalid:
        assert code == 2, f"{argv}: accepted the invalid {sorted(invalid)} (exit {code!r})\n{err}"
        assert last.startswith("flashrt") and ": error: " in last, (argv, err)
        assert names_one_of(last, invalid), f"{argv}: the error names none of {sorted(invalid)}: {last}"
    elif command == ("bench", "kernels") and NO_CUDA:
        assert code == 2 and "CUDA" in last, (argv, err)  # the suite times CUDA kernels: refused here
    else:
        assert code == 0, f"{argv}: valid options refused (exit {code!r})\n{err}"


@pytest.mark.slow
@settings(FUZZ, max_examples=15)
@given(data=st.data())
def test_fuzz_run(data, tmp_path):
    argv, invalid = draw_args(data, ("run",), RUN, tmp_path)
    check(("run",), ["run", *argv], invalid)


@FUZZ
@given(data=st.data(), command=st.sampled_from(sorted(set(COMMANDS) - {("run",)})))
def test_fuzz_other_commands(data, command, tmp_path):
    glob, glob_bad = draw_args(data, (), GLOBAL, tmp_path) if data.draw(st.booleans(), label="global") else ([], set())
    argv, invalid = draw_args(data, command, COMMANDS[command], tmp_path)
    check(command, [*glob, *command, *argv], invalid | glob_bad)
