"""The 7B-shaped bench checkpoint's tokenizer decodes every id a dummy-weight thinker can sample."""

from __future__ import annotations

import json
import shutil
import sys

from tokenizers import Tokenizer

from tests.conftest import MODELS, REPO


def test_fill_vocab_gives_every_id_text_and_leaves_encoding_alone(tiny_models, tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    from qwen2_5_omni_shape import fill_vocab

    src = MODELS / "tiny-qwen2_5-omni" / "tokenizer.json"
    dst = tmp_path / "tokenizer.json"
    shutil.copy(src, dst)
    before = Tokenizer.from_file(str(src))
    size = before.get_vocab_size(with_added_tokens=True)
    assert fill_vocab(dst, size + 700) == 700
    after = Tokenizer.from_file(str(dst))
    assert after.get_vocab_size(with_added_tokens=True) == size + 700
    for i in (size, size + 1, size + 699):
        assert after.decode([i]) == f" w{i}"
    text = "Hello, who are you? The sea is wide."
    assert after.encode(text).ids == before.encode(text).ids
    assert after.decode(before.encode(text).ids) == before.decode(before.encode(text).ids)
    for token in ("<|im_start|>", "<|endoftext|>"):  # specials keep their ids
        assert after.token_to_id(token) == before.token_to_id(token) is not None
    assert fill_vocab(dst, size + 700) == 0  # idempotent


def test_qwen3_shape_checkpoint_feeds_our_own_loaders(tiny_models, tmp_path):
    """The Qwen3-Omni-30B-A3B shape checkpoint (real sizes, random weights where our code reads the
    checkpoint): the talker's input processor builds a prompt from a chat the tiny tokenizer encodes,
    the code predictor completes a frame and code2wav decodes frames, every weight loaded strictly."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import qwen3_omni_shape

    out = tmp_path / "q3"
    qwen3_omni_shape.main(["--out", str(out), "--device", "cpu"])
    try:
        _check_qwen3_shape(out)
    finally:
        shutil.rmtree(out)  # 1.4 GB: not kept among pytest's last runs' directories


def _check_qwen3_shape(out):
    from types import SimpleNamespace

    import torch
    from transformers import AutoTokenizer

    from omni_server.config.loader import load_config
    from omni_server.models.checkpoint import read_config
    from omni_server.models.qwen3_omni_moe import processors as q3
    from omni_server.models.qwen3_omni_moe.code2wav import Code2Wav
    from omni_server.models.qwen3_omni_moe.code_predictor import CodePredictor
    from omni_server.wire.messages import StagePayload

    cfg = read_config(str(out))
    text, talker = cfg.thinker_config.text_config, cfg.talker_config
    assert (text.vocab_size, text.hidden_size, text.num_hidden_layers, text.num_experts) == (152064, 2048, 48, 128)
    assert (talker.text_config.hidden_size, talker.text_config.num_hidden_layers, talker.accept_hidden_layer) == \
        (1024, 20, 24)
    assert cfg.code2wav_config.decoder_dim == 1536 and talker.code_predictor_config.num_hidden_layers == 5

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.decode([152063]).strip() == "w152063"  # a dummy thinker's every id decodes
    ids = list(tok.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True,
                                       return_dict=True)["input_ids"])
    assert [cfg.im_start_token_id, cfg.user_token_id] == ids[:2]  # the config's ids are the tokenizer's
    payload = StagePayload(request_id="r", source_stage=0, prompt_token_ids=ids, output_token_ids=[100, 101, 102],
                           tensors={}, final=True)
    ctx = SimpleNamespace(stage=SimpleNamespace(model=str(out)), dtype=torch.bfloat16)
    made = q3.thinker_to_talker({0: payload}, ctx, {})
    user_rows = ids.index(cfg.im_end_token_id) + 2  # <|im_start|>user ... <|im_end|>\n
    assert made.prompt["prompt_embeds"].shape == (user_rows + 9, 1024)
    assert made.step_embeds.shape == (1 + 2, 1024)  # reply token 2, then tts_eos, tts_pad

    predictor = CodePredictor(str(out), "cpu")
    codes, residual = predictor(torch.randn(2, 1024), torch.randn(2, 1024))
    assert codes.shape == (2, 15) and residual.shape == (2, 1024) and 0 <= int(codes.min()) <= int(codes.max()) < 2048
    vocoder = Code2Wav(str(out))
    # The shipped config's code2wav stage lets the talker run far enough ahead for its windows.
    stage = load_config(REPO / "configs" / "qwen3_omni.yaml").stage(2)
    assert Code2Wav(str(out), **stage.generator_args).stream_lead <= stage.stream_window
    wave = vocoder(torch.randint(0, 2048, (16, 4)))
    assert wave.ndim == 1 and 0 < wave.numel() <= 4 * 1920 and bool(torch.isfinite(wave).all())


def test_shape_tokenizer_speaks_the_real_special_ids(tiny_models, tmp_path):
    """Media prompts on the 7B shape checkpoint reach the thinker's placeholders: the tokenizer's
    special tokens carry the ids config.json names (151643 on), and plain text encodes as before."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from qwen2_5_omni_shape import build_config, copy_tiny_files, fill_vocab, move_specials, real_image_size
    from transformers import AutoProcessor

    tiny = MODELS / "tiny-qwen2_5-omni"
    config = build_config("7b")
    config.save_pretrained(tmp_path)
    copy_tiny_files(tiny, tmp_path)
    assert move_specials(tmp_path, config.thinker_config) == 151643 - 1024
    fill_vocab(tmp_path / "tokenizer.json", config.thinker_config.text_config.vocab_size)
    real_image_size(tmp_path)
    thinker = config.thinker_config
    proc = AutoProcessor.from_pretrained(tmp_path)
    import numpy as np

    grid = proc.image_processor(images=[np.zeros((720, 1280, 3), np.uint8)], return_tensors="pt")["image_grid_thw"]
    assert grid.tolist() == [[1, 52, 92]]  # 1,196 tokens once merged 2x2 (the tiny checkpoint's cap: 128)
    tok = proc.tokenizer
    for token, want in (("<|IMAGE|>", thinker.image_token_index), ("<|AUDIO|>", thinker.audio_token_index),
                        ("<|VIDEO|>", thinker.video_token_index), ("<|vision_bos|>", thinker.vision_start_token_id),
                        ("<|audio_eos|>", thinker.audio_end_token_id), ("<|im_start|>", 151644),
                        ("<|im_end|>", 151645)):
        assert tok.convert_tokens_to_ids(token) == want, token
    before = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    text = "Hello, who are you? The sea is wide."
    assert tok(text)["input_ids"] == before.encode(text).ids
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    ids = tok(proc.apply_chat_template(messages, add_generation_prompt=True))["input_ids"]
    assert ids[0] == 151644 and thinker.image_token_index in ids and thinker.vision_start_token_id in ids
    assert max(ids) < thinker.text_config.vocab_size
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (151643, 151645)
