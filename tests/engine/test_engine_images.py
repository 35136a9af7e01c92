"""Images on the offline ``Engine.generate(prompts, params, images=...)`` (built-in tiny-vl): the
greedy tokens equal ``flashrt.generate``'s with the same images, mixed with text-only prompts, in
the calling thread and with the loop thread running; bad ``images`` are errors naming the prompt."""
import numpy as np
import pytest
import torch
from PIL import Image

import flashrt
from flashrt.engine import Engine, SamplingParams
from flashrt.engine.errors import PromptTooLong, RequestError
from flashrt.graphs import chat_format
from flashrt.graphs.image_processor import preprocess


def picture(rng) -> Image.Image:
    w, h = (int(x) for x in rng.integers(12, 70, 2))
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def ids_with(vl, rng, n_images: int) -> list[int]:
    """Random text ids (no special tokens) with ``n_images`` placeholders at random places."""
    tid = vl.cfg.image_token_id
    ids = rng.integers(3, 200, int(rng.integers(4, 12))).tolist()
    for _ in range(n_images):
        ids.insert(int(rng.integers(0, len(ids) + 1)), tid)
    return ids


@pytest.mark.parametrize("online", [False, True])
def test_generate_with_images_equals_flashrt_generate(vl, online):
    rng = np.random.default_rng(int(torch.randint(0, 1 << 30, ())))
    counts = [1, 0, 2]
    prompts = [ids_with(vl, rng, k) for k in counts]
    images = [[picture(rng) for _ in range(k)] for k in counts]
    images[1] = None  # a text-only prompt in the batch
    engine = Engine(vl, max_model_len=512, prefill_chunk=16, max_step_tokens=64)
    if online:
        engine.start()
    try:
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), images=images)
    finally:
        engine.shutdown(grace_s=0)
    for p, ims, out in zip(prompts, images, outs):
        want = flashrt.generate(vl, [p], 6, images=[ims]).tokens[0]
        assert out.outputs[0].token_ids == want
        n_image = sum(preprocess(im, vl.cfg).n_tokens for im in ims or [])
        assert len(out.prompt_token_ids) == len(p) - len(ims or []) + n_image


def test_single_prompt_takes_its_list_of_images(vl):
    rng = np.random.default_rng(int(torch.randint(0, 1 << 30, ())))
    p, ims = ids_with(vl, rng, 2), [picture(rng), picture(rng)]
    engine = Engine(vl, max_model_len=512, prefill_chunk=64, max_step_tokens=128)
    (out,) = engine.generate(p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), images=ims)
    assert out.outputs[0].token_ids == flashrt.generate(vl, [p], 4, images=[ims]).tokens[0]


def test_chat_prompt_with_an_image(vl):
    rng = np.random.default_rng(int(torch.randint(0, 1 << 30, ())))
    msgs = [{"role": "user", "content": [{"type": "text", "text": "look: "}, {"type": "image", "image": picture(rng)}]}]
    ids = chat_format.encode(vl.tokenizer, msgs, thinking=False)
    engine = Engine(vl, max_model_len=512, prefill_chunk=32, max_step_tokens=64)
    (out,) = engine.generate([ids], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                             images=[chat_format.images(msgs)])
    assert out.outputs[0].token_ids == flashrt.generate(vl, [ids], 4, images=[chat_format.images(msgs)]).tokens[0]


def test_bad_images_name_the_prompt(vl, model, tmp_path):
    rng = np.random.default_rng(int(torch.randint(0, 1 << 30, ())))
    engine = Engine(vl, max_model_len=96, prefill_chunk=16, max_step_tokens=32)
    sp = SamplingParams(max_tokens=2)
    two = [ids_with(vl, rng, 0), ids_with(vl, rng, 1)]
    text_file = tmp_path / "notes.txt"
    text_file.write_text("not an image")
    cases = [
        (dict(images=[None]), "images", "one entry (a list of images or None) per prompt (2), got 1 entries"),
        (dict(images="x.png"), "images", "got str"),
        (dict(images=[None, [picture(rng)] * 2]), "images[1]", "1 image placeholder(s)"),
        (dict(images=[None, [picture(rng), picture(rng)]]), "images[1]", "but 2 image(s) were given"),
        (dict(images=[None, [str(text_file)]]), "images[1]", "cannot decode"),
        (dict(images=[None, ["https://example.com/a.png"]]), "images[1]", "fetches nothing"),
        (dict(images=[[picture(rng)], None]), "images[0]", "0 image placeholder(s)"),
    ]
    for kwargs, param, message in cases:
        with pytest.raises(RequestError) as info:
            engine.generate(two, sp, **kwargs)
        assert info.value.param == param and message in str(info.value), (param, str(info.value))
        assert not engine.step_loop.requests  # nothing half-added
    three = ids_with(vl, rng, 2)  # two spans of up to the budget's 64 tokens overflow a context of 96
    ims = [Image.fromarray(rng.integers(0, 256, (60, 60, 3), dtype=np.uint8)) for _ in range(2)]
    assert sum(preprocess(im, vl.cfg).n_tokens for im in ims) + len(three) > 96
    with pytest.raises(PromptTooLong) as info:
        engine.generate([two[0], three], SamplingParams(max_tokens=2), images=[None, ims])
    assert info.value.param == "prompts[1]" and "image span(s)" in str(info.value)
    from flashrt.engine.text import tokenizer_for
    text_engine = Engine(model, tokenizer_for(vl, None), max_model_len=64)
    with pytest.raises(RequestError, match="takes no images"):
        text_engine.generate([[vl.cfg.image_token_id, 5]], sp, images=[[picture(rng)]])
    assert not engine.step_loop.requests and not text_engine.step_loop.requests
