"""Stage input processors of the Qwen2.5-Omni pipeline: thinker -> talker -> token2wav.

thinker -> talker, as the reference builds it (transformers' Qwen2_5OmniForConditionalGeneration.generate):
every thinker position i contributes x_i = hidden_i + embed(token_i) (embed zeroed at multimodal
placeholders). The talker's prompt is [x_prompt..., embed(voice's text-start token), x_reply0], with
the codec pad / codec start embeddings added to the last two rows; each later talker step k adds
reply row k of [x_reply1..., embed(text_end), embed(text_pad)] (the last row repeats once exhausted).
All rows go through `thinker_to_talker_proj` (affine), so we keep W·embed as one table and send the
talker projected rows: prompt rows with the bias, per-step rows without it (the talker's own
`embed_input_ids` adds W·codec + bias).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import torch

from omni_server.models.checkpoint import load_tensors, read_config
from omni_server.models.qwen2_5_omni.speakers import load_speakers
from omni_server.stage import processors
from omni_server.stage.errors import RequestError
from omni_server.stage.processors import StageInput
from omni_server.stage.transfer import aside, handoff, host_index, settle, to_device, to_host
from omni_server.wire.messages import REPLY_FROM_OPTION, VOICE_OPTION, StagePayload

# Text-to-speech (options[REPLY_FROM_OPTION]): the reply was given, not generated. The thinker ran
# on prompt + reply (minus its last token) as one prompt; positions from that index on are the reply.
# Greedy generation of the same reply would produce the same hidden states (causal attention), so
# the talker cannot tell.


def _device() -> torch.device:
    # The talker stage owns a GPU when there is one; the per-request matmuls belong there.
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@dataclass
class _TalkerTables:
    device: torch.device
    dtype: torch.dtype
    proj_weight: torch.Tensor  # [talker_hidden, thinker_hidden], float32
    proj_bias: torch.Tensor  # [talker_hidden]
    projected_embed: torch.Tensor  # W·E for every thinker token: [thinker_vocab, talker_hidden]
    codec_pad: torch.Tensor  # W·codec_embed(pad)
    codec_start: torch.Tensor  # W·codec_embed(start)
    text_end: int
    text_pad: int
    placeholder_ids: torch.Tensor  # multimodal placeholder token ids (their embedding counts as zero)
    voice_start: dict[str, int]  # voice -> thinker token that opens the talker's text stream
    # The talker's prompt token ids as the reference has them (codec mask per thinker prompt
    # position, then codec pad, codec start): the forward reads our embeddings, but the repetition
    # penalty counts these ids, as transformers' does.
    codec_mask_id: int
    codec_pad_id: int
    codec_start_id: int


_lock = threading.Lock()


@functools.lru_cache(maxsize=4)
def _tables(model_dir: str, dtype: torch.dtype) -> _TalkerTables:
    cfg = read_config(model_dir)
    tcfg, thinker = cfg.talker_config, cfg.thinker_config
    dev = _device()
    proj = load_tensors(model_dir, "talker.thinker_to_talker_proj.")
    w = proj["weight"].to(dev, torch.float32)
    codec = load_tensors(model_dir, "talker.model.embed_tokens.")["weight"]
    embed = load_tensors(model_dir, "thinker.model.embed_tokens.")["weight"]
    # W·E in chunks: the 7B thinker's table is 152k x 3584.
    projected = torch.cat([(c.to(dev, torch.float32) @ w.T) for c in torch.split(embed, 16384)])
    codec_rows = codec[[tcfg.tts_codec_pad_token_id, tcfg.tts_codec_start_token_id]].to(dev, torch.float32) @ w.T
    placeholders = [getattr(thinker, k, None) for k in ("audio_token_index", "image_token_index", "video_token_index")]
    tables = _TalkerTables(
        device=dev, dtype=dtype, proj_weight=w, proj_bias=proj["bias"].to(dev, torch.float32),
        projected_embed=projected, codec_pad=codec_rows[0], codec_start=codec_rows[1],
        text_end=tcfg.tts_text_end_token_id, text_pad=tcfg.tts_text_pad_token_id,
        placeholder_ids=torch.tensor([p for p in placeholders if p is not None], device=dev),
        voice_start={name: s.bos_token for name, s in load_speakers(model_dir).items()},
        codec_mask_id=tcfg.tts_codec_mask_token_id, codec_pad_id=tcfg.tts_codec_pad_token_id,
        codec_start_id=tcfg.tts_codec_start_token_id,
    )
    settle(dev)  # complete before the processor reads them on its side stream
    return tables


def _single(payloads: dict[int, StagePayload]) -> StagePayload:
    if len(payloads) != 1:
        raise ValueError(f"expected the output of one stage, got stages {sorted(payloads)}")
    return next(iter(payloads.values()))


def _voice(options: dict[str, str], known) -> str:
    voice = options.get(VOICE_OPTION) or min(known)
    if voice not in known:
        raise RequestError(f"unknown voice {voice!r}; available: {sorted(known)}")
    return voice


@processors.register("qwen2_5_omni.thinker_to_talker")
def thinker_to_talker(payloads: dict[int, StagePayload], ctx, options: dict[str, str],
                      since: int | None = None) -> StageInput | None:
    p = _single(payloads)
    with _lock:
        t = _tables(str(ctx.stage.model), ctx.dtype)
    voice = _voice(options, t.voice_start)
    prompt_ids, out_ids = p.prompt_token_ids, p.output_token_ids
    hidden = p.tensors.get("hidden")
    if REPLY_FROM_OPTION in options:
        cut = int(options[REPLY_FROM_OPTION])
        if not 0 < cut < len(prompt_ids) or not out_ids:
            raise ValueError(f"reply_from {cut} outside the prompt of {len(prompt_ids)} tokens")
        # The reply's last token (end of turn) is never fed to the talker; the thinker's one
        # generated token stands in for it, and its hidden row (the last) is dropped.
        prompt_ids, out_ids = prompt_ids[:cut], prompt_ids[cut:] + out_ids[:1]
        hidden = hidden[:len(prompt_ids) + len(out_ids) - 1] if hidden is not None else None
    n_prompt, n_out = len(prompt_ids), len(out_ids)
    if hidden is None or (p.final and (n_out == 0 or hidden.shape[0] != n_prompt + n_out - 1)):
        shape = None if hidden is None else tuple(hidden.shape)
        raise ValueError(f"thinker payload has hidden states {shape} for {n_prompt} prompt + {n_out} output tokens")
    if not p.final:
        # Streamed: start once the first reply position is in (it joins the talker's prompt); the
        # rows for the rest of the reply grow chunk by chunk.
        usable = min(hidden.shape[0], n_prompt + n_out - 1)
        if usable < n_prompt + 1:
            return None
        hidden, out_ids = hidden[:usable], out_ids[:usable - n_prompt + 1]
        n_out = len(out_ids)
    # Started already (`since` step rows given): only the reply rows from there on. On a side
    # stream: the copies and syncs below wait for this work only, not for the talker's queued
    # steps (this runs in the stage loop, between them).
    lo = 0 if since is None else n_prompt + 1 + since
    with torch.inference_mode(), aside(t.device):
        ids = host_index((prompt_ids + out_ids[:-1])[lo:], t.device)
        token_part = t.projected_embed[ids].masked_fill_(torch.isin(ids, t.placeholder_ids)[:, None], 0)
        x = to_device(hidden[lo:], t.device, torch.float32) @ t.proj_weight.T + token_part
        emb = t.projected_embed
        ends = [emb[t.text_end][None], emb[t.text_pad][None]] if p.final else []
        if since is not None:
            rows = torch.cat([x, *ends]).to(ctx.dtype)
        else:
            # The reply's positions: one row per reply token but the last, then (when final) the
            # end-of-text and pad rows. The first joins the prompt: a one-token reply (an empty
            # answer's end of turn, max_tokens 1) has no row of its own, and its end of text does.
            replied = torch.cat([x[n_prompt:], *ends])
            prompt = torch.cat([x[:n_prompt], emb[t.voice_start[voice]][None], replied[:1]])
            prompt[-1] += t.codec_start
            prompt[-2] += t.codec_pad
            prompt += t.proj_bias
            # vLLM takes prompt embeddings on the host: copied without waiting here (the stage waits
            # after building all of a loop's inputs, StageInput.wait).
            (prompt, reply), copied = to_host(prompt, replied[1:], dtype=ctx.dtype)
    if since is not None:
        # Later rows stay on the device: the talker's runner adds them there, and the stage loop,
        # which calls this for every thinker chunk, does not wait for the GPU.
        rows, ready = handoff(rows)
        return StageInput(step_embeds=rows, step_ready=ready, step_offset=since)
    ids = [t.codec_mask_id] * n_prompt + [t.codec_pad_id, t.codec_start_id]
    return StageInput(
        positions=_talker_positions(p.tensors.get("mrope_positions"), n_prompt),
        # vLLM's engine-input form: `is_token_ids` False = every prompt position is our embedding.
        prompt={"type": "embeds", "prompt_embeds": prompt, "prompt_token_ids": ids, "is_token_ids": [False] * len(ids)},
        step_embeds=reply,
        host_ready=copied,
    )


thinker_to_talker.prepare = lambda stage: _tables(str(stage.stage.model), stage.dtype)
thinker_to_talker.incremental = True
thinker_to_talker.prompt_rows_added = 2  # (the voice's codec pad and start rows)


def _talker_positions(thinker: torch.Tensor | None, n_prompt: int) -> torch.Tensor | None:
    """The talker's prompt positions as the reference computes them (its rope index over the
    thinker's prompt ids + voice token + first reply token): the thinker's prompt positions, then
    two text positions after the last one. None (1-D positions) when the thinker sent none."""
    if thinker is None:
        return None
    head = thinker[:, :n_prompt].to(torch.int64)
    # After the last prompt token, not the largest position: they differ only past an audio-in-video
    # span whose end tokens sit below its frames' top (the last chunk is audio ending lower).
    top = int(head[:, -1].max()) if head.numel() else -1
    return torch.cat([head, torch.tensor([[top + 1, top + 2]] * 3)], dim=1)


@functools.lru_cache(maxsize=4)
def _codec_stops(model_dir: str) -> frozenset[int]:
    tcfg = read_config(model_dir).talker_config
    # The reference cuts the codes at the first codec end or pad token.
    return frozenset((tcfg.tts_codec_end_token_id, tcfg.tts_codec_pad_token_id))


@processors.register("qwen2_5_omni.talker_to_token2wav")
def talker_to_token2wav(payloads: dict[int, StagePayload], ctx, options: dict[str, str]) -> StageInput:
    p = _single(payloads)
    stops = _codec_stops(str(ctx.stage.model))
    codes = p.output_token_ids
    end = next((i for i, c in enumerate(codes) if c in stops), len(codes))
    return StageInput(data={"codes": torch.tensor(codes[:end], dtype=torch.long)})


talker_to_token2wav.reads_hidden = False  # codes only: the talker skips its hidden states
