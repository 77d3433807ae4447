"""`POST /v1/completions`, OpenAI's legacy text completion: raw prompts (no chat template) answered
by the pipeline's text stage alone, in the legacy response shape (`text`, legacy `logprobs`)."""

from __future__ import annotations

from omni_server.api.errors import APIError
from omni_server.api.protocol import ChatCompletionRequest, CompletionRequest, LegacyLogprobs, TokenLogprob, TopLogprob
from omni_server.api.text import Offsets, TextCodec


def check(req: CompletionRequest) -> None:
    """Refuse what this server does not do, rather than ignore it."""
    if req.suffix:
        raise APIError(400, "suffix (insertion) is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of must equal n (choices are not ranked)", param="best_of")
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo with logprobs needs the prompt's log-probabilities, which are not "
                            "returned", param="echo")


def prompts(text: TextCodec, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
    """Each prompt's token ids (text is tokenized as it is: no chat template, no special tokens)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    out = [text.encode(p) if isinstance(p, str) else list(p) for p in prompt]
    vocab = len(text.tokenizer)
    for i, ids in enumerate(out):
        if not ids:
            raise APIError(400, f"prompt {i} is empty", param="prompt")
        if max(ids) >= vocab or min(ids) < 0:
            raise APIError(400, f"prompt {i} holds token ids outside the vocabulary (size {vocab})", param="prompt")
    return out


def echoes(text: TextCodec, prompt: str | list[str] | list[int] | list[list[int]], ids: list[list[int]]) -> list[str]:
    """Each prompt's text as `echo` returns it: a text prompt as sent, token ids decoded."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], str):
        return list(prompt)
    return [text.tokenizer.decode(i) for i in ids]


def chat_body(req: CompletionRequest) -> ChatCompletionRequest:
    """The chat body the shared sampling and output code reads (its messages are not read)."""
    return ChatCompletionRequest(
        model=req.model, messages=[{"role": "user", "content": "-"}], modalities=["text"],
        max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
        seed=req.seed, stop=req.stop, n=req.n, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
        logit_bias=req.logit_bias, logprobs=req.logprobs is not None, top_logprobs=req.logprobs,
        ignore_eos=req.ignore_eos, return_token_ids=req.return_token_ids, stream=req.stream,
        stream_options=req.stream_options)


def legacy_logprobs(entries: list[TokenLogprob], token_ids: list[int], offsets: Offsets) -> LegacyLogprobs:
    """The legacy shape of tokens' log-probabilities (`token_ids`: the sampled ids, in order;
    `offsets`: where each one's text starts in the choice's `text`). The alternatives include the
    sampled token, as OpenAI's do."""
    out = LegacyLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for e, token_id in zip(entries, token_ids):
        out.tokens.append(_legacy_token(e))
        out.token_logprobs.append(e.logprob)
        out.top_logprobs.append({_legacy_token(t): t.logprob for t in e.top_logprobs} | {out.tokens[-1]: e.logprob})
        out.text_offset.append(offsets.push(token_id))
    return out


def _legacy_token(entry: TokenLogprob | TopLogprob) -> str:
    """A token as the legacy format writes it: its text, or "bytes:\\xNN..." for a piece of a
    character (as OpenAI's)."""
    try:
        bytes(entry.bytes).decode("utf-8")
        return entry.token
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in entry.bytes)
