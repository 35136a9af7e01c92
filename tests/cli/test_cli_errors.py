"""The command line on bad input: one `flashrt CMD: error: ...` line and exit 2, never a traceback
(``--debug`` prints it); an unexpected exception is one line with a hint and exit 1; the prompt
and the seeds mean what they say."""
import io
import json
import os
import re
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch

from flashrt import profiles
from flashrt.cli import commands


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(autouse=True)
def _env(monkeypatch, cache_dir):
    monkeypatch.setenv("FLASHRT_CACHE_DIR", str(cache_dir))
    monkeypatch.delenv("FLASHRT_PROFILE", raising=False)
    monkeypatch.delenv("FLASHRT_DEBUG", raising=False)
    threads = torch.get_num_threads()
    profiles.use_profile(None)
    yield
    torch.set_num_threads(threads)
    profiles.use_profile(None)


def cli(*args) -> tuple[object, str, str]:
    """(exit code, stdout, stderr) of ``flashrt ARGS`` in this process; an exception that escapes
    main is returned as the code (a failure for every test below)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = commands.main(list(args))
        except SystemExit as exc:
            code = exc.code
        except BaseException as exc:  # noqa: BLE001 (what the user would see as a traceback)
            code = f"escaped: {type(exc).__name__}: {exc}"
    return code, out.getvalue(), err.getvalue()


def assert_one_line_error(code, err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2, (code, err)
    assert len(lines) == 1 and lines[0].startswith("flashrt") and ": error: " in lines[0], err
    assert "Traceback" not in err and all(n in lines[0] for n in needles), (needles, err)


def test_an_empty_prompt_is_an_error_not_the_default_prompt():
    code, out, err = cli("run", "--prompt", "", "--max-new-tokens", "1", "--json")
    assert_one_line_error(code, err, "--prompt", "non-empty")
    assert out == ""


def test_a_prompt_longer_than_the_context_is_an_error_with_the_limits():
    # the prompt's token count is the tokenizer's (BOS included), at least one token per 4 bytes here
    code, _, err = cli("run", "--prompt", "a" * 4097 * 4, "--max-new-tokens", "1")
    assert_one_line_error(code, err, "exceed the context", "4096", "at most 4095")
    code, _, err = cli("run", "--prompt", "a" * 4090 * 4, "--max-new-tokens", "16")
    assert_one_line_error(code, err, "16 new tokens", "4096", "at most 4080")


def run_json(*args) -> dict:
    code, out, err = cli("run", "--json", "--max-new-tokens", "4", "--prompt", "seeds", *args)
    assert code == 0, err
    return json.loads(out)


def test_seed_seeds_sampling_only_and_weights_seed_picks_the_built_in_weights(cache_dir):
    base = run_json()
    assert run_json("--seed", "7")["new_token_ids"] == base["new_token_ids"]  # greedy: same weights
    assert sorted(p.name for p in (cache_dir / "models").iterdir()) == ["tiny-seed0"]
    hot = [run_json("--seed", s, "--temperature", "1.5")["new_token_ids"] for s in ("1", "1", "2")]
    assert hot[0] == hot[1]  # the sampling seed still decides the samples
    assert sorted(p.name for p in (cache_dir / "models").iterdir()) == ["tiny-seed0"]
    run_json("--weights-seed", "3")
    assert sorted(p.name for p in (cache_dir / "models").iterdir()) == ["tiny-seed0", "tiny-seed3"]


BAD = [
    (("run", "--threads", "-3"), "--threads"),
    (("run", "--threads", "0"), "--threads"),
    (("run", "--threads", "two"), "--threads"),
    (("run", "--device", "tpu"), "--device"),
    (("run", "--device", "cuda:x"), "--device"),
    (("run", "--device", ""), "--device"),
    (("run", "--device", "cuda:99"), "--device"),
    (("run", "--device", "npu:99"), "--device"),
    (("run", "--max-new-tokens", "0"), "--max-new-tokens"),
    (("run", "--temperature", "-1"), "--temperature"),
    (("run", "--temperature", "nan"), "--temperature"),
    (("run", "--temperature", "inf"), "--temperature"),
    (("run", "--seed", "-1"), "--seed"),
    (("run", "--seed", str(2**64)), "--seed"),
    (("run", "--weights-seed", "-5"), "--weights-seed"),
    (("run", "--kv-budget", "-5"), "--kv-budget"),
    (("run", "--kv-budget", "0"), "--kv-budget"),
    (("run", "--prefill-chunk", "0"), "--prefill-chunk"),
    (("run", "--prefix-cache", ""), "--prefix-cache"),
    (("run", "--model", ""), "--model"),
    (("run", "--backend", ""), "backend"),
    (("run", "--prefill", "fast"), "--prefill"),
    (("plan", "--context", "0"), "--context"),
    (("plan", "--context", "-5"), "--context"),
    (("plan", "--memory-gib", "nan"), "--memory-gib"),
    (("plan", "--memory-gib", "0"), "--memory-gib"),
    (("plan", "--memory-gib", "-1"), "--memory-gib"),
    (("plan", "--memory-utilization", "0"), "--memory-utilization"),
    (("plan", "--memory-utilization", "1.5"), "--memory-utilization"),
    (("plan", "--memory-utilization", "nan"), "--memory-utilization"),
    (("plan", "--profile", "nope"), "nope"),
    (("conformance", "--device", "tpu"), "--device"),
    (("conformance", "--device", "cuda:99"), "--device"),
    (("conformance", "--seed", "-1"), "--seed"),
    (("tune", "--out", os.devnull, "--budget", "nan"), "--budget"),
    (("tune", "--out", os.devnull, "--budget", "-1"), "--budget"),
    (("tune", "--out", "", "--budget", "1"), "--out"),
    (("jit", "warmup", "--shapes", "huge"), "--shapes"),
    (("bench", "kernels", "--families", "nope"), "--families"),
    (("bench", "serve", "--base-url", "http://127.0.0.1:9", "--concurrency", "1"), "base_url"),
    (("bench", "serve", "--concurrency", "0"), "--concurrency"),
    (("--profile", "nope", "run"), "nope"),
]


@pytest.mark.parametrize("args, needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_option_values_are_one_line_errors(args, needle):
    code, out, err = cli(*args)
    assert_one_line_error(code, err, needle)


def test_cuda_graphs_on_a_cpu_device_are_an_error():
    code, _, err = cli("run", "--device", "cpu", "--cuda-graph", "--max-new-tokens", "1")
    assert_one_line_error(code, err, "cuda_graph", "cpu")


def test_an_unexpected_failure_is_one_line_with_a_hint_and_debug_prints_the_traceback(monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(commands, "doctor_report", boom)
    code, _, err = cli("doctor")
    assert code == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "flashrt doctor: internal error: RuntimeError: boom" in err and "--debug" in err
    for args in (("--debug", "doctor"), ("doctor", "--debug")):
        code, _, err = cli(*args)
        assert code == 1 and "Traceback" in err and "RuntimeError: boom" in err
    code, _, err = cli("--debug", "run", "--threads", "0")  # an expected failure: still no traceback
    assert_one_line_error(code, err, "--threads")


def test_interrupt_is_one_line(monkeypatch):
    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "doctor_report", stop)
    code, _, err = cli("doctor")
    assert code == 130 and err.strip() == "flashrt doctor: interrupted"


def test_bad_values_in_a_fresh_process(tmp_path):
    for args in (["run", "--device", "tpu"], ["run", "--threads", "-3"], ["--profile", "nope", "plan"]):
        r = subprocess.run([sys.executable, "-m", "flashrt.cli", *args], capture_output=True, text=True,
                           cwd="/", env=os.environ | {"FLASHRT_CACHE_DIR": str(tmp_path)})
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "Traceback" not in r.stderr and ": error: " in r.stderr


def test_serve_switch_interval_env_is_checked(rng):
    from flashrt.cli.serve import SWITCH_INTERVAL_MS, switch_interval_s

    assert switch_interval_s(None) == SWITCH_INTERVAL_MS / 1e3
    ms = float(torch.empty(1).uniform_(0.01, 1000, generator=rng))
    assert abs(switch_interval_s(repr(ms)) - ms / 1e3) < 1e-12
    for bad in ("0", "-1", "abc", "nan", "inf", "1e9", ""):
        with pytest.raises(ValueError, match="FLASHRT_SWITCH_INTERVAL_MS.*" + re.escape(repr(bad))):
            switch_interval_s(bad)
