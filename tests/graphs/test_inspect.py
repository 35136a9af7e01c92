"""`flashrt inspect PATH`: the report on a published-layout and a flashrt-layout directory, broken
directories, the JSON form and the command line."""
import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import save_file

from flashrt.errors import CheckpointError
from flashrt.graphs import checkpoint
from flashrt.graphs.inspect import inspect
from flashrt.graphs.params import param_specs
from flashrt.graphs.plan import stored_bytes
from published_layout import published_tensors, with_vision, wo_a_as_converted, write_published


@pytest.fixture(scope="module")
def dirs(cfg, weights, tmp_path_factory):
    root = tmp_path_factory.mktemp("inspect")
    pub = write_published(weights, with_vision(cfg), root / "published")
    (pub / "README.md").write_text("model card")
    (pub / "inference" / "model.py").write_text("# reference code")
    ours = checkpoint.save(wo_a_as_converted(weights), cfg, root / "ours", max_shard_bytes=256 << 10)
    return pub, ours


def test_published_report(dirs, cfg, weights):
    r = inspect(dirs[0])
    tensors = published_tensors(weights, with_vision(cfg))
    assert r["ok"] and r["layout"].startswith("published")
    assert r["tensors"]["count"] == len(tensors)
    assert r["tensors"]["bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
    by_dtype = r["tensors"]["by_dtype"]
    assert by_dtype["I8"]["count"] == 3 * (8 * 8 + 4)  # w1, w2, w3 of the routed experts (8 layers x 8 + draft 4)
    assert sum(v["count"] for v in by_dtype.values()) == len(tensors)
    assert sum(v["bytes"] for v in r["tensors"]["by_role"].values()) == r["tensors"]["bytes"]
    vision = [n for n in tensors if n.startswith(("vision.", "aligner.", "image_")) or n.endswith("bias_vl")]
    assert r["ignored"]["count"] == len(vision) == r["tensors"]["by_role"]["vision (not loaded)"]["count"]
    assert r["converted"]["count"] == cfg.n_layers + cfg.n_mtp_layers  # one wo_a per block
    assert r["files"]["not_used"] == ["README.md", "inference/model.py"] and r["files"]["missing"] == []
    assert r["config"]["special_tokens"] == {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
    assert r["config"]["vision_n_layers"] == 2
    assert any("ignored: 35 tensors" in line for line in r["lines"])


def test_flashrt_layout_report_and_fit(dirs, cfg):
    r = inspect(dirs[1])
    assert r["ok"] and r["layout"].startswith("flashrt") and r["ignored"]["count"] == 0
    assert r["converted"]["count"] == 0 and len([f for f in r["files"]["used"] if f.endswith(".safetensors")]) > 1
    fit = r["fit"]
    assert fit["weights_bytes"] == sum(stored_bytes(s) for s in param_specs(cfg)) and fit["fits"]
    huge = inspect(dirs[1], context=2**31 - 1)["fit"]  # a 2G-token sequence does not fit a test machine
    assert huge["sequences"] == 0 and not huge["fits"]


def test_missing_shard_and_unexpected_tensor(dirs, tmp_path):
    import shutil

    path = tmp_path / "p"
    shutil.copytree(dirs[0], path)
    victim = sorted(path.glob("model-*.safetensors"))[0]
    victim.unlink()
    r = inspect(path)
    assert not r["ok"] and r["files"]["missing"] == [victim.name] and r["missing_tensors"]
    shutil.rmtree(path)
    shutil.copytree(dirs[1], path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    import torch

    save_file({"layers.0.attn.bogus": torch.zeros(3)}, str(path / "extra.safetensors"))
    index["weight_map"]["layers.0.attn.bogus"] = "extra.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    r = inspect(path)
    assert not r["ok"] and r["unexpected_tensors"] == ["layers.0.attn.bogus"] and not r["missing_tensors"]


def test_bad_input(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        inspect(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"dim": "64"}))
    with pytest.raises(CheckpointError, match="'dim'"):
        inspect(tmp_path)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "flashrt.cli", "inspect", *map(str, args)], capture_output=True,
                          text=True, cwd="/", env={**os.environ})


def test_command_line(dirs, tmp_path, capsys):
    from flashrt.cli.commands import main

    r = _cli(dirs[0])  # a fresh process, as a user runs it
    assert r.returncode == 0 and "published" in r.stdout and "fits" in r.stdout and "ignored: 35" in r.stdout
    assert main(["inspect", str(dirs[0]), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["tensors"]["count"] > 0 and "lines" not in data
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flashrt inspect: error:") and "Traceback" not in err
    assert main(["inspect", str(dirs[0]), "--context", "0"]) == 2 and "context" in capsys.readouterr().err
