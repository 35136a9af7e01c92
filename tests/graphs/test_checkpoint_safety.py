"""What a load refuses and what a save cleans up: SHA256SUMS coverage and paths (verify=True),
NaN / Inf weights, and the leftovers of killed saves."""
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

import flashrt
from flashrt.errors import CheckpointError
from flashrt.graphs import checkpoint as ckpt
from flashrt.graphs import partial
from flashrt.graphs.verify import sha256_file
from published_layout import with_vision, write_published


@pytest.fixture(scope="module")
def saved(cfg, weights, tmp_path_factory):
    return ckpt.save(weights, cfg, tmp_path_factory.mktemp("safety") / "tiny")


def _copy(src, dst):
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _sums(path, names):
    (path / ckpt.SUMS).write_text("".join(f"{sha256_file(path / n)}  {n}\n" for n in names))


# ---- verify=True ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["../outside.txt", "/etc/hostname", "sub/../../outside.txt"])
def test_sums_name_outside_the_directory_is_rejected(saved, tmp_path, name):
    path = _copy(saved, tmp_path / "c")
    (tmp_path / "outside.txt").write_text("x")
    with open(path / ckpt.SUMS, "a") as f:
        f.write(f"{'0' * 64}  {name}\n")
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        ckpt.load(path, verify=True)


def test_symlink_out_is_rejected_by_verify(saved, tmp_path):
    path = _copy(saved, tmp_path / "c")
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(path / ckpt.SINGLE, outside)
    os.symlink(outside, path / ckpt.SINGLE)
    ckpt.load(path)  # a plain load follows links (a Hugging Face cache snapshot is made of them)
    with pytest.raises(CheckpointError, match="is a link to .*outside the checkpoint directory"):
        ckpt.load(path, verify=True)


def test_malformed_sums_line(saved, tmp_path):
    path = _copy(saved, tmp_path / "c")
    text = (path / ckpt.SUMS).read_text()
    (path / ckpt.SUMS).write_text("zz" + text[2:])
    with pytest.raises(CheckpointError, match="malformed line"):
        ckpt.load(path, verify=True)


@pytest.mark.parametrize("name", ["engram_token_map.json", "tokenizer.json", "tokenizer_config.json",
                                  "inference/config.json", "chat_template.jinja"])
def test_every_output_file_must_be_listed_and_match(saved, tmp_path, name):
    path = _copy(saved, tmp_path / "c")
    (path / name).parent.mkdir(exist_ok=True)
    (path / name).write_text(json.dumps(list(range(320))) if name.endswith("map.json") else "{}")
    extra = (name,) if name == "chat_template.jinja" else ()  # a caller's own output-deciding file
    listed = [l.split("  ", 1)[1] for l in (path / ckpt.SUMS).read_text().splitlines()]
    with pytest.raises(CheckpointError, match=f"{name}: not listed in SHA256SUMS"):
        ckpt.load(path, verify=True, verify_files=extra)
    _sums(path, listed + [name])
    ckpt.load(path, verify=True, verify_files=extra)
    (path / name).write_text("[0]" if name.endswith("map.json") else "{ }")
    with pytest.raises(CheckpointError, match=f"{name}: sha256 mismatch"):
        ckpt.load(path, verify=True, verify_files=extra)


def test_files_added_after_a_save_are_listed_by_add_to_sums(saved, tmp_path):
    from flashrt.graphs.verify import add_to_sums

    path = _copy(saved, tmp_path / "c")
    (path / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match="tokenizer.json: not listed"):
        ckpt.load(path, verify=True)
    add_to_sums(path, ["tokenizer.json"])
    ckpt.load(path, verify=True)
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        add_to_sums(path, ["../c/tokenizer.json"])


def test_published_dir_verifies_when_fully_listed(cfg, weights, tmp_path):
    path = write_published(weights, with_vision(cfg), tmp_path / "p")
    names = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    _sums(path, [n for n in names if n != "inference/config.json"])
    with pytest.raises(CheckpointError, match="inference/config.json: not listed"):
        flashrt.load(path, verify=True)
    _sums(path, names)
    assert flashrt.load(path, verify=True).cfg.vision_n_layers == 2


# ---- NaN / Inf ------------------------------------------------------------------------------------
def _spoil_fp8(t):
    t = t.clone().view(torch.uint8)
    t.view(-1)[5] = 0x7F  # E4M3FN NaN
    return t.view(torch.float8_e4m3fn)


def _spoil_e8m0(t):
    t = t.clone().view(torch.uint8)
    t.view(-1)[0] = 0xFF  # UE8M0 NaN
    return t.view(torch.float8_e8m0fnu)


def _spoil(value):
    def edit(t):
        t = t.clone()
        t.view(-1)[3] = value
        return t
    return edit


@pytest.mark.parametrize("name, edit", [
    ("norm.weight", _spoil(float("nan"))),
    ("layers.0.hc_attn_base", _spoil(float("inf"))),
    ("layers.4.attn.wo_a.weight", _spoil(float("-inf"))),
    ("layers.0.attn.wq_a.weight", _spoil_fp8),
    ("layers.1.ffn.experts.2.w3.scale", _spoil_e8m0),
    ("layers.1.engram.embed.weight", _spoil_fp8),
])
def test_non_finite_weight_is_named(saved, tmp_path, name, edit):
    path = _copy(saved, tmp_path / "c")
    tensors = load_file(str(path / ckpt.SINGLE))
    tensors[name] = edit(tensors[name])
    save_file(tensors, str(path / ckpt.SINGLE))
    with pytest.raises(CheckpointError, match=f"tensor '{name}': 1 of .* NaN or Inf"):
        ckpt.load(path)
    with pytest.raises(CheckpointError, match=name):
        flashrt.load(path)
    ckpt.load(path, check_finite=False)  # the check can be skipped
    assert flashrt.load(path, check_finite=False).cfg.n_layers == 8


def test_non_finite_published_fp8_wo_a_is_named(cfg, weights, tmp_path):
    from published_layout import published_tensors

    tensors = published_tensors(weights, with_vision(cfg))
    tensors["layers.2.attn.wo_a.scale"] = _spoil_e8m0(tensors["layers.2.attn.wo_a.scale"])
    path = write_published(weights, with_vision(cfg), tmp_path / "p", tensors=tensors)
    with pytest.raises(CheckpointError, match="tensor 'layers.2.attn.wo_a.weight': 1024 of 8192"):
        ckpt.load(path)


# ---- leftovers of killed saves -----------------------------------------------------------------
def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)


def _leftover(parent, name, kind, target, pid, host=None):
    d = parent / f".{name}.{kind}-{pid}{host or ''}"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"partial")
    (d / partial.MARKER).write_text(json.dumps({"target": target, "pid": pid, "host": host or socket.gethostname()}))
    return d


def test_next_save_sweeps_only_its_own_dead_leftovers(cfg, weights, tmp_path):
    dead = _dead_pid()
    gone = [_leftover(tmp_path, "ck", "tmp", "ck", dead), _leftover(tmp_path, "ck", "old", "ck", dead)]
    kept = [_leftover(tmp_path, "ck", "tmp", "ck", os.getpid()),  # its writer still runs
            _leftover(tmp_path, "ck", "tmp", "ck", dead, host="another-host"),  # another machine's save
            _leftover(tmp_path, "other", "tmp", "other", dead)]  # another target
    user = tmp_path / ".ck.tmp-mine"  # the right name, no marker: not ours
    user.mkdir()
    (user / "notes.txt").write_text("keep")
    ckpt.save(weights, cfg, tmp_path / "ck")
    assert not any(d.exists() for d in gone) and all(d.exists() for d in kept)
    assert (user / "notes.txt").read_text() == "keep"
    assert not (tmp_path / "ck" / partial.MARKER).exists()


def test_old_copy_is_kept_while_the_target_is_incomplete(tmp_path):
    old = _leftover(tmp_path, "ck", "old", "ck", _dead_pid())
    assert partial.sweep(tmp_path, "ck") == [] and old.exists()  # the only complete copy may be inside


def test_killed_save_is_swept_at_the_next_start(cfg, weights, tmp_path):
    script = textwrap.dedent(f"""
        import os, signal
        from flashrt.graphs import checkpoint as ckpt
        from flashrt.graphs.config import shipped_config
        from flashrt.graphs.init_weights import init_weights
        real = ckpt.save_file
        def dying(tensors, filename, metadata=None):
            real(tensors, filename, metadata=metadata)
            os.kill(os.getpid(), signal.SIGKILL)
        ckpt.save_file = dying
        ckpt.save(init_weights(shipped_config("tiny")), shipped_config("tiny"), {str(tmp_path / "ck")!r},
                  max_shard_bytes=256 << 10)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, cwd="/")
    assert r.returncode == -9, r.stderr.decode()
    leftovers = list(tmp_path.glob(".ck.tmp-*"))
    assert len(leftovers) == 1 and not (tmp_path / "ck").exists()
    ckpt.save(weights, cfg, tmp_path / "ck")
    assert list(tmp_path.iterdir()) == [tmp_path / "ck"]
    ckpt.load(tmp_path / "ck", verify=True)


def test_run_no_check_weights(saved, tmp_path, capsys):
    from flashrt.cli.commands import main

    path = _copy(saved, tmp_path / "c")
    tensors = load_file(str(path / ckpt.SINGLE))
    tensors["norm.weight"] = _spoil(float("nan"))(tensors["norm.weight"])
    save_file(tensors, str(path / ckpt.SINGLE))
    args = ["run", "--model", str(path), "--max-new-tokens", "1", "--device", "cpu", "--threads", "1", "--json"]
    assert main(args) == 2
    assert "tensor 'norm.weight'" in capsys.readouterr().err
    assert main(args + ["--no-check-weights"]) == 0
    assert json.loads(capsys.readouterr().out)["new_tokens"] == 1
