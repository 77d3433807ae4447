"""Two AR stages: the thinker's hidden states feed a second model as prompt embeddings."""

from __future__ import annotations

import httpx
import openai
import torch
from safetensors import safe_open

from tests import reference
from tests.conftest import MODELS

MODEL = "omni-tiny-two-stage"
FOLLOWER_TOKENS = 6  # tests/configs/two_stage.yaml: stage 1 default_sampling.max_tokens


def _load_record(record_dir, request_id):
    path = record_dir / f"{request_id}.from0.safetensors"
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        hidden = f.get_tensor("hidden")
    ids = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    return hidden, ids(meta["prompt_token_ids"]), ids(meta["output_token_ids"])


def test_hidden_states_and_follower_tokens_equal_transformers(two_stage_server, record_dir):
    client = openai.OpenAI(base_url=f"{two_stage_server.base_url}/v1", api_key="x", max_retries=0)
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a quiet morning by the sea."}],
        max_tokens=7, temperature=0, extra_body={"return_token_ids": True})
    thinker_tokens = resp.choices[0].model_extra["token_ids"]
    prompt_ids = resp.model_extra["prompt_token_ids"]
    follower = resp.model_extra["omni_outputs"]["follower"]["token_ids"]

    hidden, rec_prompt, rec_output = _load_record(record_dir, resp.id)
    assert rec_prompt == prompt_ids and rec_output == thinker_tokens
    # One row per position the thinker computed: the prompt, then every generated token but the last.
    assert hidden.shape[0] == len(prompt_ids) + len(thinker_tokens) - 1
    assert hidden.dtype == torch.float32

    thinker_dir = MODELS / "tiny-qwen2_5-omni"
    assert thinker_tokens == reference.thinker_greedy(thinker_dir, prompt_ids, 7)
    expected_hidden = reference.thinker_hidden(thinker_dir, prompt_ids + thinker_tokens[:-1])
    assert (hidden - expected_hidden).abs().max().item() < 1e-4

    expected_follower = reference.lm_greedy_from_embeds(MODELS / "tiny-embeds-lm", hidden, FOLLOWER_TOKENS)
    assert follower == expected_follower
    assert len(follower) >= 1


def test_stream_carries_follower_tokens_and_disconnect_clears_both_stages(two_stage_server):
    client = openai.OpenAI(base_url=f"{two_stage_server.base_url}/v1", api_key="x", max_retries=0)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, stream=True))
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(final) == 1 and final[0].model_extra["omni_outputs"]["follower"]["token_ids"]

    # A disconnected request must vanish from both stages (stage 1 only ever expected it).
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1900, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    request_id = next(iter(stream)).id
    assert request_id in two_stage_server.stats(1)["request_ids"]
    stream.close()
    import time

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if all(request_id not in two_stage_server.stats(i)["request_ids"] for i in (0, 1)):
            break
        time.sleep(0.2)
    assert all(request_id not in two_stage_server.stats(i)["request_ids"] for i in (0, 1))
    assert httpx.get(f"{two_stage_server.base_url}/health").json()["stages"] == {
        "thinker": "ready", "follower": "ready"}


def test_concurrent_requests_each_get_their_own_hidden_states(two_stage_server, record_dir):
    """Batched steps share one host buffer between requests; each payload must hold only its rows."""
    from concurrent.futures import ThreadPoolExecutor

    client = openai.OpenAI(base_url=f"{two_stage_server.base_url}/v1", api_key="x", max_retries=0)
    prompts = ["One.", "A longer question about the sea and the sky?", "Numbers: 1, 2, 3.", "Hello there."]

    def ask(i):
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompts[i]}], max_tokens=5 + i, temperature=0,
            extra_body={"return_token_ids": True})

    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(ask, range(4)))
    thinker_dir = MODELS / "tiny-qwen2_5-omni"
    for resp in responses:
        hidden, prompt_ids, output_ids = _load_record(record_dir, resp.id)
        assert output_ids == resp.choices[0].model_extra["token_ids"]
        expected = reference.thinker_hidden(thinker_dir, prompt_ids + output_ids[:-1])
        assert hidden.shape == expected.shape
        assert (hidden - expected).abs().max().item() < 1e-4


def test_a_stop_string_cuts_what_the_next_stage_reads(two_stage_server, record_dir):
    """The text stage stopped by a stop string sends the next stage the tokens before it and then
    its end of sequence, as if the model had ended there: not the stop string's token nor those made
    until the stop reached the stage, and a row for each token before it (the speech of a reply
    says all of its transcript)."""
    client = openai.OpenAI(base_url=f"{two_stage_server.base_url}/v1", api_key="x", max_retries=0)
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Count for me."}], max_tokens=40,
                  temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
    tokens = client.chat.completions.create(**kwargs).choices[0].model_extra["token_ids"]
    tok = reference.tokenizer(MODELS / "tiny-qwen2_5-omni")
    text = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731 (as the reply reads)
    # A later token whose text first appears in the reply where that token starts: the stop string.
    k = next(k for k in range(3, len(tokens)) if (piece := text(tokens[k:k + 1])).strip()
             and text(tokens[:k + 1]).find(piece) == len(text(tokens[:k])))
    resp = client.chat.completions.create(**kwargs, stop=[text(tokens[k:k + 1])])
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].message.content == text(tokens[:k])
    hidden, prompt_ids, rec_output = _load_record(record_dir, resp.id)
    assert rec_output == tokens[:k] + [tok.eos_token_id]
    expected = reference.thinker_hidden(MODELS / "tiny-qwen2_5-omni", prompt_ids + tokens[:k])
    assert hidden.shape == expected.shape
    assert (hidden - expected).abs().max().item() < 1e-4
    assert resp.model_extra["omni_outputs"]["follower"]["token_ids"]
