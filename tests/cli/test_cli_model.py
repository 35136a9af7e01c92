"""`flashrt run` (the README's first command) and `flashrt plan` in fresh processes."""
import json
import os
import re
import subprocess
import sys
import time

import pytest

from flashrt.graphs.tokenizer import Tokenizer


def flashrt(*args, env=None, check=True):
    return subprocess.run([sys.executable, "-m", "flashrt.cli", *args], capture_output=True, text=True,
                          check=check, env={**os.environ, **(env or {})}, cwd="/")


def test_run_creates_then_reuses_the_tiny_checkpoint(tmp_path):
    env = {"FLASHRT_CACHE_DIR": str(tmp_path)}
    first = json.loads(flashrt("run", "--json", "--max-new-tokens", "6", env=env).stdout)
    ckpt = tmp_path / "models" / "tiny-seed0"
    assert (ckpt / "config.json").exists() and (ckpt / "SHA256SUMS").exists()
    mtime = (ckpt / "config.json").stat().st_mtime
    t0 = time.perf_counter()
    second = json.loads(flashrt("run", "--json", "--max-new-tokens", "6", env=env).stdout)
    wall = time.perf_counter() - t0
    assert (ckpt / "config.json").stat().st_mtime == mtime  # loaded, not re-created
    assert first["new_token_ids"] == second["new_token_ids"] and len(first["new_token_ids"]) == 6
    tok = Tokenizer.from_dir(ckpt)  # the built-in BPE, written with the weights
    assert first["device"] == "cpu" and first["prompt_tokens"] == len(tok.encode(first["prompt"]))
    assert first["new_text"] == tok.decode(first["new_token_ids"]) and first["tokenizer"].startswith(str(ckpt))
    assert set(first["backend_per_op_family"].values()) == {"reference"}
    assert first["kv_bytes_per_token"] > 0 and first["peak_memory_bytes"] > 0
    assert first["prefill_tokens_per_s"] > 0 and first["decode_tokens_per_s"] > 0
    # time to first token: loading + prefill <= from the start of loading <= from the process start < wall
    r = second
    assert 0 < r["prefill_seconds"] and r["load_seconds"] + r["prefill_seconds"] <= r["ttft_from_load_s"]
    assert r["ttft_from_load_s"] < r["ttft_from_process_start_s"] < wall
    assert r["ttft_from_process_start_s"] - r["ttft_from_load_s"] > 0.1  # python + torch imports
    # the time before loading, in parts that add up to it (to the process clock's 10 ms ticks)
    parts = r["startup_seconds"]
    assert set(parts) == {"process_to_run", "checks_and_device", "pool_fork", "profile_and_pool_start"}
    assert all(v >= 0 for v in parts.values()) and parts["process_to_run"] > 0.1
    assert abs(sum(parts.values()) - (r["ttft_from_process_start_s"] - r["ttft_from_load_s"])) < 0.05


def test_run_text_report_and_options(tmp_path):
    out = flashrt("run", "--prompt", "hello", "--max-new-tokens", "3", "--prefill", "ced", "--temperature", "0.7",
                  "--seed", "5", env={"FLASHRT_CACHE_DIR": str(tmp_path)}).stdout
    for needle in ("model tiny", "backends:", "tokenizer: ", "new (3 tokens)", "tok/s", "B/token", "peak memory",
                   "first token"):
        assert needle in out
    assert re.search(r"prompt \(\d+ tokens\): 'hello'", out)


def test_run_chat_prints_decoded_text(tmp_path):
    env = {"FLASHRT_CACHE_DIR": str(tmp_path)}
    args = ("run", "--chat", "你好 😀", "--system", "Be brief.", "--max-new-tokens", "5", "--effort", "max")
    out = flashrt(*args, env=env).stdout
    report = json.loads(flashrt(*args, "--json", env=env).stdout)
    tok = Tokenizer.from_dir(tmp_path / "models" / "tiny-seed0")
    text = tok.decode(report["new_token_ids"])
    assert report["new_text"] == text and report["prompt"] is None
    assert report["chat"] == {"system": "Be brief.", "user": "你好 😀", "thinking": True, "effort": 100}
    assert f"new ({report['new_tokens']} tokens): {text!r}" in out
    assert "chat (" in out and "thinking, effort 100): system 'Be brief.', user '你好 😀'" in out
    assert "reasoning: " in out and "answer: " in out
    assert report["message"]["role"] == "assistant"
    r = flashrt("run", "--chat", "hi", "--effort", "huge", env=env, check=False)
    assert r.returncode == 2 and "effort: expected" in r.stderr and "Traceback" not in r.stderr
    r = flashrt("run", "--system", "S", env=env, check=False)
    assert r.returncode == 2 and "system: a system prompt needs --chat" in r.stderr


def test_run_with_a_prefix_cache_hits_on_the_second_run(tmp_path):
    """--prefix-cache DIR: the first run stores the prompt's aligned prefix, the second loads it
    (its stored state, no replay) and continues with the same tokens."""
    env = {"FLASHRT_CACHE_DIR": str(tmp_path / "c")}
    prompt = "a long prompt about foxes and dogs " * 5  # 175 bytes: two 64-token pages to cache
    args = ("run", "--json", "--prompt", prompt, "--max-new-tokens", "4", "--prefix-cache", str(tmp_path / "pc"))
    first = json.loads(flashrt(*args, env=env).stdout)
    second = json.loads(flashrt(*args, env=env).stdout)
    assert first["prefix_cache"]["hits"] == 0 and second["prefix_cache"]["hits"] == 1
    assert any((tmp_path / "pc").rglob("*.kv"))
    assert len(second["new_token_ids"]) == 4


def test_caches_take_their_ttl_and_size_from_the_profile(tmp_path):
    from flashrt import profiles
    from flashrt.kv.prefix_cache import PrefixCache
    from flashrt.kv.window_pool import WindowPool

    p = profiles.load_profile("h200")
    cache, pool = PrefixCache.for_profile(tmp_path, p), WindowPool.for_profile(p)
    assert cache.ttl_s == p.hkcp_prefix_ttl_hours * 3600 and cache.max_bytes == p.persistent_disk_bytes
    assert pool.ttl_s == p.hkcp_window_pool_ttl_minutes * 60


def test_run_bad_input_is_one_clear_line(tmp_path):
    env = {"FLASHRT_CACHE_DIR": str(tmp_path)}
    r = flashrt("run", "--backend", "nope", env=env, check=False)
    assert r.returncode == 2 and "backend 'nope' is not registered" in r.stderr and "Traceback" not in r.stderr
    r = flashrt("run", "--model", str(tmp_path / "missing"), env=env, check=False)
    assert r.returncode == 2 and "model:" in r.stderr


@pytest.mark.parametrize("model,kv", [("v4.1-flash", 890), ("deepseek-llm-67b", 389120)])
def test_plan_kv_bytes_per_token(model, kv):
    report = json.loads(flashrt("plan", "--model", model, "--json").stdout)
    assert report["kv_bytes_per_token"] == kv
    assert any(f"KV bytes per token: {kv:,}" in line for line in report["lines"])


def test_plan_v41_figures():
    report = json.loads(flashrt("plan", "--model", "v4.1-flash", "--json", "--context", "4096").stdout)
    assert 551.5e9 < report["params"]["backbone"] < 552.5e9
    assert report["window_state"]["rings_backbone"] == 40 * 128 * 528
    flops = {int(k): v for k, v in report["decode_flops"].items()}
    assert flops[1 << 20] > flops[4096] > 2 * 10e9  # at least 2 FLOPs per active weight
    assert report["active_params_prefill_ced"] < report["active_params_decode"]


def test_plan_uses_the_profile_memory():
    small = json.loads(flashrt("plan", "--model", "small", "--context", "65536", "--profile", "rtx4090", "--json").stdout)
    big = json.loads(flashrt("plan", "--model", "small", "--context", "65536", "--profile", "h200", "--json").stdout)
    assert 0 < small["sequences_fit"]["engram_device"] < big["sequences_fit"]["engram_device"]
    r = flashrt("plan", "--model", "small", "--profile", "nope", check=False)
    assert r.returncode == 2 and "nope" in r.stderr
