"""Stage input processors of the Qwen3-Omni-MoE pipeline (see docs/qwen3_omni.md, section 1).

thinker -> talker, as transformers' `Qwen3OmniMoeForConditionalGeneration.generate` builds it. Two
projections (`talker.text_projection` / `talker.hidden_projection`, fc2(silu(fc1(x))), not affine, so
every row is projected whole) map thinker vectors into the talker:
- user rows: every position of every user turn (`<|im_start|>user ... <|im_end|>\\n`), in order;
  text positions as P_text(embed(id)), media placeholders as P_hidden(the thinker's residual stream
  after `accept_hidden_layer` layers, the payload's "hidden" rows at those positions);
- 9 assistant rows from the last `<|im_start|>assistant`: P_text of its 3 tokens, tts_pad x4, tts_bos,
  P_text(first reply token); the codec embedding of [nothink, think_bos, think_eos, voice, pad, bos]
  is added to the last 6;
- per talker step k (runner's StepEmbedsAdder): P_text(reply token k + 1), ..., then tts_eos, then
  tts_pad for ever (the last row repeats). The thinker's last token is never spoken (it has no row
  in the reference either).
Prompt token ids are the codec pad id at every position: the reference's talker generates from
embeddings only, so its repetition penalty counts generated codes alone; pad is never sampled.
Talker positions: the reference runs its M-RoPE index over the talker's own ids (the user turns,
then the 9 assistant rows), so they are the thinker's positions of the user-turn tokens, each less
the tokens dropped before it (system and earlier assistant turns: text, one position each), then
the 9 rows one position apart; decode continues 1-D after the largest. For text and audio they are
0, 1, 2, ...; an image or video keeps its 3-D grid; a video holding its audio (use_audio_in_video)
mostly does not (the reference's talker is not told the mode: `talker_positions`).
"""

from __future__ import annotations

import functools
import hashlib
import threading
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from omni_server.models.checkpoint import load_tensors, read_config
from omni_server.stage import processors
from omni_server.stage.errors import RequestError
from omni_server.stage.processors import StageInput
from omni_server.stage.transfer import aside, handoff, host_index, settle, to_device, to_host
from omni_server.wire.messages import REPLY_FROM_OPTION, VOICE_OPTION, StagePayload

DEFAULT_VOICE = "ethan"  # transformers' generate() default ("Ethan"; lookups are lower-case)


@dataclass
class _Mlp:
    fc1_w: torch.Tensor
    fc1_b: torch.Tensor
    fc2_w: torch.Tensor
    fc2_b: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, self.fc1_w, self.fc1_b)), self.fc2_w, self.fc2_b)


@dataclass
class _Tables:
    device: torch.device
    embed: torch.Tensor  # the thinker's token embeddings [vocab, thinker_hidden], float32
    text: _Mlp
    hidden: _Mlp
    codec: torch.Tensor  # the talker's codec embedding [codec_vocab, talker_hidden]
    voices: dict[str, int]  # lower-case name -> codec id
    im_start: int
    user: int
    assistant: int
    tts: torch.Tensor  # P_text of tts_pad, tts_bos, tts_eos: [3, talker_hidden] (every request reads them)
    media_ids_host: torch.Tensor  # audio / image / video placeholder ids (CPU: read with the prompt ids)
    span_ids: tuple[int, int, int]  # <|vision_start|>, <|audio_start|>, <|image_pad|> (audio-in-video spans)
    assistant_codec_ids: tuple[int, int, int, int, int]  # nothink, think_bos, think_eos, (voice), pad, bos
    codec_pad: int
    codec_bos: int


_lock = threading.Lock()


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _mlp(tensors: dict[str, torch.Tensor], dev: torch.device) -> _Mlp:
    t = {k: v.to(dev, torch.float32) for k, v in tensors.items()}
    return _Mlp(t["linear_fc1.weight"], t["linear_fc1.bias"], t["linear_fc2.weight"], t["linear_fc2.bias"])


@functools.lru_cache(maxsize=4)
def _tables(model_dir: str) -> _Tables:
    cfg = read_config(model_dir)
    tcfg, thinker = cfg.talker_config, cfg.thinker_config
    act = tcfg.text_config.hidden_act
    if act != "silu":
        raise ValueError(f"{model_dir}: talker projections use {act!r}; only silu is supported")
    dev = _device()
    embed = load_tensors(model_dir, "thinker.model.embed_tokens.")["weight"].to(dev, torch.float32)
    text = _mlp(load_tensors(model_dir, "talker.text_projection."), dev)
    tables = _Tables(
        device=dev,
        embed=embed,
        text=text,
        hidden=_mlp(load_tensors(model_dir, "talker.hidden_projection."), dev),
        codec=load_tensors(model_dir, "talker.model.codec_embedding.")["weight"].to(dev, torch.float32),
        voices={k.lower(): int(v) for k, v in tcfg.speaker_id.items()},
        im_start=cfg.im_start_token_id, user=cfg.user_token_id, assistant=cfg.assistant_token_id,
        tts=text(embed[torch.tensor([cfg.tts_pad_token_id, cfg.tts_bos_token_id, cfg.tts_eos_token_id], device=dev)]),
        media_ids_host=torch.tensor([thinker.audio_token_id, thinker.image_token_id, thinker.video_token_id]),
        span_ids=(thinker.vision_start_token_id, thinker.audio_start_token_id, thinker.image_token_id),
        assistant_codec_ids=(tcfg.codec_nothink_id, tcfg.codec_think_bos_id, tcfg.codec_think_eos_id,
                             tcfg.codec_pad_id, tcfg.codec_bos_id),
        codec_pad=tcfg.codec_pad_id, codec_bos=tcfg.codec_bos_id,
    )
    settle(dev)  # complete before the processor reads them on its side stream
    return tables


def voices(model_dir: str) -> list[str]:
    """The checkpoint's voice names (lower-case, as the reference looks them up)."""
    return sorted({k.lower() for k in read_config(model_dir).talker_config.speaker_id})


def _single(payloads: dict[int, StagePayload]) -> StagePayload:
    if len(payloads) != 1:
        raise ValueError(f"expected the output of one stage, got stages {sorted(payloads)}")
    return next(iter(payloads.values()))


def _user_positions(ids: torch.Tensor, im_start: int, user: int) -> torch.Tensor:
    """Indices of the positions whose latest <|im_start|> opens a user turn (that token included)."""
    n = ids.numel()
    pos = torch.arange(n, device=ids.device)
    starts = torch.where(ids == im_start, pos, torch.full_like(pos, -1))
    latest = torch.cummax(starts, dim=0).values
    role = ids[(latest + 1).clamp(0, n - 1)]
    return torch.nonzero((latest >= 0) & (role == user)).flatten()


@processors.register("qwen3_omni_moe.thinker_to_talker")
def thinker_to_talker(payloads: dict[int, StagePayload], ctx, options: dict[str, str],
                      since: int | None = None) -> StageInput | None:
    p = _single(payloads)
    with _lock:
        t = _tables(str(ctx.stage.model))
    voice = (options.get(VOICE_OPTION) or DEFAULT_VOICE).lower()
    if voice not in t.voices:
        raise RequestError(f"unknown voice {options.get(VOICE_OPTION)!r}; available: {sorted(t.voices)}")
    prompt_ids, out_ids = list(p.prompt_token_ids), list(p.output_token_ids)
    if REPLY_FROM_OPTION in options:  # text to speech: the reply was part of the thinker's prompt
        cut = int(options[REPLY_FROM_OPTION])
        if not 0 < cut < len(prompt_ids) or not out_ids:
            raise ValueError(f"reply_from {cut} outside the prompt of {len(prompt_ids)} tokens")
        prompt_ids, out_ids = prompt_ids[:cut], prompt_ids[cut:] + out_ids[:1]
    seq = prompt_ids + out_ids
    # The reference's thinker rows: prompt + every generated token but the last. Streamed, the newest
    # token may turn out to be the last, so the same bound holds before the final chunk.
    rows = len(seq) - 1
    starts = [i for i in range(len(prompt_ids) - 1) if prompt_ids[i] == t.im_start and prompt_ids[i + 1] == t.assistant]
    if not starts:
        raise ValueError("the thinker prompt has no <|im_start|>assistant turn to speak")
    a = starts[-1]
    if len(seq) < a + 4:  # the first reply token joins the prompt
        if p.final:
            raise ValueError("the thinker produced no reply to speak")
        return None
    tts_pad, tts_bos, tts_eos = t.tts[0:1], t.tts[1:2], t.tts[2:3]
    # On a side stream, without waiting for the GPU: this runs in the stage loop, between the
    # talker's queued steps.
    if since is not None:  # started already (`since` step rows given): the reply rows from there on
        with torch.inference_mode(), aside(t.device):
            reply = t.text(t.embed[host_index(seq[a + 4 + since:rows], t.device)])
            if p.final:
                reply = torch.cat([reply, tts_eos, tts_pad])
            reply = reply.to(ctx.dtype)
        # Kept on the device (as Qwen2.5's): the stage loop does not wait for the GPU per chunk.
        reply, ready = handoff(reply)
        return StageInput(step_embeds=reply, step_ready=ready, step_offset=since)
    # Which rows are user turns and which of them media: from the ids, on the host (no GPU syncs).
    ids = torch.tensor(prompt_ids, dtype=torch.long)
    user = _user_positions(ids, t.im_start, t.user)
    media = torch.isin(ids[user], t.media_ids_host)
    hidden = None
    if bool(media.any()):
        hidden = p.tensors.get("hidden")
        need = int(user[media].max()) + 1
        if hidden is None or hidden.shape[0] < need:
            shape = None if hidden is None else tuple(hidden.shape)
            raise ValueError(f"thinker payload has hidden states {shape}; media rows up to {need} are needed")
    with torch.inference_mode(), aside(t.device):
        user_rows = t.text(t.embed[host_index(ids[user].tolist(), t.device)])
        if hidden is not None:
            at = host_index(torch.nonzero(media).flatten().tolist(), t.device)
            media_rows = to_device(hidden[user[media]], t.device, torch.float32)
            user_rows.index_copy_(0, at, t.hidden(media_rows))
        head = t.text(t.embed[host_index(seq[a:a + 4], t.device)])
        assistant = torch.cat([head[:3], tts_pad.expand(4, -1), tts_bos, head[3:4]])
        nothink, think_bos, think_eos, pad, bos = t.assistant_codec_ids
        assistant[3:] += t.codec[host_index([nothink, think_bos, think_eos, t.voices[voice], pad, bos], t.device)]
        prompt = torch.cat([user_rows, assistant])
        reply = t.text(t.embed[host_index(seq[a + 4:rows], t.device)])
        if p.final:
            reply = torch.cat([reply, tts_eos, tts_pad])
        # vLLM takes prompt embeddings on the host: copied without waiting here (the stage waits
        # after building all of a loop's inputs, StageInput.wait).
        (prompt, reply), copied = to_host(prompt, reply, dtype=ctx.dtype)
    n = prompt.shape[0]  # (known before its copy is done)
    # The ids are what a repetition penalty counts from the prompt: codec_pad is among the ids the
    # talker never samples (talker.SUPPRESSED_TOP), so the penalty counts the output codes only, as
    # transformers' (its talker.generate gets no input ids).
    positions = talker_positions(p.tensors.get("mrope_positions"), user, n - len(user), ids[user], t.span_ids)
    talker_prompt = {"type": "embeds", "prompt_embeds": prompt,
                     "prompt_token_ids": [t.codec_pad] * n, "is_token_ids": [False] * n}
    # The talker's prefix cache keys blocks by these rows' bytes, not by their positions. Text rows
    # do not depend on what came before them, and their positions do only through what the talker
    # prompt leaves out (system and assistant turns), one position a token, unless that holds media:
    # then the positions go into the key (the same rows after other media are another prefix).
    dropped = torch.ones(len(ids), dtype=torch.bool)
    dropped[user] = False
    if positions is not None and bool(torch.isin(ids[dropped], t.media_ids_host).any()):
        talker_prompt["cache_salt"] = "positions:" + hashlib.blake2b(positions.numpy().tobytes(), digest_size=16).hexdigest()
    return StageInput(prompt=talker_prompt, step_embeds=reply, positions=positions, host_ready=copied)


def talker_positions(thinker: torch.Tensor | None, user: torch.Tensor, rows: int, user_ids: torch.Tensor | None = None,
                     span_ids: tuple[int, int, int] | None = None) -> torch.Tensor | None:
    """The talker prompt's M-RoPE positions [3, len(user) + rows] from the thinker prompt's
    ([3, n], None: the thinker sent none, so plain positions) and the user-turn indices into it.

    Audio in video (`user_ids` holding <|vision_start|><|audio_start|>; `span_ids`: those two and the
    image pad): transformers' generate does not pass `use_audio_in_video` to the talker, whose rope
    index then looks for such a span's video only while an image is left to find. A span after the
    last image it reads as plain audio: from that span's <|vision_start|> on, its positions are 1-D
    and sequential (no image: `arange` throughout). Spans before an image keep the thinker's."""
    if thinker is None:
        return None
    pos = thinker[:, user].to(torch.int64) - (user - torch.arange(len(user)))  # minus the tokens dropped before
    top = int(pos.max()) if pos.numel() else -1
    k = _plain_from(user_ids, *span_ids) if span_ids is not None else None
    if k is not None:
        if k < len(user):
            pos[:, k:] = pos[0, k] + torch.arange(len(user) - k)  # (<|vision_start|>: a text position, rows equal)
        # The rows after go on from the last user row, as the reference's: a span's end tokens may
        # sit below its frames' top.
        top = int(pos[:, -1].max())
    return torch.cat([pos, torch.arange(top + 1, top + 1 + rows).expand(3, -1)], dim=1)


def _plain_from(ids: torch.Tensor, vision_start: int, audio_start: int, image: int) -> int | None:
    """None without audio-in-video spans in `ids`; else the index of the first span after the last
    image pad (len(ids): none is)."""
    spans = torch.nonzero((ids[:-1] == vision_start) & (ids[1:] == audio_start)).flatten()
    if not len(spans):
        return None
    images = torch.nonzero(ids == image).flatten()
    later = spans[spans > (int(images[-1]) if len(images) else -1)]
    return int(later[0]) if len(later) else len(ids)


thinker_to_talker.prepare = lambda stage: _tables(str(stage.stage.model))
thinker_to_talker.incremental = True
thinker_to_talker.prompt_rows_added = 9  # (the 9 assistant rows after the user turns)


@functools.lru_cache(maxsize=4)
def _code_groups(model_dir: str) -> int:
    # (Read once: transformers parses the config in ~0.2 s, and every request's first chunk has no
    # frame yet; per request, 16 of them held code2wav's loop 2.95 s on the H200, 2026-11-30g.)
    return read_config(model_dir).talker_config.num_code_groups


@processors.register("qwen3_omni_moe.talker_to_code2wav")
def talker_to_code2wav(payloads: dict[int, StagePayload], ctx, options: dict[str, str]) -> StageInput:
    """The talker's frames ([frames, 16], one per fed code: the reference's n - 1 for n sampled codes)
    as code2wav's [16, frames]."""
    codes = _single(payloads).tensors.get("codes")
    if codes is None:  # no frame yet (or the talker stopped at once)
        codes = torch.zeros(0, _code_groups(str(ctx.stage.model)), dtype=torch.long)
    return StageInput(data={"codes": codes.to(torch.long).T.contiguous()})


talker_to_code2wav.reads_hidden = False  # frames only: the talker skips its hidden states
