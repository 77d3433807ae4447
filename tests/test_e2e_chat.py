"""End to end through the real server and the official openai client (tiny thinker, CPU, fp32)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests import media, reference
from tests.conftest import MODELS

MODEL = "omni-tiny"
MESSAGES = [{"role": "user", "content": "Tell me about the weather in the city today."}]


@pytest.fixture(scope="module")
def client(text_server):
    return openai.OpenAI(base_url=f"{text_server.base_url}/v1", api_key="unused", max_retries=0)


def _thinker_dir():
    return MODELS / "tiny-qwen2_5-omni"


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model" and card.owned_by == "omni-server"
    with pytest.raises(openai.NotFoundError, match="nope/x"):
        client.models.retrieve("nope/x")


def test_greedy_chat_equals_transformers(client):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                          extra_body={"return_token_ids": True})
    choice = resp.choices[0]
    prompt_ids = resp.model_extra["prompt_token_ids"]
    tokens = choice.model_extra["token_ids"]
    expected = reference.thinker_greedy(_thinker_dir(), prompt_ids, 12)
    assert tokens == expected
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens == len(tokens)
    assert choice.finish_reason == ("length" if len(tokens) == 12 else "stop")
    tok = reference.tokenizer(_thinker_dir())
    assert choice.message.content == tok.decode(expected, skip_special_tokens=True)


def test_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_stop_string_truncates(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    assert len(full) > 4
    stop = full[2:4]
    cut = client.chat.completions.create(**kwargs, stop=[stop]).choices[0]
    assert cut.message.content == full[: full.find(stop)]
    assert cut.finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_usage_of_a_one_token_reply_counts_its_media_and_cache(client, stream):
    """A reply that ends in its first step (max_tokens 1) reports the prompt as the engine ran it, its
    clip's tokens counted, and the tokens the prefix cache spared, as a longer reply does."""
    wav, _ = media.tone_wav(2.0)
    content = [{"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}},
               {"type": "text", "text": "What is this sound? " * 40}]  # (> one 128-token block besides)
    salt = f"usage-{stream}-{time.monotonic_ns()}"

    def usage(max_tokens: int):
        kw = dict(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
                  temperature=0, extra_body={"cache_salt": salt, "return_token_ids": True})
        if not stream:
            resp = client.chat.completions.create(**kw)
            return resp.usage, len(resp.model_extra["prompt_token_ids"])
        chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        return chunks[-1].usage, len(chunks[0].model_extra["prompt_token_ids"])

    longer, rendered = usage(2)  # (computes the prompt: nothing cached under this salt yet)
    one, _ = usage(1)
    assert longer.prompt_tokens_details.cached_tokens == 0
    assert one.completion_tokens == 1
    assert one.prompt_tokens == longer.prompt_tokens > rendered + 20  # (the clip's tokens counted)
    assert one.prompt_tokens_details.cached_tokens >= 128


def test_a_max_tokens_the_context_cannot_hold_after_the_media_is_400(client):
    """The context (2048) must hold the prompt as the engine runs it, the clip's tokens included (the
    api sees only its placeholder), and the max_tokens the client set: one past that is a 400 naming the
    field and the real prompt length, not a reply cut short as if it reached max_tokens."""
    wav, _ = media.tone_wav(2.0)
    messages = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}},
                                             {"type": "text", "text": "What is this?"}]}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                           extra_body={"return_token_ids": True})
    ran, rendered = first.usage.prompt_tokens, len(first.model_extra["prompt_token_ids"])
    assert ran > rendered + 20
    with pytest.raises(openai.BadRequestError, match=f"context is 2048 tokens: the prompt's {ran} and "
                                                     f"max_completion_tokens {2049 - ran} do not fit") as refused:
        client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=2049 - ran)
    assert refused.value.code == "context_length_exceeded"  # (the stage's count: OpenAI's code still)
    # (at the context's edge it runs: a stream's first chunk comes, then the client leaves)
    with client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2048 - ran, stream=True) as s:
        assert next(iter(s)).choices[0].delta.role == "assistant"


@pytest.mark.parametrize("seed", [1234, -1])  # (vLLM reads -1 as no seed: the stage passes it on as 2**64 - 1)
def test_seeded_sampling_is_reproducible(client, seed):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0, top_p=0.9, seed=seed,
                  extra_body={"return_token_ids": True, "top_k": 50})
    a = client.chat.completions.create(**kwargs).choices[0].model_extra["token_ids"]
    b = client.chat.completions.create(**kwargs).choices[0].model_extra["token_ids"]
    assert a == b and len(a) > 0


@pytest.mark.parametrize("presence,frequency", [(1.5, 0.0), (0.0, 2.0), (0.4, 0.4)])
def test_presence_and_frequency_penalties_equal_transformers(client, presence, frequency):
    """OpenAI's penalties reach the engine: greedy tokens equal transformers' greedy ones under the
    same penalties (and differ from plain greedy, which repeats itself within 56 tokens here)."""
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=56, temperature=0,
                  extra_body={"return_token_ids": True, "ignore_eos": True})
    resp = client.chat.completions.create(**kwargs, presence_penalty=presence, frequency_penalty=frequency)
    tokens = resp.choices[0].model_extra["token_ids"]
    expected = reference.thinker_greedy_penalised(_thinker_dir(), resp.model_extra["prompt_token_ids"], 56,
                                                  presence, frequency)
    assert tokens == expected
    plain = client.chat.completions.create(**kwargs).choices[0].model_extra["token_ids"]
    assert plain != tokens


def test_logprobs_equal_transformers(client):
    """logprobs / top_logprobs: per text token, the model's log-probability and its best
    alternatives, as transformers computes them; a stream carries the same entries."""
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, logprobs=True, top_logprobs=3,
                  extra_body={"return_token_ids": True, "ignore_eos": True})
    resp = client.chat.completions.create(**kwargs)
    choice = resp.choices[0]
    tokens = choice.model_extra["token_ids"]
    ref_tokens, ref = reference.thinker_greedy_logprobs(_thinker_dir(), resp.model_extra["prompt_token_ids"], 10, 3)
    assert tokens == ref_tokens
    tok = reference.tokenizer(_thinker_dir())
    content = choice.logprobs.content
    assert len(content) == len(tokens) == 10
    # Each token's own bytes (a piece of a character is part of its UTF-8): together, the text's.
    assert b"".join(bytes(e.bytes) for e in content).decode(errors="replace") == tok.decode(tokens)
    for entry, t, (lp, tops) in zip(content, tokens, ref):
        assert entry.token == tok.decode([t])
        assert "\ufffd" in entry.token or entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(lp, abs=1e-4) and entry.logprob < 0
        assert [x.token for x in entry.top_logprobs] == [tok.decode([i]) for i, _ in tops]
        assert [x.logprob for x in entry.top_logprobs] == pytest.approx([v for _, v in tops], abs=1e-4)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: the best token
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("n", [1, 2])
def test_streamed_token_ids_add_up_to_the_reply(client, n):
    """`return_token_ids` in a stream: the first choice's role chunk carries the prompt's ids, each
    text chunk the tokens behind it; a choice's chunks add up to its unstreamed `token_ids`."""
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, n=n, seed=5,
                  extra_body={"return_token_ids": True, "ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    ids, prompts = {i: [] for i in range(n)}, []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if chunk.model_extra.get("prompt_token_ids") is not None:
            prompts.append(chunk.model_extra["prompt_token_ids"])
        for choice in chunk.choices:
            ids[choice.index] += choice.model_extra.get("token_ids") or []
    assert prompts == [whole.model_extra["prompt_token_ids"]]
    assert [ids[c.index] for c in whole.choices] == [c.model_extra["token_ids"] for c in whole.choices]
    assert all(len(v) == 12 for v in ids.values())


def test_logit_bias_forbids_and_forces_tokens(client):
    def ids(**kw):
        kw = {"temperature": 0, **kw}
        resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6,
                                              extra_body={"return_token_ids": True, **kw.pop("extra", {})}, **kw)
        return resp.choices[0].model_extra["token_ids"]

    plain = ids()
    assert ids(tool_choice="none", logit_bias={}) == plain
    forbidden = ids(logit_bias={str(plain[0]): -100})
    assert plain[0] not in forbidden and forbidden != plain
    forced = 1000 + plain[0] % 1000
    assert ids(logit_bias={str(forced): 100}) == [forced] * 6
    # (also when the sampler draws: temperature 1, top-k)
    assert ids(logit_bias={str(forced): 100}, temperature=1.0, seed=3, extra={"top_k": 5}) == [forced] * 6


def _wait_until_dropped(server, request_id: str, stages: list[int], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(request_id not in server.stats(i)["request_ids"] for i in stages):
            return
        time.sleep(0.2)
    raise AssertionError(f"{request_id} still known to a stage: {[server.stats(i) for i in stages]}")


def test_disconnect_mid_stream_aborts_in_every_stage(text_server, client):
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1900, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    request_id = first.id
    assert request_id in text_server.stats(0)["request_ids"]
    stream.close()
    _wait_until_dropped(text_server, request_id, [0])
    assert text_server.stats(0)["num_running"] == 0


def test_disconnect_non_stream_aborts(text_server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{text_server.base_url}/v1/chat/completions", json=body, timeout=1.5)
    deadline = time.monotonic() + 20
    while text_server.stats(0)["num_running"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert text_server.stats(0)["num_running"] == 0
    assert text_server.stats(0)["request_ids"] == []


@pytest.mark.parametrize("body,status,param", [
    ({"model": "nope", "messages": MESSAGES}, 404, "model"),
    ({"model": MODEL}, 400, "messages"),
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "messages": MESSAGES, "n": 9}, 400, "n"),  # (at most 8 choices)
    ({"model": MODEL, "messages": MESSAGES, "n": 0}, 400, "n"),
    ({"model": MODEL, "messages": MESSAGES, "seed": 2**63}, 400, "seed"),  # (int64, as vLLM's server)
    ({"model": MODEL, "messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "messages": MESSAGES, "max_tokens": 10**6}, 400, "max_tokens"),
    ({"model": MODEL, "messages": MESSAGES, "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ({"model": MODEL, "messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"model": MODEL, "messages": MESSAGES, "top_logprobs": 3}, 400, "top_logprobs"),  # without logprobs
    ({"model": MODEL, "messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"model": MODEL, "messages": MESSAGES, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"model": MODEL, "messages": MESSAGES, "logit_bias": {"\u00b2": 1}}, 400, "logit_bias"),  # a digit, not ASCII
    ({"model": MODEL, "messages": MESSAGES, "logit_bias": {"1" * 5000: 1}}, 400, "logit_bias"),  # past int()'s limit
    ({"model": MODEL, "messages": MESSAGES, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"model": MODEL, "messages": MESSAGES, "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ({"model": MODEL, "messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "a b"}}]}, 400,
     "tools.0.function.name"),
    ({"model": MODEL, "messages": MESSAGES, "tool_choice": "auto"}, 400, "tool_choice"),  # (without tools)
    # (an earlier reply's audio by id: this server stores none, so it is refused, not dropped)
    ({"model": MODEL, "messages": [{"role": "assistant", "audio": {"id": "audio_1"}}, *MESSAGES]}, 400, "messages.0"),
    # (OpenAI's rule: not silently ignored without a stream)
    ({"model": MODEL, "messages": MESSAGES, "stream_options": {"include_usage": True}}, 400, "stream_options"),
])
def test_bad_requests_get_openai_errors(text_server, body, status, param):
    r = httpx.post(f"{text_server.base_url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["param"] == param
    assert "Traceback" not in err["message"]


def test_developer_messages_are_the_system_turn(client):
    """OpenAI's `developer` role is the system message (as /v1/responses reads it): the same prompt."""
    def prompt(role: str) -> list[int]:
        resp = client.chat.completions.create(
            model=MODEL, messages=[{"role": role, "content": "Be terse."}, *MESSAGES], max_tokens=1,
            extra_body={"return_token_ids": True})
        return resp.model_extra["prompt_token_ids"]

    assert prompt("developer") == prompt("system")


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_longer_than_the_model_is_400(client, stream):
    long = [{"role": "user", "content": "weather " * 3000}]  # > max_model_len 2048 tokens
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=long, max_tokens=4, stream=stream)
    assert "limit is 2047" in str(err.value)


def test_a_huge_prompt_does_not_hold_up_other_requests(text_server):
    """Rendering and tokenizing megabytes of prompt takes seconds: it runs beside the event loop,
    which answers other requests meanwhile (then the prompt is a 400: over the model's length)."""
    import concurrent.futures

    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello world " * 400_000}], "max_tokens": 1}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        big = pool.submit(httpx.post, f"{text_server.base_url}/v1/chat/completions", json=body, timeout=120)
        answered = 0
        while not big.done():
            if httpx.get(f"{text_server.base_url}/health", timeout=120).status_code == 200 and not big.done():
                answered += 1
        r = big.result()
    assert r.status_code == 400 and "the limit is 2047" in r.json()["error"]["message"]
    assert answered >= 3, "the server answered nothing else while it read the huge prompt"


def test_malformed_json_is_400(text_server):
    r = httpx.post(f"{text_server.base_url}/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10**6)


def test_vllm_log_lines_name_their_stage(text_server):
    """`serve`'s log mixes every stage's output: vLLM's own lines carry the stage's name too."""
    import re

    log = text_server.log_path.read_text(errors="replace")
    assert re.search(r"^\[thinker\] (INFO|WARNING|DEBUG) \d\d-\d\d ", log, re.M), log[-2000:]


def test_ready_time_counts_from_the_command(text_server):
    """`all N stages ready in X s` counts from the command (imports and the api's set-up included,
    as issue 5's p6 does), not from the stages' launch: the same line says how long after the
    command they launched (both on the monotonic clock: the log's wall-clock stamps jumped 13 s on a
    CI host once)."""
    import re

    log = text_server.log_path.read_text(errors="replace")
    m = re.search(r"INFO \S+: all \d+ stages ready in ([\d.]+) s; serving on \S+ "
                  r"\(stages launched ([\d.]+) s after the command\)$", log, re.M)
    assert m, log[-2000:]
    ready, launched = float(m.group(1)), float(m.group(2))
    assert 0.2 < launched < ready  # (the command's imports and config came before any launch)
