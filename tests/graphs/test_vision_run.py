"""Images through the user interfaces: chat messages with image parts, ``flashrt run --image`` on
the built-in tiny-vl (in process and as the command line)."""
import base64
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from flashrt.engine import run as run_mod
from flashrt.graphs import chat_format
from flashrt.graphs.builtin_tokenizer import build
from flashrt.graphs.config import shipped_config
from flashrt.graphs.image_processor import expand_prompt


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHRT_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def png(tmp_path):
    path = tmp_path / "pic.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (30, 50, 3), dtype=np.uint8)).save(path)
    return path


def test_chat_image_parts_render_in_place(png):
    url = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
    messages = [{"role": "system", "content": "S"},
                {"role": "user", "content": [{"type": "text", "text": "look: "},
                                             {"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": " and "},
                                             {"type": "image", "image": str(png)}]}]
    text = chat_format.render(messages, thinking=False)
    assert f"{chat_format.USER}look: {chat_format.IMAGE} and {chat_format.IMAGE}{chat_format.ASSISTANT}" in text
    assert chat_format.images(messages) == [url, str(png)]
    assert messages[1]["content"][0] == {"type": "text", "text": "look: "}  # the input is not modified


@pytest.mark.parametrize("content, match", [
    ([{"type": "text", "text": chat_format.IMAGE}], "cannot appear in text"),
    ([{"type": "image_url", "image_url": {}}], "image_url: expected a URL"),
    ([{"type": "audio", "audio": "x"}], r"messages\[0\].content\[0\]: expected a text part"),
    (["just a string"], "expected a text part"),
])
def test_bad_content_parts(content, match):
    with pytest.raises(ValueError, match=match):
        chat_format.render([{"role": "user", "content": content}])


def test_images_only_in_user_turns():
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "image", "image": "x.png"}]}]
    with pytest.raises(ValueError, match=r"messages\[1\].content\[0\]"):
        chat_format.render(messages)


def test_tiny_vl_image_token_is_the_tokenizers_placeholder():
    cfg = shipped_config("tiny-vl")
    assert build(cfg.vocab_size).token_to_id(chat_format.IMAGE) == cfg.image_token_id


def test_run_with_an_image(cache, png):
    r = run_mod.run("tiny-vl", max_new_tokens=3, quiet=True, chat="describe", images=[str(png)])
    cfg = shipped_config("tiny-vl")
    _, _, found = expand_prompt([cfg.image_token_id], [str(png)], cfg)
    assert r["image_tokens"] == found[0][1].n_tokens and r["images"] == [str(png)]
    text_only = run_mod.run("tiny-vl", max_new_tokens=3, quiet=True, chat="describe")
    assert r["prompt_tokens"] == text_only["prompt_tokens"] + r["image_tokens"]  # the placeholder became a span
    plain = run_mod.run("tiny-vl", "what is it", 3, quiet=True, images=str(png))
    assert plain["image_tokens"] == r["image_tokens"] and len(plain["new_token_ids"]) == 3
    assert r["backend_per_op_family"]["vision"] == "reference"


def test_run_image_errors(cache, png, monkeypatch):
    with pytest.raises(ValueError, match="model 'tiny-seed0' has no vision tower"):
        run_mod.run("tiny", max_new_tokens=1, quiet=True, images=[str(png)])
    monkeypatch.setattr(run_mod, "load_model", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(ValueError, match="no such file"):
        run_mod.run("tiny-vl", max_new_tokens=1, quiet=True, images=["/nonexistent.png"])


def test_cli_run_image(cache, png):
    cmd = [sys.executable, "-m", "flashrt.cli", "run", "--model", "tiny-vl", "--image", str(png), "--chat",
           "describe", "--max-new-tokens", "2"]
    env = {**os.environ, "FLASHRT_CACHE_DIR": str(cache)}
    out = subprocess.run(cmd + ["--json"], capture_output=True, text=True, check=True, env=env, cwd="/")
    report = json.loads(out.stdout)
    assert report["image_tokens"] > 0 and report["images"] == [str(png)]
    human = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env, cwd="/").stdout
    assert f"images: {png} ({report['image_tokens']} of the prompt tokens)" in human


@pytest.mark.slow
def test_small_has_a_vision_tower_at_its_tokenizers_image_id():
    cfg = shipped_config("small")
    assert cfg.vision_n_layers > 0 and cfg.vision_dim % cfg.vision_n_heads == 0
    assert build(cfg.vocab_size).token_to_id(chat_format.IMAGE) == cfg.image_token_id


def test_small_text_weights_do_not_move_with_the_tower():
    """The tower adds parameters; every text parameter keeps its name, shape, kind and init (its
    values come from its own name's seed), so text-only decoding of ``small`` is what it was."""
    from flashrt.graphs.params import param_specs

    vl = shipped_config("small")
    specs_vl = {s.name: s for s in param_specs(vl)}
    specs_text = {s.name: s for s in param_specs(vl.replace(vision_n_layers=0))}
    added = set(specs_vl) - set(specs_text)
    assert set(specs_text) <= set(specs_vl) and added
    assert all(n.startswith(("vision.", "aligner.", "image_")) or n.endswith("gate.bias_vl") for n in added)
    assert all(specs_vl[n] == specs_text[n] for n in specs_text)


def test_a_cached_builtin_of_another_config_is_left_alone(cache):
    """A checkpoint cached from an older release's config (here: tiny-vl without its tower) is not
    used, changed or removed: the current config's checkpoint is made next to it."""
    old = run_mod.builtin_checkpoint("tiny-vl", quiet=True)
    data = json.loads((old / "config.json").read_text())
    data = {k: v for k, v in data.items() if not k.startswith("vision_") and k != "image_token_id"}
    (old / "config.json").write_text(json.dumps(data))
    before = {p.name: p.read_bytes() for p in old.iterdir()}
    new = run_mod.builtin_checkpoint("tiny-vl", quiet=True)
    assert new != old and new.parent == old.parent and new.name.startswith("tiny-vl-seed0-")
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before
    assert json.loads((new / "config.json").read_text())["vision_n_layers"] == shipped_config("tiny-vl").vision_n_layers
    assert run_mod.builtin_checkpoint("tiny-vl", quiet=True) == new  # found again, not rebuilt
