"""transformers' own Qwen2.5-Omni pipeline (`Qwen2_5OmniForConditionalGeneration.generate`, text
and speech out, one request at a time: its generate() speaks for batch size 1 only), timed by the
bench on the same prompts as the server (`omni-server bench --reference DIR`)."""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

from omni_server.models.masking import suppress

from .codec import banned_ids


class _Ban(LogitsProcessor):
    def __init__(self, banned: torch.Tensor):
        self.banned = banned

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return suppress(scores, self.banned)


class Reference:
    def __init__(self, model_dir: str, device: str):
        from transformers import AutoTokenizer, LogitsProcessorList, Qwen2_5OmniForConditionalGeneration

        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        # On a GPU, device_map (needs accelerate) initialises weights missing from the checkpoint (a
        # dummy-shape run) on the device itself instead of on the CPU first (minutes for 7B).
        placement = {"device_map": device} if device != "cpu" else {}
        self.model = Qwen2_5OmniForConditionalGeneration.from_pretrained(model_dir, dtype=dtype, **placement)
        self.model = self.model.to(device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.device = device
        self.voices = sorted(self.model.speaker_map)
        # The same ban as our talker: an untrained (dummy-weight) talker samples ids token2wav cannot
        # embed, which on a GPU is a device assert that ends the process.
        self._talker_logits = LogitsProcessorList(
            [_Ban(banned_ids(model_dir, self.model.config.talker_config).to(device))])
        self.sample_rate = 24000

    @torch.inference_mode()
    def speak(self, text: str, max_tokens: int, voice: str | None, talker_max_tokens: int,
              ignore_eos: bool = True) -> tuple[int, float]:
        """(reply tokens, seconds of audio) for one user message, greedy."""
        ids = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
        ids = torch.tensor([list(ids)], device=self.device)
        extra = {"thinker_min_new_tokens": max_tokens} if ignore_eos else {}
        sequences, wave = self.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), speaker=voice or self.voices[0],
            thinker_max_new_tokens=max_tokens, thinker_do_sample=False,
            talker_max_new_tokens=talker_max_tokens, talker_do_sample=False,
            talker_logits_processor=self._talker_logits, **extra)
        return int(sequences.shape[1] - ids.shape[1]), wave.numel() / self.sample_rate
