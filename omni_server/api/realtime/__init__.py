"""OpenAI's Realtime API over a WebSocket (`/v1/realtime?model=...`, the `openai` client's
`realtime.connect`): the client appends audio (24 kHz PCM16, or G.711 at 8 kHz) to the input buffer,
whose turns turn detection finds (or the client commits), or creates items of text, audio or images;
a response answers the conversation (`response.create`, or at a detected turn's end). With
`?intent=transcription`, a transcription session: each turn transcribed, no responses.

A response is a chat turn over the conversation so far: the session's instructions as the system
message, user audio as `input_audio` (WAV of the buffer), earlier replies as their text or
transcript; it runs on the chat path (`start_chat`: the same template, limits and sampling) and
streams back as OpenAI's events (`response.output_audio.delta` of 24 kHz PCM16 with
`response.output_audio_transcript.delta`, or `response.output_text.delta`). One response at a time
per session; `response.cancel` aborts it. With input transcription on, each user audio item is
transcribed by the pipeline's text stage (the /v1/audio/transcriptions turn), and audio items past
what the pipeline hears a prompt are sent by their transcripts (the latest as audio). Turn
detection (`server_vad`, on by default as OpenAI's is; `turns.py`) ends turns in the appended
audio instead of the client: a detected turn is committed, answered, and cuts off a response under
way. Tools are refused with an `error` event, not ignored; a bad event is an `error` event and the
session goes on.
"""

from omni_server.api.realtime.session import Session

__all__ = ["Session"]
