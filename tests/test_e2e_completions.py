"""`POST /v1/completions` (OpenAI's legacy text completion) through the real server and the official
openai client: raw prompts (no chat template) continued by the text stage, equal to transformers'
greedy continuation of the same token ids; batches of prompts x n choices; echo; legacy logprobs;
streaming; and what it refuses."""

from __future__ import annotations

import time
from collections import defaultdict

import openai
import pytest

from tests import reference
from tests.conftest import MODELS

MODEL = "omni-tiny"
THINKER = MODELS / "tiny-qwen2_5-omni"
IDS = {"return_token_ids": True}


@pytest.fixture(scope="module")
def client(text_server):
    return openai.OpenAI(base_url=f"{text_server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(autouse=True)
def stages_empty_after(text_server):
    yield
    deadline = time.monotonic() + 20
    while text_server.stats(0)["request_ids"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not text_server.stats(0)["request_ids"]


def _ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def test_greedy_continuation_equals_transformers(client):
    prompt = "The weather in the city today is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, extra_body=IDS)
    prompt_ids = reference.tokenizer(THINKER).encode(prompt, add_special_tokens=False)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    [choice] = r.choices
    assert _ids(choice) == reference.thinker_greedy(THINKER, prompt_ids, 10)
    assert choice.text == reference.tokenizer(THINKER).decode(_ids(choice), skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.completion_tokens == len(_ids(choice))
    # The same prompt as token ids; and echo puts it before the continuation.
    assert _ids(client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=10, temperature=0,
                                          extra_body=IDS).choices[0]) == _ids(choice)
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + choice.text


def test_streamed_token_ids_add_up_to_each_choice(client):
    """`return_token_ids` in a legacy stream: each choice's chunks carry the tokens behind their
    text, adding up to the unstreamed choice's `token_ids`."""
    kwargs = dict(model=MODEL, prompt=["The sea", "A cat"], max_tokens=9, temperature=0, extra_body=IDS)
    whole = client.completions.create(**kwargs)
    got = defaultdict(list)
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            got[choice.index] += choice.model_extra.get("token_ids") or []
    assert [got[c.index] for c in whole.choices] == [_ids(c) for c in whole.choices]
    assert all(len(_ids(c)) > 0 for c in whole.choices)


def test_max_tokens_defaults_to_16_also_when_null(client):
    """OpenAI's legacy default: 16 tokens when max_tokens is left out or sent as null."""
    body = dict(extra_body={"ignore_eos": True, **IDS})
    for r in (client.completions.create(model=MODEL, prompt="Hi", **body),
              client.completions.create(model=MODEL, prompt="Hi", max_tokens=None, **body)):
        assert len(_ids(r.choices[0])) == 16 and r.choices[0].finish_reason == "length"


def test_prompts_times_choices(client):
    """Two prompts x n=2: choice k answers prompt k // 2, seeded seed + k % 2, as alone."""
    prompts, kw = ["Once upon a time", "The answer is"], dict(max_tokens=8, temperature=1.0, extra_body=IDS)
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, seed=11, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    alone = [client.completions.create(model=MODEL, prompt=prompts[k // 2], seed=11 + k % 2, **kw).choices[0]
             for k in range(4)]
    assert [_ids(c) for c in r.choices] == [_ids(c) for c in alone]
    assert _ids(r.choices[0]) != _ids(r.choices[1])
    tok = reference.tokenizer(THINKER)
    assert r.usage.prompt_tokens == sum(len(tok.encode(p, add_special_tokens=False)) for p in prompts)
    assert r.usage.completion_tokens == sum(len(_ids(c)) for c in r.choices)


def test_legacy_logprobs_and_stream(client):
    kw = dict(model=MODEL, prompt=["Hello there", "Good morning"], max_tokens=6, temperature=0, logprobs=2)
    whole = client.completions.create(**kw)
    prompt_ids = reference.tokenizer(THINKER).encode("Hello there", add_special_tokens=False)
    _, ref = reference.thinker_greedy_logprobs(THINKER, prompt_ids, 6, 2)
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.token_logprobs == pytest.approx([r[0] for r in ref], abs=1e-4)
    for tops, token, logprob, (_, best) in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs, ref):
        # Greedy: the sampled token is the best of the 2 (text, or "bytes:\xNN" for part of a character).
        assert len(tops) == 2 and tops[token] == pytest.approx(logprob) and logprob == pytest.approx(best[0][1])
        assert all("\ufffd" not in k for k in tops)  # (no piece of a character read as U+FFFD)
    # Each token's text where its offset says (special tokens are not in the text).
    text = whole.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(text)
    whole_tokens = [(o, t) for o, t in zip(lp.text_offset, lp.tokens)
                    if not t.startswith("bytes:") and not (t.startswith("<|") and t.endswith("|>"))]
    assert whole_tokens and all(text[o:o + len(t)] == t for o, t in whole_tokens)
    # Streamed: per index the same text, logprobs and finish; then one usage chunk.
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text, tokens, finish = defaultdict(str), defaultdict(list), {}
    for chunk in chunks[:-1]:
        [c] = chunk.choices
        text[c.index] += c.text
        tokens[c.index] += c.logprobs.tokens if c.logprobs else []
        if c.finish_reason:
            finish[c.index] = c.finish_reason
    for c in whole.choices:
        assert text[c.index] == c.text and tokens[c.index] == c.logprobs.tokens
        assert finish[c.index] == c.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_echo_returns_the_prompt_as_sent(client):
    prompt = "Cafe\u0301 \u65e5\u672c"  # (a combining accent: the tokenizer would normalize it)
    r = client.completions.create(model=MODEL, prompt=[prompt, "x"], max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith(prompt) and r.choices[1].text.startswith("x")
    r = client.completions.create(model=MODEL, prompt=[1021, 11], max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith(reference.tokenizer(THINKER).decode([1021, 11]))


@pytest.mark.parametrize("kw, says", [
    (dict(prompt="x", suffix="y"), "suffix"),
    (dict(prompt="x", best_of=2), "best_of"),
    (dict(prompt="x", echo=True, logprobs=1), "echo"),
    (dict(prompt=[10**6]), "outside the vocabulary"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt="x", n=9), "n"),
    (dict(prompt="x", stop=["a", "b", "c", "d", "e"]), "stop"),
    (dict(prompt=["1", 2]), "prompt"),  # (not coerced to token ids)
    (dict(prompt=["x"] * 40, n=8), "limit is 32 per request"),  # (a 429 would never clear)
    (dict(prompt=["x"] * 11, n=3), "needs 33 pipeline requests"),  # (one call must not take every slot)
    (dict(prompt="x", stream_options={"include_usage": True}), "stream_options"),  # (without stream)
    (dict(prompt="x", extra_body={"cache_salt": ""}), "cache_salt"),
])
def test_refused_requests_are_400(client, kw, says):
    with pytest.raises(openai.BadRequestError, match=says):
        client.completions.create(model=MODEL, **kw)


def test_usage_counts_what_the_prefix_cache_spared_once_per_prompt(client):
    """A prompt sent again starts on the text stage's prefix cache: its usage says how many of its
    tokens came from there (whole 128-token blocks on the CPU), each prompt counted once whatever n."""
    text = "A long shared opening that repeats itself for a while. " * 30  # > one block of tokens
    first = client.completions.create(model=MODEL, prompt=text, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=[text, text + "More."], n=2, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens > 128
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= 2 * 128 and cached % 128 == 0 and cached < again.usage.prompt_tokens


def test_cache_salt_keeps_cached_prefixes_apart(client):
    """`cache_salt` (vLLM's extension): a prompt is served from the prefix cache only to requests
    with the salt it was first computed under; another salt, or none, computes it again."""
    text = "Salted words about a quiet orchard and its old stone wall. " * 30

    def cached(**salt) -> int:
        resp = client.completions.create(model=MODEL, prompt=text, max_tokens=2, temperature=0,
                                          extra_body=salt or None)
        return resp.usage.prompt_tokens_details.cached_tokens

    assert cached(cache_salt="alpha") == 0
    assert cached(cache_salt="alpha") >= 128
    assert cached(cache_salt="beta") == 0
    assert cached() == 0  # (the unsalted cache never held it)
    assert cached() >= 128
