"""A chat request's media parts (audio, images, video), decoded as the first stage reads them."""

from __future__ import annotations

import asyncio
import functools
import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from omni_server.api import audio, fetch, image, video
from omni_server.api.errors import APIError
from omni_server.api.protocol import ChatCompletionRequest
from omni_server.config.schema import PipelineConfig, ServerConfig
from omni_server.wire.messages import AUDIO_SAMPLE_RATE

# Media is decoded on threads of its own, a few at a time: a slow decode (a long video, many
# images) then waits for these, not for the loop's default threads, which encode every streamed
# reply's audio and render prompts; and the memory decodes hold at once stays bounded.
_DECODERS = ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)), thread_name_prefix="omni-media")


async def off_loop(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` on a media decoding thread."""
    return await asyncio.get_running_loop().run_in_executor(_DECODERS, functools.partial(fn, *args, **kwargs))


# Each media part type and the kind of input it is (the chat template's placeholder).
KIND = {"input_audio": "audio", "audio_url": "audio", "image_url": "image", "video_url": "video"}
# A URL part's file bytes from its data: URL, per kind.
_DATA_URL_BYTES = {"audio": audio.audio_data_url, "image": image.image_data_url, "video": video.video_data_url}


def cap(cfg: PipelineConfig, kind: str) -> int | None:
    """How many `kind` inputs stage 0's engine takes per prompt (its limit_mm_per_prompt, which
    vLLM also takes as {count: N, ...}); None: not limited (vLLM limits only the kinds it lists)."""
    limit = (cfg.stages[0].engine_args.get("limit_mm_per_prompt") or {}).get(kind)
    return limit.get("count") if isinstance(limit, dict) else limit


def takes_audio(cfg: PipelineConfig) -> bool:
    limit = cap(cfg, "audio")
    return limit is None or bool(limit)


def template_message(m) -> dict[str, Any]:
    """A message as the chat template reads it (media parts become placeholders; OpenAI's
    `developer` role is the system turn, as /v1/responses reads it: the templates know no other)."""
    role = "system" if m.role == "developer" else m.role
    if not m.media_parts():
        out: dict[str, Any] = {"role": role, "content": m.text()}
    else:
        out = {"role": role, "content": [{"type": "text", "text": p.text} if p.type == "text"
                                         else {"type": KIND[p.type]} for p in m.content]}
    if m.tool_calls:  # (arguments as objects where they parse, as templates write them with tojson)
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # (JSON nested past Python's recursion limit: as text)
        return text


def check_clip(wave, clip_s: float | None, name: str, param: str) -> None:
    """A clip longer than the model hears of one (`clip_s`, stage 0's processor cuts the rest) is
    refused: the reply would be about its start alone, with nothing to say so."""
    if clip_s is not None and wave.size > clip_s * AUDIO_SAMPLE_RATE:
        raise APIError(400, f"{name}: audio is {wave.size / AUDIO_SAMPLE_RATE:.1f} s long; this model hears at "
                            f"most {clip_s:g} s of a clip (its processor drops the rest): send it in pieces "
                            f"of up to {clip_s:g} s", param=param)


async def decode_media(cfg: PipelineConfig, body: ChatCompletionRequest, audio_clip_s: float | None = None,
                       param: str = "messages") -> dict[str, Any]:
    """Decoded media parts as the first stage reads them: "audio.N" (16 kHz mono float32),
    "image.N" (RGB uint8) and "video.N" (RGB uint8 frames, `video.FPS` a second), numbered in prompt
    order per kind; http(s) URLs fetched where the deployment allows (api/fetch.py). A clip longer
    than `audio_clip_s` is refused (`check_clip`). Errors name `param`, the request's messages.
    With `use_audio_in_video`, video N's audio track is "audio.N" (the request has no other audio)."""
    import torch

    parts = [p for m in body.messages for p in m.media_parts()]
    in_video = body.audio_in_video()
    if in_video:
        _check_audio_in_video(parts)
    out: dict[str, Any] = {}
    counts = {"audio": 0, "image": 0, "video": 0}
    held = 0

    def count(kind: str, what: str) -> int:
        counts[kind] += 1
        limit = cap(cfg, kind)  # (vLLM would refuse more, after the decoding)
        if isinstance(limit, int) and counts[kind] > limit:
            raise APIError(400, f"this pipeline takes at most {limit} {kind} input(s) per request "
                                f"(stage 0's limit_mm_per_prompt){what}", param=param)
        return counts[kind] - 1

    def hold(name: str, array, where: str) -> None:
        nonlocal held
        held += array.nbytes
        if held > cfg.server.max_media_bytes:
            raise APIError(400, f"the request's media decode to more than {cfg.server.max_media_bytes} bytes "
                                f"(server.max_media_bytes), at {where}", param=param)
        out[name] = torch.from_numpy(array)

    for part in parts:
        kind = KIND[part.type]
        i = count(kind, "")
        with_track = in_video and kind == "video"
        if with_track:
            count("audio", ": each video's audio track is one")
        try:
            if with_track:  # (the track first: a refused one spares decoding the frames)
                data = await _file_bytes(cfg.server, part)
                track = await off_loop(video.decode_video_audio, data, target_rate=AUDIO_SAMPLE_RATE,
                                       max_seconds=cfg.server.max_audio_seconds)
                check_clip(track, audio_clip_s, f"{part.type} {i}'s audio track", param=param)
                hold(f"audio.{i}", track, f"{part.type} {i}")
                array = await off_loop(_decode_video, cfg.server, data)
            else:
                array = await decode_part(cfg.server, part)
        except (audio.AudioError, image.ImageError, video.VideoError, fetch.FetchError) as e:
            raise APIError(400, f"{part.type} {i}: {e}", param=param) from None
        if kind == "audio":
            check_clip(array, audio_clip_s, f"{part.type} {i}", param=param)
        hold(f"{kind}.{i}", array, f"{part.type} {i}")
    return out


def _check_audio_in_video(parts: list) -> None:
    """A request hearing its videos' tracks has videos, and no audio of its own (the model pairs
    the k-th audio input with the k-th video: another would take a video's place)."""
    param = "mm_processor_kwargs.use_audio_in_video"
    if not any(KIND[p.type] == "video" for p in parts):
        raise APIError(400, "use_audio_in_video needs a video_url part (it hears each video's audio track)",
                       param=param)
    own = next((p for p in parts if KIND[p.type] == "audio"), None)
    if own is not None:
        raise APIError(400, f"use_audio_in_video takes the videos' own audio tracks: a request with it cannot "
                            f"have {own.type} parts as well", param=param)


async def decode_part(limits: ServerConfig, part) -> Any:
    """One media part's array (see `decode_media`)."""
    if part.type == "input_audio":
        return await off_loop(audio.decode_base64_audio, part.input_audio.data, target_rate=AUDIO_SAMPLE_RATE,
                              max_bytes=limits.max_request_bytes, max_seconds=limits.max_audio_seconds)
    kind, data = KIND[part.type], await _file_bytes(limits, part)
    if kind == "audio":
        return await off_loop(audio.decode_audio, data, target_rate=AUDIO_SAMPLE_RATE,
                              max_bytes=limits.max_request_bytes, max_seconds=limits.max_audio_seconds)
    if kind == "image":
        return await off_loop(image.decode_image, data, max_pixels=limits.max_image_pixels)
    return await off_loop(_decode_video, limits, data)


def _decode_video(limits: ServerConfig, data: bytes):
    return video.decode_video(data, max_pixels=limits.max_image_pixels, max_frames=limits.max_video_frames,
                              max_total_pixels=limits.max_video_pixels)


async def _file_bytes(limits: ServerConfig, part) -> bytes:
    """A URL part's file: fetched (http(s), where the deployment allows) or from its data: URL."""
    url, kind = getattr(part, part.type).url, KIND[part.type]
    if fetch.is_remote(url):
        return await fetch.fetch(url, kind=kind, domains=limits.media_url_domains, private=limits.media_url_private,
                                 max_bytes=limits.max_request_bytes, timeout_s=limits.media_url_timeout_s,
                                 ca_file=limits.media_url_ca_file)
    return await off_loop(_DATA_URL_BYTES[kind], url, max_bytes=limits.max_request_bytes)
