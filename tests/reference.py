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


class OpenAIPenalties:
    """OpenAI's presence / frequency penalties as a transformers logits processor (transformers has
    none): every token generated so far loses `presence` once and `frequency` per occurrence."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores)
        out = input_ids[:, self.prompt_len:]
        counts.scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.presence * (counts > 0).to(scores.dtype) - self.frequency * counts


@torch.inference_mode()
def thinker_greedy_penalised(model_dir: Path, prompt_ids: list[int], max_new_tokens: int, presence: float,
                             frequency: float) -> list[int]:
    from transformers import LogitsProcessorList

    model = thinker(model_dir)
    ids = torch.tensor([prompt_ids])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=None,
                         logits_processor=LogitsProcessorList([OpenAIPenalties(len(prompt_ids), presence, frequency)]))
    return out[0, len(prompt_ids):].tolist()


@torch.inference_mode()
def thinker_greedy_logprobs(model_dir: Path, prompt_ids: list[int], max_new_tokens: int,
                            top: int) -> tuple[list[int], list[tuple[float, list[tuple[int, float]]]]]:
    """Greedy tokens and, per token, its log-probability under the model and the `top` best ids
    with theirs (log-softmax of the raw logits)."""
    model = thinker(model_dir)
    ids = torch.tensor([prompt_ids])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    steps = []
    for t, logits in zip(tokens, out.logits):
        lp = logits[0].float().log_softmax(-1)
        values, best = lp.topk(top)
        steps.append((float(lp[t]), list(zip(best.tolist(), values.tolist()))))
    return tokens, steps


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


@lru_cache(maxsize=None)
def omni(model_dir: Path):
    from transformers import Qwen2_5OmniForConditionalGeneration

    return Qwen2_5OmniForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


@lru_cache(maxsize=None)
def processor(model_dir: Path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(model_dir)


def omni_inputs(model_dir: Path, messages: list[dict], audios: list | None = None, images: list | None = None,
                videos: list | None = None, **kwargs) -> dict:
    """transformers' processor on chat messages with audio parts (16 kHz float arrays), image
    parts (RGB uint8 arrays) and video parts (RGB uint8 [frames, h, w, 3], 2 frames a second: the
    processor's default rate for time positions); `kwargs`: the processor's own (use_audio_in_video)."""
    proc = processor(model_dir)
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return dict(proc(text=text, audio=audios, images=images, videos=videos, return_tensors="pt", padding=True,
                     **kwargs))


@torch.inference_mode()
def thinker_greedy_inputs(model_dir: Path, inputs: dict, max_new_tokens: int) -> list[int]:
    out = omni(model_dir).thinker.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@torch.inference_mode()
def omni_speech(model_dir: Path, prompt_ids: list[int] | None, thinker_max_new_tokens: int,
                talker_max_new_tokens: int, voice: str, seed: int,
                inputs: dict | None = None, talker_repetition_penalty: float = 1.0) -> tuple[list[int], list[int], torch.Tensor]:
    """transformers' whole pipeline, greedy: (thinker tokens, talker codes, waveform) for token ids,
    or for processor `inputs` (omni_inputs). The codes are what generate() hands token2wav (cut
    before the codec end token); the vocoder's starting noise comes from the global RNG, seeded
    with `seed` (nothing before it draws random numbers)."""
    model = omni(model_dir)
    codes: list[list[int]] = []
    if inputs is None:
        ids = torch.tensor([prompt_ids])
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    # Pixels are the thinker's alone; generate() would hand unprefixed ones to the talker too, which
    # rejects them. The image grid stays shared: the talker's positions need it.
    inputs = {("thinker_" + k if k.startswith("pixel_values") else k): v for k, v in inputs.items()}
    hook = model.token2wav.register_forward_pre_hook(lambda m, args: codes.append(args[0][0].tolist()))
    try:
        ids = inputs["input_ids"]
        torch.manual_seed(seed)
        sequences, wave = model.generate(
            **inputs, speaker=voice,
            thinker_max_new_tokens=thinker_max_new_tokens, thinker_do_sample=False,
            talker_max_new_tokens=talker_max_new_tokens, talker_do_sample=False,
            talker_repetition_penalty=talker_repetition_penalty)
    finally:
        hook.remove()
    return sequences[0, ids.shape[1]:].tolist(), codes[0], wave.reshape(-1).float()


@torch.inference_mode()
def omni_speech_of_reply(model_dir: Path, prompt_ids: list[int], reply_ids: list[int], talker_max_new_tokens: int,
                         voice: str, seed: int) -> torch.Tensor:
    """transformers' pipeline speaking a given thinker reply: its thinker is replaced by a
    teacher-forced forward over prompt + reply, shaped like what its generate() returns (the
    states greedy generation of that reply would produce); talker and token2wav run unchanged."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    model = omni(model_dir)
    full = torch.tensor([prompt_ids + reply_ids])
    fed = full[:, :-1]  # the last reply token is sampled, never fed
    layers = model.thinker(input_ids=fed, attention_mask=torch.ones_like(fed), output_hidden_states=True).hidden_states
    n = len(prompt_ids)
    steps = [tuple(h[:, :n] for h in layers)]
    steps += [tuple(h[:, n + j:n + j + 1] for h in layers) for j in range(len(reply_ids) - 1)]
    forced = GenerateDecoderOnlyOutput(sequences=full, hidden_states=tuple(steps))
    model.thinker.generate = lambda *args, **kwargs: forced
    try:
        ids = torch.tensor([prompt_ids])
        torch.manual_seed(seed)
        _, wave = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), speaker=voice,
                                 talker_max_new_tokens=talker_max_new_tokens, talker_do_sample=False,
                                 talker_repetition_penalty=1.0)
    finally:
        del model.thinker.generate
    return wave.reshape(-1).float()


class _Stop(Exception):
    pass


@torch.inference_mode()
def talker_call(model, inputs: dict, **generate_kwargs) -> tuple:
    """(the thinker's generate result, the kwargs transformers' omni generate hands its talker's
    generate) for processor `inputs`; generation stops there."""
    seen: dict = {}
    thinker_generate = model.thinker.generate

    def thinker(*args, **kwargs):
        seen["thinker"] = thinker_generate(*args, **kwargs)
        return seen["thinker"]

    def talker(**kwargs):
        seen["talker"] = kwargs
        raise _Stop

    model.thinker.generate, model.talker.generate = thinker, talker
    try:
        model.generate(**inputs, **generate_kwargs)
    except _Stop:
        pass
    finally:
        del model.thinker.generate, model.talker.generate
    assert "talker" in seen, "generate never called its talker"
    return seen["thinker"], seen["talker"]
