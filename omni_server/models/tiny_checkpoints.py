"""Tiny random-weight checkpoints for tests and local development.

The real Qwen2.5-Omni weights are ~20 GB and cannot be downloaded on the machines this project runs
on, so the pipeline is exercised end to end on two local stand-ins, built here in a few seconds:

* ``tiny-qwen2_5-omni``: a complete Qwen2.5-Omni checkpoint (thinker with audio and vision towers,
  talker, token2wav, ``spk_dict.pt``, tokenizer, chat template and processor files).  vLLM serves
  its thinker on CPU; transformers can run the whole thinker -> talker -> token2wav chain.
* ``tiny-embeds-lm``: a tiny Qwen2 causal LM whose hidden size equals the thinker's, standing in
  for a later stage that takes the thinker's hidden states as prompt embeddings.
* ``tiny-qwen3-omni-moe``: a complete Qwen3-Omni-MoE checkpoint (MoE thinker with audio and
  vision towers, MoE talker with its code predictor, code2wav, tokenizer with Qwen3-Omni's special
  tokens, processor files).  vLLM serves its thinker on CPU (architecture
  ``Qwen3OmniMoeForConditionalGeneration``, no ``hf_overrides`` needed).

All are seeded, so every build writes byte-identical files.  A random talker almost never emits
its end-of-speech code, so callers of transformers' full ``generate(..., return_audio=True)`` must
pass a small ``talker_max_new_tokens`` (the default, 4096, makes token2wav crawl on CPU).

Usage::

    python -m omni_server.models.tiny_checkpoints [--out-dir var/models] [--force]
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = [
    "TINY_EMBEDS_LM",
    "TINY_OMNI",
    "TINY_QWEN3_OMNI",
    "build_tiny_embeds_lm",
    "build_tiny_qwen2_5_omni",
    "build_tiny_qwen3_omni",
    "ensure_all",
    "main",
]

TINY_OMNI = "tiny-qwen2_5-omni"
TINY_EMBEDS_LM = "tiny-embeds-lm"
TINY_QWEN3_OMNI = "tiny-qwen3-omni-moe"

DEFAULT_OUT_DIR = Path("var/models")

# Written last into a finished checkpoint.  It records the recipe version, so that a checkpoint
# left behind by an older version of this module is rebuilt instead of being silently reused:
# bump RECIPE_VERSION whenever the files written here change.
COMPLETE_MARKER = ".tiny-checkpoint-complete"
RECIPE_VERSION = 2

SEED = 1234

# ---------------------------------------------------------------------------------------------
# Vocabulary
# ---------------------------------------------------------------------------------------------

# Byte-level BPE is trained on this fixed text.  Its variety bounds how many merges the trainer
# can find, so it must yield at least _BPE_VOCAB_SIZE tokens (checked when training); the chat
# lines make "user" a single token, as in the real vocabulary.
_CORPUS = """\
The quick brown fox jumps over the lazy dog while the sun sets behind the hills.
A small model can still be useful when it is used to test the plumbing of a large system.
Hello, how are you today? I am fine, thank you. What would you like to talk about?
The weather is nice and warm, so we decided to walk to the park near the river.
Please describe the picture, the sound and the video that I am sending to you.
Speech synthesis turns written text into audio that people can listen to.
Numbers such as 1, 2, 3, 10, 42 and 2025 appear in many everyday sentences.
You are a helpful assistant. Answer the question briefly and clearly.
The system prompt sets the rules, the user asks a question and the assistant answers it.
A conversation has a system message, then user and assistant messages take turns.
system: Keep the answers short and polite.
user: What time is it in Tokyo right now?
assistant: It is half past four in the afternoon there.
user: And what is the weather like?
assistant: Sunny and mild, with a light breeze.
The server receives a request, runs every stage of the pipeline and streams the answer back.
Each stage reads the output of the previous one: first the thinker writes text, then the talker speaks it.
An image is split into patches, a recording into frames, and a video into pictures over time.
She sings a song about the ocean, the stars, the moon and the long road home.
Can you tell me a story about a robot who learns to paint flowers in the garden?
Yesterday it rained all afternoon, but this morning the sky was clear and blue.
The library opens at nine o'clock and closes at six in the evening, except on Sunday.
We're going to the market to buy apples, bread, cheese, milk, eggs and fresh vegetables.
They'll arrive on the train from the north station after lunch, if it isn't late.
Good morning! Welcome to the show. Today we talk with an engineer who builds voice assistants.
Listen carefully to the music: the piano starts softly, then the drums and the violins join in.
Write a short poem about winter, snow, cold wind and a warm cup of tea by the window.
The children played football in the yard until their mother called them for dinner.
Computers store information as bits, and programs transform that information step by step.
Translate this sentence into French, German, Spanish and Chinese, please.
My favourite colours are green, purple, orange and the deep red of autumn leaves.
Thank you for waiting. Your order has been shipped and should arrive within three days.
How many legs does a spider have? Eight, while an insect has only six.
The doctor said I should sleep more, drink water, and take a walk every single day.
In the beginning there was silence, and then somebody laughed, and everybody smiled.
Open the door, turn on the light, sit down at the table and read the letter aloud.
Mountains, valleys, forests, deserts, islands and lakes make the planet beautiful.
The engine keeps a cache of keys and values so that each new token only looks at the past once.
Our team measured latency, throughput and memory while the benchmark was running overnight.
Quietly, the old clock in the kitchen ticked, and the cat yawned near the fireplace.
Why is the sky blue? Because air scatters short wavelengths of sunlight more than long ones.
"""

# Qwen2's pre-tokenizer split (as in transformers' Qwen2Tokenizer), so that the tiny tokenizer
# segments text the way the real one does.
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_BPE_VOCAB_SIZE = 1024  # ids 0..1023 are learned BPE tokens (0..255 the byte alphabet)
_USER_TOKEN = "user"

# Special tokens follow the BPE vocabulary in the order of the real Qwen2.5-Omni vocabulary, where
# they start at 151643: tiny id = real id - 151643 + 1024.
_QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_bos|>",
    "<|vision_eos|>",
    "<|vision_pad|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
]
# The talker reads its text-stream markers and each voice's start token through the thinker's
# embedding table.  The real checkpoint keeps them in unnamed slots past its tokenizer; here they
# are named tokens, so that every id the thinker can emit also decodes.
_TTS_TOKENS = ["<|tts_pad|>", "<|tts_bos|>", "<|tts_eos|>"]
_VOICES = ["Chelsie", "Ethan"]
_VOICE_TOKENS = [f"<|voice_{voice.lower()}|>" for voice in _VOICES]

# Text vocabulary of the thinker and of tiny-embeds-lm.  Reserved specials fill it up, so that the
# tokenizer and the embedding table have the same size.
TEXT_VOCAB_SIZE = 1280

_SPECIAL_TOKENS = _QWEN_SPECIAL_TOKENS + _TTS_TOKENS + _VOICE_TOKENS
# Added tokens the real Qwen tokenizers keep as text (not special): decoded replies show them, so
# tool calls (`<tool_call>`) and thinking (`<think>`) survive detokenization.
_TEXT_MARKERS = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
                 "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}
_RESERVED_TOKENS = [
    f"<|reserved_special_token_{i}|>" for i in range(TEXT_VOCAB_SIZE - _BPE_VOCAB_SIZE - len(_SPECIAL_TOKENS))
]


def _token_id(token: str) -> int:
    return _BPE_VOCAB_SIZE + (_SPECIAL_TOKENS + _RESERVED_TOKENS).index(token)


ENDOFTEXT_ID = _token_id("<|endoftext|>")  # 1024, also the pad token
IM_START_ID = _token_id("<|im_start|>")  # 1025
IM_END_ID = _token_id("<|im_end|>")  # 1026, the eos token
AUDIO_TOKEN_ID = _token_id("<|AUDIO|>")  # 1027
AUDIO_BOS_ID = _token_id("<|audio_bos|>")  # 1028
AUDIO_EOS_ID = _token_id("<|audio_eos|>")  # 1029
VISION_BOS_ID = _token_id("<|vision_bos|>")  # 1033
VISION_EOS_ID = _token_id("<|vision_eos|>")  # 1034
VISION_PAD_ID = _token_id("<|vision_pad|>")  # 1035
IMAGE_TOKEN_ID = _token_id("<|IMAGE|>")  # 1036
VIDEO_TOKEN_ID = _token_id("<|VIDEO|>")  # 1037
TTS_PAD_ID = _token_id("<|tts_pad|>")  # 1046
TTS_BOS_ID = _token_id("<|tts_bos|>")  # 1047
TTS_EOS_ID = _token_id("<|tts_eos|>")  # 1048

# Qwen2_5OmniProcessor finds its multimodal markers through these tokenizer attributes.
_NAMED_MULTIMODAL_TOKENS = {
    "image_token": "<|IMAGE|>",
    "audio_token": "<|AUDIO|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}

# The real model only speaks under this system prompt, and its chat template inserts it when a
# conversation has none; the tiny template does the same, so prompts have the real shape.
DEFAULT_SYSTEM_PROMPT = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving "
    "auditory and visual inputs, as well as generating text and speech."
)

# ChatML with Qwen2.5-Omni's placeholders for audio / image / video content parts.  It loops over
# list contents, so vLLM hands it OpenAI-style content parts ("openai" content format).
CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}"
    "{% set image_count = namespace(value=0) %}"
    "{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}"
    "{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "{% set audio_count.value = audio_count.value + 1 %}"
    "{% if add_audio_id %}Audio {{ audio_count.value }}: {% endif %}"
    "<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif content['type'] == 'video' or 'video' in content or 'video_url' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% elif 'text' in content %}"
    "{{ content['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "<|im_start|>assistant\n"
    "{% endif %}"
)

# ---------------------------------------------------------------------------------------------
# Model configuration
# ---------------------------------------------------------------------------------------------

# vLLM's CPU attention only has kernels for some head sizes (32, 64, 80, 96, ...): the thinker and
# the embeds LM use 64, the talker 32.
THINKER_HIDDEN_SIZE = 128
_THINKER_HEADS = 2
_THINKER_HEAD_DIM = THINKER_HIDDEN_SIZE // _THINKER_HEADS
# Multimodal RoPE splits the head_dim / 2 rotary frequencies over (time, height, width); the real
# model uses [16, 24, 24] for head_dim 128.
_THINKER_MROPE_SECTION = [8, 12, 12]

_TALKER_HIDDEN_SIZE = 64
_TALKER_HEADS = 2
_TALKER_HEAD_DIM = 32
_TALKER_MROPE_SECTION = [4, 6, 6]

# The talker keeps the real codec vocabulary and codec ids: transformers'
# Qwen2_5OmniForConditionalGeneration.generate hard-codes 8292 / 8294 as its default end-of-speech
# ids, and a talker stage configured for the real model uses the same ones.
_CODEC_VOCAB_SIZE = 8448
_CODEC_PAD_ID = 8292
_CODEC_BOS_ID = 8293
_CODEC_EOS_ID = 8294
_CODEC_MASK_ID = 8296

_MEL_DIM = 80  # mel bins between DiT and vocoder; a property of the design, not of its size
_SPEAKER_EMBED_DIM = 32  # DiT `enc_emb_dim`: the size of each voice's `cond` vector
_REF_MEL_FRAMES = 48  # length of each voice's reference mel spectrogram

# Images are resized to at most 128 merged tokens (the real model allows 16384): prompts stay
# short and the CPU vision tower fast.
_MIN_PIXELS = 4 * 28 * 28
_MAX_PIXELS = 128 * 28 * 28

# transformers' default init (std 0.02) makes models this small ignore their input: every prompt
# then yields the same greedy tokens, which would hide routing bugs in tests.  With a wider init
# the output depends on the prompt, on its images and audio, and on upstream hidden states.
_INIT_STD = 0.1


def _omni_config() -> Any:
    from transformers import Qwen2_5OmniConfig

    text_config = {
        "vocab_size": TEXT_VOCAB_SIZE,
        "hidden_size": THINKER_HIDDEN_SIZE,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": _THINKER_HEADS,
        "num_key_value_heads": 1,
        "head_dim": _THINKER_HEAD_DIM,
        "max_position_embeddings": 32768,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": _THINKER_MROPE_SECTION,
        },
        "rms_norm_eps": 1e-6,
        "initializer_range": _INIT_STD,
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": IM_END_ID,
        "pad_token_id": ENDOFTEXT_ID,
        "tie_word_embeddings": False,
    }
    audio_config = {
        "num_mel_bins": 128,  # the feature extractor's feature_size
        "d_model": 64,
        "encoder_layers": 2,
        "encoder_attention_heads": 2,
        "encoder_ffn_dim": 128,
        "max_source_positions": 1500,
        "n_window": 100,
        "output_dim": THINKER_HIDDEN_SIZE,
        "initializer_range": _INIT_STD,
    }
    vision_config = {
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [1],  # must index existing blocks
        "out_hidden_size": THINKER_HIDDEN_SIZE,
        "tokens_per_second": 25,
        "initializer_range": _INIT_STD,
    }
    # Multimodal placeholder ids, the same in the thinker and the talker configs.
    media_ids = {
        "audio_token_index": AUDIO_TOKEN_ID,
        "image_token_index": IMAGE_TOKEN_ID,
        "video_token_index": VIDEO_TOKEN_ID,
        "audio_start_token_id": AUDIO_BOS_ID,
        "audio_end_token_id": AUDIO_EOS_ID,
        "vision_start_token_id": VISION_BOS_ID,
        "vision_end_token_id": VISION_EOS_ID,
    }
    thinker_config = {
        "text_config": text_config,
        "audio_config": audio_config,
        "vision_config": vision_config,
        **media_ids,
        "vision_token_id": VISION_PAD_ID,
        "bos_token_id": IM_START_ID,
        "eos_token_id": IM_END_ID,
        "pad_token_id": ENDOFTEXT_ID,
        "user_token_id": _bpe_tokenizer().token_to_id(_USER_TOKEN),
        "position_id_per_seconds": 25,
        "seconds_per_chunk": 2,
        "initializer_range": _INIT_STD,
        "tie_word_embeddings": False,
    }
    talker_config = {
        "vocab_size": _CODEC_VOCAB_SIZE,
        "embedding_size": THINKER_HIDDEN_SIZE,
        "hidden_size": _TALKER_HIDDEN_SIZE,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": _TALKER_HEADS,
        "num_key_value_heads": 1,
        "head_dim": _TALKER_HEAD_DIM,
        "max_position_embeddings": 32768,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": _TALKER_MROPE_SECTION,
        },
        "tts_codec_start_token_id": _CODEC_BOS_ID,
        "tts_codec_end_token_id": _CODEC_EOS_ID,
        "tts_codec_pad_token_id": _CODEC_PAD_ID,
        "tts_codec_mask_token_id": _CODEC_MASK_ID,
        # The talker's text stream and its position ids use thinker token ids.
        "tts_text_start_token_id": TTS_BOS_ID,
        "tts_text_end_token_id": TTS_EOS_ID,
        "tts_text_pad_token_id": TTS_PAD_ID,
        **media_ids,
        "position_id_per_seconds": 25,
        "seconds_per_chunk": 2,
        "spatial_merge_size": 2,
        "initializer_range": _INIT_STD,
        "tie_word_embeddings": False,
    }
    token2wav_config = {
        "dit_config": {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "head_dim": 32,
            "ff_mult": 2,
            "emb_dim": 32,
            # One row per talker id (the real DiT has 8193), so that any code a random talker
            # emits can be vocoded instead of indexing out of range.
            "num_embeds": _CODEC_VOCAB_SIZE,
            "repeats": 2,
            "block_size": 24,
            "look_ahead_layers": [1],
            "look_backward_layers": [0],
            "mel_dim": _MEL_DIM,
            "enc_emb_dim": _SPEAKER_EMBED_DIM,
            "enc_dim": 32,
            "enc_channels": [32, 32, 32, 32, 96],
            "enc_kernel_sizes": [5, 3, 3, 3, 1],
            "enc_dilations": [1, 2, 3, 4, 1],
            "enc_attention_channels": 16,
            "enc_res2net_scale": 2,
            "enc_se_channels": 16,
            "dropout": 0.0,
            "initializer_range": _INIT_STD,
        },
        "bigvgan_config": {
            "mel_dim": _MEL_DIM,
            # Six upsampling stages (240x, as in the real vocoder) each halve the channels: 64 -> 1.
            "upsample_initial_channel": 64,
            "resblock_kernel_sizes": [3],
            "resblock_dilation_sizes": [[1, 3, 5]],
            "upsample_rates": [5, 3, 2, 2, 2, 2],
            "upsample_kernel_sizes": [11, 7, 4, 4, 4, 4],
            # With the default 0.02 the waveform peaks near 1e-7, i.e. silence once written as PCM.
            "initializer_range": _INIT_STD,
        },
    }
    config = Qwen2_5OmniConfig(
        thinker_config=thinker_config,
        talker_config=talker_config,
        token2wav_config=token2wav_config,
        enable_audio_output=True,
    )
    config.architectures = ["Qwen2_5OmniForConditionalGeneration"]
    return config


def _speaker_dict() -> dict[str, dict[str, Any]]:
    """Voices in the layout transformers' Qwen2.5-Omni generate() reads from spk_dict.pt."""
    import torch

    generator = torch.Generator().manual_seed(SEED)
    return {
        voice: {
            # thinker token that opens the talker's text stream for this voice
            "bos_token": _token_id(token),
            # speaker embedding for the DiT, (1, enc_emb_dim)
            "cond": torch.randn(1, _SPEAKER_EMBED_DIM, generator=generator),
            # reference mel spectrogram for the DiT's speaker encoder, (1, frames, mel_dim)
            "ref_mel": torch.randn(1, _REF_MEL_FRAMES, _MEL_DIM, generator=generator),
        }
        for voice, token in zip(_VOICES, _VOICE_TOKENS)
    }


# ---------------------------------------------------------------------------------------------
# Tokenizer and processor files
# ---------------------------------------------------------------------------------------------


@functools.cache
def _bpe_tokenizer() -> Any:
    """The byte-level BPE trained on _CORPUS, without special tokens (callers copy it)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    if tokenizer.get_vocab_size() != _BPE_VOCAB_SIZE:
        raise RuntimeError(
            f"the tokenizer corpus yields {tokenizer.get_vocab_size()} BPE tokens, "
            f"{_BPE_VOCAB_SIZE} are needed: lengthen _CORPUS"
        )
    if tokenizer.token_to_id(_USER_TOKEN) is None:
        raise RuntimeError(f"{_USER_TOKEN!r} must be a single BPE token: start more _CORPUS lines with it")
    return tokenizer


def _qwen_tokenizer(
    *,
    multimodal: bool,
    specials: list[str] | None = None,
    named_tokens: dict[str, str] | None = None,
    chat_template: str = CHAT_TEMPLATE,
) -> Any:
    """A transformers Qwen2Tokenizer over the tiny BPE, with every special token at its fixed id.

    `specials` (default: Qwen2.5-Omni's, then reserved slots) follow the BPE ids in order;
    `named_tokens` are the processor's multimodal marker attributes (with `multimodal`).
    """
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    specials = _SPECIAL_TOKENS + _RESERVED_TOKENS if specials is None else specials
    backend = copy.deepcopy(_bpe_tokenizer())
    for token in specials:  # (one at a time: each takes the next id, whichever kind it is)
        if token in _TEXT_MARKERS:
            backend.add_tokens([AddedToken(token, special=False, normalized=False)])
        else:
            backend.add_special_tokens([AddedToken(token, special=True, normalized=False)])
    if backend.get_vocab_size() != TEXT_VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {backend.get_vocab_size()} tokens, expected {TEXT_VOCAB_SIZE}")
    named = _NAMED_MULTIMODAL_TOKENS if named_tokens is None else named_tokens
    extra = {"extra_special_tokens": dict(named)} if multimodal else {}
    return Qwen2Tokenizer(
        tokenizer_object=backend,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        chat_template=chat_template,
        **extra,
    )


def _save_omni_processor(path: Path) -> None:
    """Write the tokenizer and processor_config.json (feature extractor, image and video processor)."""
    from transformers import (
        Qwen2_5OmniProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
        WhisperFeatureExtractor,
    )

    vision = {
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "size": {"shortest_edge": _MIN_PIXELS, "longest_edge": _MAX_PIXELS},
    }
    feature_extractor = WhisperFeatureExtractor(
        feature_size=128,
        sampling_rate=16000,
        hop_length=160,
        # Audio is padded to (and cut at) this many seconds, and vLLM profiles its encoder budget
        # with a clip this long (30 s -> 750 audio tokens).  The real model uses 300.
        chunk_length=30,
        n_fft=400,
        padding_value=0.0,
        return_attention_mask=True,
    )
    processor = Qwen2_5OmniProcessor(
        image_processor=Qwen2VLImageProcessor(**vision),
        # Qwen2_5OmniProcessor overrides this size with its own video defaults (at least 128 tokens
        # per 2 frames) unless the caller passes size / min_pixels / max_pixels.
        video_processor=Qwen2VLVideoProcessor(**vision),
        feature_extractor=feature_extractor,
        tokenizer=_qwen_tokenizer(multimodal=True),
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _write_generation_config(path: Path) -> None:
    # Stop and pad ids only: vLLM takes its default sampling parameters (temperature, top_p,
    # repetition_penalty, ...) from this file.  A single eos keeps vLLM's stop set equal to the one
    # transformers' thinker.generate derives from the thinker config.
    _write_json(
        path / "generation_config.json",
        {"bos_token_id": ENDOFTEXT_ID, "eos_token_id": IM_END_ID, "pad_token_id": ENDOFTEXT_ID},
    )


# ---------------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------------


@contextmanager
def _seeded_and_quiet(seed: int) -> Iterator[None]:
    """Seed torch without disturbing the caller's RNG; mute transformers' warnings and progress bars."""
    import torch
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    progress_bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if progress_bars:
            hf_logging.enable_progress_bar()


def build_tiny_qwen2_5_omni(path: str | os.PathLike[str]) -> Path:
    """Write the tiny Qwen2.5-Omni checkpoint into `path` (created if missing; expected empty)."""
    import torch
    from transformers import Qwen2_5OmniForConditionalGeneration

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with _seeded_and_quiet(SEED):
        model = Qwen2_5OmniForConditionalGeneration(_omni_config()).to(torch.float32).eval()
        model.save_pretrained(path, safe_serialization=True)
        torch.save(_speaker_dict(), path / "spk_dict.pt")
        _save_omni_processor(path)
    _write_generation_config(path)
    _mark_complete(path)
    return path


def build_tiny_embeds_lm(path: str | os.PathLike[str], hidden_size: int = THINKER_HIDDEN_SIZE) -> Path:
    """Write a tiny Qwen2ForCausalLM taking `hidden_size`-wide prompt embeddings into `path`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    head_dim = 64 if hidden_size % 64 == 0 else 32
    if hidden_size % head_dim:
        raise ValueError(f"hidden_size must be a multiple of 32 (vLLM CPU head sizes), got {hidden_size}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = Qwen2Config(
        vocab_size=TEXT_VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=hidden_size // head_dim,
        num_key_value_heads=1,
        head_dim=head_dim,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        rms_norm_eps=1e-6,
        initializer_range=_INIT_STD,
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=IM_END_ID,
        pad_token_id=ENDOFTEXT_ID,
        tie_word_embeddings=False,
        architectures=["Qwen2ForCausalLM"],
    )
    # A different seed from the thinker's, so that the two models' weights are unrelated.
    with _seeded_and_quiet(SEED + 1):
        model = Qwen2ForCausalLM(config).to(torch.float32).eval()
        model.save_pretrained(path, safe_serialization=True)
        _qwen_tokenizer(multimodal=False).save_pretrained(path)
    _write_generation_config(path)
    _mark_complete(path)
    return path


# ---------------------------------------------------------------------------------------------
# Qwen3-Omni-MoE
# ---------------------------------------------------------------------------------------------

# Qwen3-Omni's special tokens in the order of its real vocabulary, where they start at 151643 as
# well: tiny id = real id - 151643 + 1024 (so <|audio_start|> 151669 -> 1050, <|audio_pad|>
# 151675 -> 1056).  The same BPE as the Qwen2.5-Omni tokenizer precedes them.
_QWEN3_OMNI_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
]
_QWEN3_OMNI_VOCAB = _QWEN3_OMNI_SPECIAL_TOKENS + [
    f"<|reserved_special_token_{i}|>"
    for i in range(TEXT_VOCAB_SIZE - _BPE_VOCAB_SIZE - len(_QWEN3_OMNI_SPECIAL_TOKENS))
]


def _qwen3_omni_token_id(token: str) -> int:
    return _BPE_VOCAB_SIZE + _QWEN3_OMNI_VOCAB.index(token)


# Qwen3OmniMoeProcessor reads its multimodal markers from these tokenizer attributes.
_QWEN3_OMNI_NAMED_TOKENS = {
    "image_token": "<|image_pad|>",
    "audio_token": "<|audio_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}

# ChatML with Qwen3-Omni's placeholders; unlike Qwen2.5-Omni it adds no default system prompt.
QWEN3_OMNI_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}"
    "{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "<|audio_start|><|audio_pad|><|audio_end|>"
    "{% elif content['type'] == 'video' or 'video' in content or 'video_url' in content %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}"
    "{{ content['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "<|im_start|>assistant\n"
    "{% endif %}"
)

# Thinker: 2 MoE layers of 4 experts (2 routed per token), head_dim 64 for vLLM's CPU attention.
# Real Qwen3-Omni uses interleaved multimodal RoPE with [24, 20, 20] for head_dim 128.
_QWEN3_THINKER_MROPE_SECTION = [12, 10, 10]
# Talker (MoE with a shared expert) and its code predictor use head_dim 32.
_QWEN3_TALKER_HIDDEN_SIZE = 64
_QWEN3_TALKER_MROPE_SECTION = [6, 5, 5]
# The talker keeps the real codec vocabulary, codec control ids and voice ids; the code predictor
# and code2wav the real codebook (2048 codes x 16 groups), so code ids mean what they mean in the
# real model.
_QWEN3_CODEC_VOCAB_SIZE = 3072
_QWEN3_CODEBOOK_SIZE = 2048
_QWEN3_CODE_GROUPS = 16
_QWEN3_CODEC_IDS = {
    "codec_pad_id": 2148,
    "codec_bos_id": 2149,
    "codec_eos_token_id": 2150,
    "codec_nothink_id": 2155,
    "codec_think_bos_id": 2156,
    "codec_think_eos_id": 2157,
}
_QWEN3_SPEAKER_IDS = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
_QWEN3_VISION_PATCH_SIZE = 16
# With std 0.1 this MoE thinker falls into repeating one token after a few steps for most prompts;
# 0.2 keeps its greedy output varied (the towers, talker and code2wav keep _INIT_STD).
_QWEN3_THINKER_INIT_STD = 0.2


def _qwen3_omni_config() -> Any:
    from transformers import Qwen3OmniMoeConfig

    tid = _qwen3_omni_token_id
    rope = {"rope_type": "default", "rope_theta": 1000000.0, "interleaved": True, "mrope_interleaved": True}
    text_config = {
        "vocab_size": TEXT_VOCAB_SIZE,
        "hidden_size": THINKER_HIDDEN_SIZE,
        "intermediate_size": 256,  # dense MLP size, unused: every layer is sparse
        "moe_intermediate_size": 64,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "num_hidden_layers": 2,
        "num_attention_heads": _THINKER_HEADS,
        "num_key_value_heads": 1,
        "head_dim": _THINKER_HEAD_DIM,
        "max_position_embeddings": 32768,
        "rope_parameters": {**rope, "mrope_section": _QWEN3_THINKER_MROPE_SECTION},
        "rms_norm_eps": 1e-6,
        "initializer_range": _QWEN3_THINKER_INIT_STD,
        "bos_token_id": tid("<|endoftext|>"),
        "eos_token_id": tid("<|im_end|>"),
        "pad_token_id": tid("<|endoftext|>"),
        "tie_word_embeddings": False,
    }
    audio_config = {
        "num_mel_bins": 128,
        "d_model": 64,
        "encoder_layers": 2,
        "encoder_attention_heads": 2,
        "encoder_ffn_dim": 128,
        "downsample_hidden_size": 32,
        "max_source_positions": 1500,
        "n_window": 50,
        "n_window_infer": 800,
        "output_dim": THINKER_HIDDEN_SIZE,
        "initializer_range": _INIT_STD,
    }
    vision_config = {
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": _QWEN3_VISION_PATCH_SIZE,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        # A 32 x 32 grid of learned positions, interpolated to each image; transformers derives the
        # grid from num_position_embeddings, vLLM from image_size // patch_size (as in the real
        # config: 2304 and 768).
        "num_position_embeddings": 1024,
        "image_size": 32 * _QWEN3_VISION_PATCH_SIZE,
        # vLLM reads this field of the real config (the learned positions are an nn.Embedding).
        "apply_vit_abs_pos_embed": True,
        "deepstack_visual_indexes": [0],  # must index existing blocks
        "out_hidden_size": THINKER_HIDDEN_SIZE,
        "initializer_range": _INIT_STD,
    }
    media_ids = {
        "audio_token_id": tid("<|audio_pad|>"),
        "image_token_id": tid("<|image_pad|>"),
        "video_token_id": tid("<|video_pad|>"),
        "vision_start_token_id": tid("<|vision_start|>"),
        "audio_start_token_id": tid("<|audio_start|>"),
        "position_id_per_seconds": 13,
    }
    bpe = _bpe_tokenizer()
    thinker_config = {
        "text_config": text_config,
        "audio_config": audio_config,
        "vision_config": vision_config,
        **media_ids,
        "vision_end_token_id": tid("<|vision_end|>"),
        "audio_end_token_id": tid("<|audio_end|>"),
        "user_token_id": bpe.token_to_id("user"),
        "seconds_per_chunk": 2,
        "initializer_range": _QWEN3_THINKER_INIT_STD,
        "tie_word_embeddings": False,
    }
    talker_config = {
        "text_config": {
            "vocab_size": _QWEN3_CODEC_VOCAB_SIZE,
            "hidden_size": _QWEN3_TALKER_HIDDEN_SIZE,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": False,
            "decoder_sparse_step": 1,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "max_position_embeddings": 32768,
            "rope_parameters": {**rope, "mrope_section": _QWEN3_TALKER_MROPE_SECTION},
            "rms_norm_eps": 1e-6,
            "initializer_range": _INIT_STD,
            "tie_word_embeddings": False,
        },
        "code_predictor_config": {
            "vocab_size": _QWEN3_CODEBOOK_SIZE,
            "hidden_size": _QWEN3_TALKER_HIDDEN_SIZE,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "max_position_embeddings": 32768,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "rms_norm_eps": 1e-6,
            "num_code_groups": _QWEN3_CODE_GROUPS,
            "initializer_range": _INIT_STD,
            "tie_word_embeddings": False,
        },
        "num_code_groups": _QWEN3_CODE_GROUPS,
        "thinker_hidden_size": THINKER_HIDDEN_SIZE,
        # the thinker layer whose output feeds the talker (the real model: 24 of 48)
        "accept_hidden_layer": 1,
        **_QWEN3_CODEC_IDS,
        **media_ids,
        "speaker_id": dict(_QWEN3_SPEAKER_IDS),
        "spatial_merge_size": 2,
        "initializer_range": _INIT_STD,
        "tie_word_embeddings": False,
    }
    code2wav_config = {
        "codebook_size": _QWEN3_CODEBOOK_SIZE,
        "num_quantizers": _QWEN3_CODE_GROUPS,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "sliding_window": 72,
        "max_position_embeddings": 8000,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        # The real upsampling (1920 samples per code frame); each decoder block halves 64 channels.
        "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2],
        "decoder_dim": 64,
        "initializer_range": _INIT_STD,
    }
    config = Qwen3OmniMoeConfig(
        thinker_config=thinker_config,
        talker_config=talker_config,
        code2wav_config=code2wav_config,
        enable_audio_output=True,
        im_start_token_id=tid("<|im_start|>"),
        im_end_token_id=tid("<|im_end|>"),
        tts_pad_token_id=tid("<tts_pad>"),
        tts_bos_token_id=tid("<tts_text_bos>"),
        tts_eos_token_id=tid("<tts_text_eod>"),
        system_token_id=bpe.token_to_id("system"),
        user_token_id=bpe.token_to_id("user"),
        assistant_token_id=bpe.token_to_id("assistant"),
    )
    config.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
    return config


def _save_qwen3_omni_processor(path: Path) -> None:
    """Tokenizer plus Qwen3OmniMoeProcessor's feature extractor, image and video processors."""
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
        Qwen3OmniMoeProcessor,
        WhisperFeatureExtractor,
    )

    unit = _QWEN3_VISION_PATCH_SIZE * 2  # pixels per merged token side
    vision = {
        "patch_size": _QWEN3_VISION_PATCH_SIZE,
        "temporal_patch_size": 2,
        "merge_size": 2,
        # at most 128 merged tokens per image, as for the tiny Qwen2.5-Omni
        "size": {"shortest_edge": 4 * unit * unit, "longest_edge": 128 * unit * unit},
    }
    feature_extractor = WhisperFeatureExtractor(
        feature_size=128,
        sampling_rate=16000,
        hop_length=160,
        chunk_length=30,
        n_fft=400,
        padding_value=0.0,
        return_attention_mask=True,
    )
    tokenizer = _qwen_tokenizer(
        multimodal=True,
        specials=_QWEN3_OMNI_VOCAB,
        named_tokens=_QWEN3_OMNI_NAMED_TOKENS,
        chat_template=QWEN3_OMNI_CHAT_TEMPLATE,
    )
    processor = Qwen3OmniMoeProcessor(
        image_processor=Qwen2VLImageProcessor(**vision),
        video_processor=Qwen2VLVideoProcessor(**vision),
        feature_extractor=feature_extractor,
        tokenizer=tokenizer,
        chat_template=QWEN3_OMNI_CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)


def _init_talker_moe(talker: Any) -> None:
    """Draw the talker's expert and router weights, which transformers (5.17) leaves uninitialized:
    torch.empty memory would make the talker meaningless and the build non-reproducible."""
    import torch

    with torch.no_grad():
        for name, param in talker.named_parameters():
            if ".mlp.experts." in name or name.endswith(".mlp.gate.weight"):
                param.normal_(0.0, _INIT_STD)


def build_tiny_qwen3_omni(path: str | os.PathLike[str]) -> Path:
    """Write the tiny Qwen3-Omni-MoE checkpoint (thinker, talker, code2wav, processor) into `path`."""
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with _seeded_and_quiet(SEED + 2):
        model = Qwen3OmniMoeForConditionalGeneration(_qwen3_omni_config()).to(torch.float32).eval()
        _init_talker_moe(model.talker)
        model.save_pretrained(path, safe_serialization=True)
        _save_qwen3_omni_processor(path)
    im_end, endoftext = _qwen3_omni_token_id("<|im_end|>"), _qwen3_omni_token_id("<|endoftext|>")
    _write_json(
        path / "generation_config.json",
        {"bos_token_id": endoftext, "eos_token_id": im_end, "pad_token_id": endoftext},
    )
    _mark_complete(path)
    return path


# ---------------------------------------------------------------------------------------------
# Idempotent, atomic installation
# ---------------------------------------------------------------------------------------------


def _mark_complete(path: Path) -> None:
    _write_json(path / COMPLETE_MARKER, {"recipe_version": RECIPE_VERSION})


def _is_complete(path: Path) -> bool:
    try:
        return json.loads((path / COMPLETE_MARKER).read_text()).get("recipe_version") == RECIPE_VERSION
    except (OSError, ValueError, AttributeError):
        return False


def _install(final: Path, build: Callable[[Path], Path], force: bool) -> bool:
    """Build into a sibling temp dir, then rename it to `final`; return False if it was already there."""
    if not force and _is_complete(final):
        return False
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.building.", dir=final.parent))
    try:
        build(staging)
        # mkdtemp and the safetensors writer create owner-only files; the checkpoint is not private.
        staging.chmod(0o755)
        for file in staging.iterdir():
            file.chmod(0o644)
        if final.exists():
            # Move the old copy aside first: `final` is never seen half-deleted.
            graveyard = Path(tempfile.mkdtemp(prefix=f".{final.name}.stale.", dir=final.parent))
            os.replace(final, graveyard / final.name)
            shutil.rmtree(graveyard, ignore_errors=True)
        try:
            os.replace(staging, final)
        except OSError:
            # Another process installed it meanwhile; its copy is as good as ours.
            if not _is_complete(final):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return True


def ensure_all(out_dir: str | os.PathLike[str] = DEFAULT_OUT_DIR, *, force: bool = False) -> dict[str, Path]:
    """Build whichever tiny checkpoint under `out_dir` is missing (or all with `force`); return their paths."""
    out_dir = Path(out_dir)
    builders: dict[str, Callable[[Path], Path]] = {
        TINY_OMNI: build_tiny_qwen2_5_omni,
        TINY_EMBEDS_LM: functools.partial(build_tiny_embeds_lm, hidden_size=THINKER_HIDDEN_SIZE),
        TINY_QWEN3_OMNI: build_tiny_qwen3_omni,
    }
    paths = {}
    for name, build in builders.items():
        path = out_dir / name
        if _install(path, build, force):
            print(f"built {path}")
        paths[name] = path
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m omni_server.models.tiny_checkpoints",
        description="Build the tiny random-weight checkpoints used by tests and local runs.",
    )
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR, help="default: %(default)s")
    parser.add_argument("--force", action="store_true", help="rebuild even if a complete checkpoint exists")
    args = parser.parse_args(argv)
    ensure_all(args.out_dir, force=args.force)


if __name__ == "__main__":
    main()
