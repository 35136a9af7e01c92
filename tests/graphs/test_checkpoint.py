"""Checkpoint save / load and synthetic weight init on the tiny config."""
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from flashrt.errors import CheckpointError
from flashrt.formats import QTensor, check_qtensor
from flashrt.graphs import checkpoint as ckpt
from flashrt.graphs.config import ModelConfig
from flashrt.graphs.init_weights import init_weights
from flashrt.graphs.params import QUANTIZED, param_specs


@pytest.fixture(scope="module")
def saved(cfg, weights, tmp_path_factory):
    """A single-file checkpoint of the tiny weights (read-only for the tests)."""
    return ckpt.save(weights, cfg, tmp_path_factory.mktemp("ck") / "tiny")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for name in a:
        x, y = a[name], b[name]
        assert type(x) is type(y), name
        if isinstance(x, QTensor):
            assert (x.fmt, x.shape, x.data.dtype, x.scale.dtype) == (y.fmt, y.shape, y.data.dtype, y.scale.dtype)
            assert torch.equal(_bytes(x.data), _bytes(y.data)), name
            assert torch.equal(_bytes(x.scale), _bytes(y.scale)), name
        else:
            assert (x.dtype, x.shape) == (y.dtype, y.shape), name
            assert torch.equal(_bytes(x), _bytes(y)), name


def _copy_tensors(src, dst, edit) -> None:
    """Copy checkpoint ``src`` to ``dst`` with its single shard's tensors rewritten by ``edit``."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / ckpt.SINGLE))
    edit(tensors)
    save_file(tensors, str(dst / ckpt.SINGLE))


def _stored_dtype(path, name) -> str:
    with safe_open(str(path), framework="pt") as f:
        return f.get_slice(name).get_dtype()


# ---- init --------------------------------------------------------------------------------------


def test_init_covers_every_param_in_its_kind(cfg, weights):
    specs = param_specs(cfg)
    assert list(weights) == [s.name for s in specs]
    for s in specs:
        w = weights[s.name]
        if s.kind in QUANTIZED:
            assert isinstance(w, QTensor) and w.fmt == QUANTIZED[s.kind] and tuple(w.shape) == s.shape
            check_qtensor(w, s.name)
        else:
            assert w.dtype == ckpt.PLAIN_DTYPES[s.kind] and tuple(w.shape) == s.shape
    assert torch.all(weights["norm.weight"] == 1) and torch.all(weights["layers.0.ffn.gate.bias"] == 0)
    embed = weights["embed.weight"].float()
    assert 0.9 < embed.std().item() < 1.1
    head = weights["head.weight"].float()  # linear: std 1/sqrt(dim)
    assert 0.9 < head.std().item() * cfg.dim**0.5 < 1.1


def test_init_is_deterministic(cfg, weights):
    assert_same(weights, init_weights(cfg, seed=0))
    other = init_weights(cfg, seed=1)
    assert not torch.equal(weights["embed.weight"], other["embed.weight"])
    assert not torch.equal(_bytes(weights["layers.0.ffn.experts.0.w1.weight"].data),
                           _bytes(other["layers.0.ffn.experts.0.w1.weight"].data))


def test_init_progress(cfg):
    calls = []
    init_weights(cfg, seed=3, progress=lambda d, t: calls.append((d, t)))
    n = len(param_specs(cfg))
    assert calls == [(i + 1, n) for i in range(n)]


# ---- round trips ------------------------------------------------------------------------------


def test_roundtrip_single_file(cfg, weights, saved):
    names = sorted(p.name for p in saved.iterdir())
    assert names == sorted([ckpt.CONFIG, ckpt.SINGLE, ckpt.SUMS])
    assert json.loads((saved / ckpt.CONFIG).read_text()) == cfg.to_dict()
    calls = []
    cfg2, loaded = ckpt.load(saved, verify=True, progress=lambda d, t: calls.append((d, t)))
    assert cfg2 == cfg
    assert_same(weights, loaded)
    assert calls[-1] == (len(weights), len(weights))


def test_stored_dtypes(saved):
    f = saved / ckpt.SINGLE
    assert _stored_dtype(f, "layers.0.attn.wq_a.weight") == "F8_E4M3"
    assert _stored_dtype(f, "layers.0.attn.wq_a.scale") == "F8_E8M0"
    assert _stored_dtype(f, "layers.1.engram.embed.weight") == "F8_E4M3"
    assert _stored_dtype(f, "layers.0.attn_norm.weight") == "BF16"
    assert _stored_dtype(f, "layers.0.attn.attn_sink") == "F32"
    fp4 = _stored_dtype(f, "layers.0.ffn.experts.0.w1.weight")
    assert fp4 == ("F4" if ckpt.f4_supported() else "I8")


def test_roundtrip_sharded(cfg, weights, tmp_path):
    calls = []
    path = ckpt.save(weights, cfg, tmp_path / "sharded", max_shard_bytes=64 << 10,
                     progress=lambda d, t: calls.append((d, t)))
    index = json.loads((path / ckpt.INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (path / ckpt.SINGLE).exists()
    assert index["metadata"]["total_size"] == calls[-1][0] == calls[-1][1]
    for w in index["weight_map"]:
        if w.endswith(".scale"):  # a weight and its scale share a shard
            assert index["weight_map"][w] == index["weight_map"][w[: -len("scale")] + "weight"]
    sums = (path / ckpt.SUMS).read_text().splitlines()
    assert sorted(line[66:] for line in sums) == sorted([ckpt.CONFIG, ckpt.INDEX, *shards])
    cfg2, loaded = ckpt.load(path, verify=True)
    assert cfg2 == cfg
    assert_same(weights, loaded)


@pytest.mark.parametrize("fp4_dtype, stored", [("i8", "I8"), ("u8", "U8"), ("f4", "F4")])
def test_fp4_storage_dtypes_load(cfg, weights, tmp_path, fp4_dtype, stored):
    if fp4_dtype == "f4" and not ckpt.f4_supported():
        pytest.skip("installed safetensors cannot store float4_e2m1fn_x2")
    path = ckpt.save(weights, cfg, tmp_path / fp4_dtype, fp4_dtype=fp4_dtype)
    assert _stored_dtype(path / ckpt.SINGLE, "layers.0.ffn.experts.0.w1.weight") == stored
    _, loaded = ckpt.load(path)
    assert loaded["layers.0.ffn.experts.0.w1.weight"].data.dtype == torch.uint8
    assert_same(weights, loaded)


def test_plain_kinds_accept_f32_or_bf16(cfg, saved, tmp_path):
    def edit(t):
        t["norm.weight"] = t["norm.weight"].float()  # bf16 kind stored F32
        t["layers.0.attn.attn_sink"] = t["layers.0.attn.attn_sink"].bfloat16()  # fp32 kind stored BF16
    _copy_tensors(saved, tmp_path / "c", edit)
    _, loaded = ckpt.load(tmp_path / "c")
    assert loaded["norm.weight"].dtype == torch.bfloat16
    assert loaded["layers.0.attn.attn_sink"].dtype == torch.float32


def test_load_to_device(saved):
    _, loaded = ckpt.load(saved, device="meta")
    assert loaded["embed.weight"].device.type == "meta"
    assert loaded["layers.0.attn.wq_a.weight"].device.type == "meta"


# ---- bad checkpoints --------------------------------------------------------------------------


BAD = {  # how a tensor is spoiled; None deletes it
    "missing": None,
    "extra": lambda t: torch.zeros(3),
    "shape": lambda t: t[..., :-1].contiguous(),
    "bf16": lambda t: t.to(torch.bfloat16),
    "u8": lambda t: t.view(torch.uint8),
    "i32": lambda t: t.to(torch.int32),
}


@pytest.mark.parametrize("case, name, words", [
    ("missing", "layers.3.attn.wq_b.weight", ["missing", "fp8_w"]),
    ("missing", "layers.0.ffn.experts.1.w2.scale", ["missing", "float8_e8m0fnu"]),
    ("extra", "layers.0.attn.bogus", ["unexpected", "F32 [3]"]),
    ("shape", "layers.2.attn.compressor.wkv.weight", ["[64, 64]", "[64, 63]"]),
    ("shape", "layers.0.ffn.experts.0.w1.scale", ["[64, 2]", "[64, 1]"]),
    ("bf16", "layers.0.attn.wq_a.weight", ["float8_e4m3fn", "bfloat16"]),
    ("u8", "layers.0.attn.wq_a.scale", ["float8_e8m0fnu", "uint8"]),
    ("i32", "layers.0.hc_attn_base", ["float32", "int32"]),
])
def test_bad_tensor_is_named(saved, tmp_path, case, name, words):
    def edit(t):
        if BAD[case] is None:
            del t[name]
        else:
            t[name] = BAD[case](t.get(name))
    _copy_tensors(saved, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError) as err:
        ckpt.load(tmp_path / "bad")
    msg = str(err.value)
    assert name in msg and all(w in msg for w in words), msg


def test_sha256_detects_flipped_byte(saved, tmp_path):
    bad = tmp_path / "flip"
    shutil.copytree(saved, bad)
    shard = bad / ckpt.SINGLE
    raw = bytearray(shard.read_bytes())
    raw[-10] ^= 0x01
    shard.write_bytes(bytes(raw))
    ckpt.load(bad)  # a flipped data byte is only caught by verification
    with pytest.raises(CheckpointError, match=ckpt.SINGLE):
        ckpt.load(bad, verify=True)
    (bad / ckpt.SUMS).unlink()
    with pytest.raises(CheckpointError, match=ckpt.SUMS):
        ckpt.load(bad, verify=True)


def test_index_pointing_at_missing_shard(cfg, weights, tmp_path):
    path = ckpt.save(weights, cfg, tmp_path / "s", max_shard_bytes=256 << 10)
    victim = sorted(p for p in path.iterdir() if p.suffix == ".safetensors")[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        ckpt.load(path)


def test_save_rejects_wrong_weights(cfg, weights, tmp_path):
    bad = dict(weights)
    del bad["norm.weight"]
    with pytest.raises(CheckpointError, match="norm.weight"):
        ckpt.save(bad, cfg, tmp_path / "a")
    bad = dict(weights, **{"layers.0.attn.wq_a.weight": torch.zeros(32, 64)})
    with pytest.raises(CheckpointError, match="layers.0.attn.wq_a.weight"):
        ckpt.save(bad, cfg, tmp_path / "b")
    assert list(tmp_path.iterdir()) == []


# ---- configs ----------------------------------------------------------------------------------


def test_hf_style_config_loads(cfg, saved, tmp_path):
    path = tmp_path / "hf"
    shutil.copytree(saved, path)
    hf = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
          "torch_dtype": "bfloat16", "text_config": cfg.to_dict()}
    (path / ckpt.CONFIG).write_text(json.dumps(hf))
    cfg2, _ = ckpt.load(path)
    assert cfg2 == cfg and isinstance(cfg2, ModelConfig)


def test_unknown_config_key_is_named(cfg, saved, tmp_path):
    path = tmp_path / "unk"
    shutil.copytree(saved, path)
    (path / ckpt.CONFIG).write_text(json.dumps({**cfg.to_dict(), "rope_scaling_typo": 1}))
    with pytest.raises(CheckpointError, match="rope_scaling_typo"):
        ckpt.load(path)


def test_explicit_cfg_overrides_config_json(cfg, saved):
    cfg2, _ = ckpt.load(saved, cfg=cfg.replace(max_seq_len=128))
    assert cfg2.max_seq_len == 128


# ---- atomicity --------------------------------------------------------------------------------


def test_killed_save_leaves_nothing(cfg, weights, tmp_path, monkeypatch):
    calls = []

    def dying_save_file(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise KeyboardInterrupt
        save_file(tensors, filename, metadata=metadata)
    monkeypatch.setattr(ckpt, "save_file", dying_save_file)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(weights, cfg, tmp_path / "ck", max_shard_bytes=256 << 10)
    assert list(tmp_path.iterdir()) == []


def test_overwrite_existing_checkpoint(cfg, weights, tmp_path):
    path = ckpt.save(weights, cfg, tmp_path / "ck", max_shard_bytes=256 << 10)
    assert (path / ckpt.INDEX).exists()
    ckpt.save(weights, cfg, path)
    assert sorted(p.name for p in path.iterdir()) == sorted([ckpt.CONFIG, ckpt.SINGLE, ckpt.SUMS])
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]
    assert_same(weights, ckpt.load(path, verify=True)[1])


def test_refuses_to_overwrite_other_directory(cfg, weights, tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        ckpt.save(weights, cfg, tmp_path / "docs")
    assert (tmp_path / "docs" / "notes.txt").read_text() == "keep me"
