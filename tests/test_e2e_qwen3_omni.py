"""Qwen3-Omni-MoE thinker served by vLLM through the real server, checked against transformers.

The tiny random-weight checkpoint (omni_server.models.tiny_checkpoints.build_tiny_qwen3_omni) is
served as a one-stage text pipeline (tests/configs/qwen3_omni_text.yaml); its greedy tokens must be
transformers' Qwen3OmniMoeThinkerForConditionalGeneration.generate tokens on the same prompt ids
(float32, CPU).  This module starts its own server: the session fixtures in conftest.py serve the
Qwen2.5-Omni pipelines.
"""

from __future__ import annotations

import copy
import time
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import openai
import pytest
import torch

from tests.conftest import MODELS, REPO, STARTUP_TIMEOUT, Server

MODEL = "omni-tiny-qwen3"
CONFIG = REPO / "tests" / "configs" / "qwen3_omni_text.yaml"
MESSAGES = [{"role": "user", "content": "Tell me about the weather in the city today."}]
OTHER_MESSAGES = [
    {"role": "system", "content": "Keep the answers short and polite."},
    {"role": "user", "content": "Can you tell me a story about a robot who learns to paint flowers?"},
]
MAX_TOKENS = 16


def _model_dir() -> Path:
    from omni_server.models.tiny_checkpoints import TINY_QWEN3_OMNI

    return MODELS / TINY_QWEN3_OMNI


# ---------------------------------------------------------------------------------------------
# transformers reference
# ---------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _hf_thinker(model_dir: Path):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    return model.thinker.eval()


@lru_cache(maxsize=None)
def _hf_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@torch.inference_mode()
def _hf_thinker_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy thinker tokens, never stopping early (the server runs with ignore_eos)."""
    model = _hf_thinker(model_dir)
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = None
    config.max_new_tokens = max_new_tokens
    config.do_sample = False
    ids = torch.tensor([prompt_ids])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt_ids):].tolist()


# ---------------------------------------------------------------------------------------------
# Server
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory):
    from omni_server.models.tiny_checkpoints import ensure_all

    ensure_all(MODELS)
    server = Server(CONFIG, tmp_path_factory.mktemp("qwen3-omni-logs") / "qwen3_omni_text.log")
    try:
        server.wait_ready(time.monotonic() + STARTUP_TIMEOUT)
        yield server
    finally:
        code = server.stop()
    assert code == 0, f"server exit code {code}:\n{server.log_tail()}"


@pytest.fixture(scope="module")
def client(qwen3_server):
    return openai.OpenAI(base_url=f"{qwen3_server.base_url}/v1", api_key="unused", max_retries=0)


def _greedy_chat(client, messages):
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"return_token_ids": True, "ignore_eos": True})
    return resp, resp.model_extra["prompt_token_ids"], resp.choices[0].model_extra["token_ids"]


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


def test_tiny_checkpoint_ids_match_its_tokenizer():
    """The config's special ids are the tokenizer's ids of the real Qwen3-Omni tokens."""
    from transformers import AutoConfig

    from omni_server.models.tiny_checkpoints import ensure_all

    ensure_all(MODELS)
    config = AutoConfig.from_pretrained(_model_dir())
    tok = _hf_tokenizer(_model_dir())
    thinker = config.thinker_config
    expected = {
        "<|audio_pad|>": thinker.audio_token_id,
        "<|image_pad|>": thinker.image_token_id,
        "<|video_pad|>": thinker.video_token_id,
        "<|audio_start|>": thinker.audio_start_token_id,
        "<|vision_start|>": thinker.vision_start_token_id,
        "<|im_start|>": config.im_start_token_id,
        "<|im_end|>": config.im_end_token_id,
        "<tts_pad>": config.tts_pad_token_id,
        "<tts_text_bos>": config.tts_bos_token_id,
        "<tts_text_eod>": config.tts_eos_token_id,
        "user": config.user_token_id,
        "system": config.system_token_id,
        "assistant": config.assistant_token_id,
    }
    assert {t: tok.convert_tokens_to_ids(t) for t in expected} == expected
    assert len(tok) == thinker.text_config.vocab_size
    assert tok.eos_token_id == config.im_end_token_id


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_greedy_chat_equals_transformers(client):
    resp, prompt_ids, tokens = _greedy_chat(client, MESSAGES)
    # The api renders the checkpoint's own chat template, as transformers does.
    tok = _hf_tokenizer(_model_dir())
    assert prompt_ids == tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"]
    expected = _hf_thinker_greedy(_model_dir(), prompt_ids, MAX_TOKENS)
    assert len(expected) == MAX_TOKENS
    assert tokens == expected
    assert len(set(tokens)) > 1, "degenerate reference: the tiny thinker repeats one token"
    choice = resp.choices[0]
    assert choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(prompt_ids) and resp.usage.completion_tokens == MAX_TOKENS
    # Random tokens can end inside a multi-byte character: vLLM's incremental detokenizer holds
    # those bytes back, transformers' decode renders them as U+FFFD.
    assert choice.message.content == tok.decode(expected, skip_special_tokens=True).rstrip("\ufffd")


def test_concurrent_chats_equal_transformers(client):
    """Two different prompts batched together (MoE routing per token) each match transformers."""
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda m: _greedy_chat(client, m), [MESSAGES, OTHER_MESSAGES]))
    (_, prompt_a, tokens_a), (_, prompt_b, tokens_b) = results
    assert prompt_a != prompt_b
    assert tokens_a == _hf_thinker_greedy(_model_dir(), prompt_a, MAX_TOKENS)
    assert tokens_b == _hf_thinker_greedy(_model_dir(), prompt_b, MAX_TOKENS)
    assert tokens_a != tokens_b
