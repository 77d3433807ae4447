"""transformers as the numerics oracle: same tiny checkpoints, float32, greedy."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=None)
def thinker(model_dir: Path):
    from transformers import Qwen2_5OmniForConditionalGeneration

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    return model.thinker.eval()


@lru_cache(maxsize=None)
def causal_lm(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def thinker_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model = thinker(model_dir)
    ids = torch.tensor([prompt_ids])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False)
    return out[0, len(prompt_ids):].tolist()


@torch.inference_mode()
def thinker_hidden(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    """Final-layer (post-norm) hidden states of the thinker for every position of `token_ids`."""
    model = thinker(model_dir)
    ids = torch.tensor([token_ids])
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
    return out.hidden_states[-1][0]


@torch.inference_mode()
def lm_greedy_from_embeds(model_dir: Path, embeds: torch.Tensor, max_new_tokens: int) -> list[int]:
    model = causal_lm(model_dir)
    e = embeds[None].to(torch.float32)
    out = model.generate(inputs_embeds=e, attention_mask=torch.ones(e.shape[:2], dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False)
    return out[0].tolist()  # with inputs_embeds only, generate returns just the new tokens


@lru_cache(maxsize=None)
def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
