"""`/v1/audio/transcriptions` and `/v1/audio/translations`: an uploaded audio file becomes one chat
turn (the audio, then an instruction to transcribe or translate it) answered by the pipeline's text
stage alone."""

from __future__ import annotations

from typing import Any

import numpy as np

from omni_server.config.schema import ServerConfig

# OpenAI's `language`: an ISO-639-1 code (Whisper's languages: what speech recognisers are trained on;
# Cantonese by its ISO-639-3 code, as Whisper names it). The instruction names the language.
LANGUAGES = {
    "af": "Afrikaans", "am": "Amharic", "ar": "Arabic", "as": "Assamese", "az": "Azerbaijani", "ba": "Bashkir",
    "be": "Belarusian", "bg": "Bulgarian", "bn": "Bengali", "bo": "Tibetan", "br": "Breton", "bs": "Bosnian",
    "ca": "Catalan", "cs": "Czech", "cy": "Welsh", "da": "Danish", "de": "German", "el": "Greek",
    "en": "English", "es": "Spanish", "et": "Estonian", "eu": "Basque", "fa": "Persian", "fi": "Finnish",
    "fo": "Faroese", "fr": "French", "gl": "Galician", "gu": "Gujarati", "ha": "Hausa", "he": "Hebrew",
    "hi": "Hindi", "hr": "Croatian", "ht": "Haitian Creole", "hu": "Hungarian", "hy": "Armenian",
    "id": "Indonesian", "is": "Icelandic", "it": "Italian", "ja": "Japanese", "jv": "Javanese",
    "ka": "Georgian", "kk": "Kazakh", "km": "Khmer", "kn": "Kannada", "ko": "Korean", "la": "Latin",
    "lb": "Luxembourgish", "ln": "Lingala", "lo": "Lao", "lt": "Lithuanian", "lv": "Latvian",
    "mg": "Malagasy", "mi": "Maori", "mk": "Macedonian", "ml": "Malayalam", "mn": "Mongolian",
    "mr": "Marathi", "ms": "Malay", "mt": "Maltese", "my": "Burmese", "ne": "Nepali", "nl": "Dutch",
    "nn": "Norwegian Nynorsk", "no": "Norwegian", "oc": "Occitan", "pa": "Punjabi", "pl": "Polish",
    "ps": "Pashto", "pt": "Portuguese", "ro": "Romanian", "ru": "Russian", "sa": "Sanskrit", "sd": "Sindhi",
    "si": "Sinhala", "sk": "Slovak", "sl": "Slovenian", "sn": "Shona", "so": "Somali", "sq": "Albanian",
    "sr": "Serbian", "su": "Sundanese", "sv": "Swedish", "sw": "Swahili", "ta": "Tamil", "te": "Telugu",
    "tg": "Tajik", "th": "Thai", "tk": "Turkmen", "tl": "Tagalog", "tr": "Turkish", "tt": "Tatar",
    "uk": "Ukrainian", "ur": "Urdu", "uz": "Uzbek", "vi": "Vietnamese", "yi": "Yiddish", "yo": "Yoruba",
    "yue": "Cantonese", "zh": "Chinese",
}


class LanguageError(ValueError):
    """A `language` that is not a code of LANGUAGES (the message is the client's)."""


# Formats with per-segment timestamps, which a chat model does not produce.
TIMED_FORMATS = ("verbose_json", "srt", "vtt", "diarized_json")
FORMATS = ("json", "text")


def instruction(server: ServerConfig, language: str | None, prompt: str | None) -> str:
    """The text that follows the audio in a transcription's user turn."""
    if language:
        name = LANGUAGES.get(language.strip().lower())
        if name is None:  # (the instruction would carry the client's text as the language's name)
            raise LanguageError(f"language {language!r} is not an ISO-639-1 code of a language this server "
                                "transcribes (e.g. en, zh, de, yue)")
        text = server.transcription_language_prompt.format(language=name)
    else:
        text = server.transcription_prompt
    return _with_prompt(text, prompt)


def translation(server: ServerConfig, prompt: str | None) -> str:
    """The text that follows the audio in a translation's user turn."""
    return _with_prompt(server.translation_prompt, prompt)


def _with_prompt(text: str, prompt: str | None) -> str:
    if prompt:  # OpenAI's `prompt`: earlier text or spellings to follow
        text += f"\nText that may precede it, or words it may contain: {prompt}"
    return text


def messages(server: ServerConfig, text: str) -> list[dict[str, Any]]:
    """The chat (as the chat template reads it): the audio, then `text`, after the system prompt."""
    turn = {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": text}]}
    if server.transcription_system_prompt is None:
        return [turn]
    return [{"role": "system", "content": server.transcription_system_prompt}, turn]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """OpenAI's token usage of a transcription."""
    return {"type": "tokens", "input_tokens": prompt_tokens, "output_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def pieces(wave: np.ndarray, clip_s: float | None, rate: int) -> list[np.ndarray]:
    """The file cut into clips the model hears whole (`clip_s` each at most; None: one clip), each cut
    at the quietest 100 ms of the 2 s before the limit (not through a word where there is a pause),
    the last at least 1 s long."""
    if clip_s is None or wave.size <= clip_s * rate:
        return [wave]
    clip, window, search, tail = int(clip_s * rate), rate // 10, 2 * rate, rate
    out, start = [], 0
    while wave.size - start > clip:
        hi = min(start + clip, wave.size - tail)
        lo = max(hi - search, start + 1)
        frames = (hi - lo) // window
        if frames > 0:
            energy = np.square(wave[lo:lo + frames * window].reshape(frames, window)).sum(axis=1)
            cut = lo + int(np.argmin(energy)) * window + window // 2
        else:
            cut = hi
        out.append(wave[start:cut])
        start = cut
    out.append(wave[start:])
    return out
