"""Qwen3-Omni-MoE code2wav: talker codec frames (16 codebooks at 12.5 Hz) -> 24 kHz waveform.

The network is transformers' own `Qwen3OmniMoeCode2Wav`, loaded from the checkpoint's `code2wav.*`
tensors in float32. `batch` is its `forward`; streaming restates that forward only to give the
transformer absolute positions and to run the conv stack on part of the window.

Why streaming can be exact (docs/qwen3_omni.md, section 3): every layer is causal. The transformer
attends over a sliding window, so a frame depends on at most `layers * (window - 1)` frames before
it; the conv stack only left-pads, so a sample depends on a bounded number of hidden frames before
its own. Decoding T frames gives 1920*T - 555 samples, and decoding a prefix gives exactly the
prefix of the longer decode: once frames [0, e) are here, samples [0, 1920*e - 555) are final and
no right context is ever needed. A streaming window therefore re-decodes the new frames with
`left_context_frames` (>= the receptive field) of old ones and emits the samples from where the last
window stopped. Windows cover fixed runs of `chunk_frames` new frames (`first_chunk_frames`: the
first windows' sizes, e.g. small ones for early first audio; the last window shorter), so which
windows run depends only on the codes, never on when they arrived. A window and the full
decode then differ by float32 rounding only (oneDNN's ConvTranspose1d rounds differently for
different lengths: ~1.5e-5 on the tiny random model, whose activations reach ~20; float64 ~3e-8).

transformers' own `chunked_decode` is not used: its 25-frame context is far below the receptive
field and it drops 555 samples per chunk, so it is not the full decode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_server.models.checkpoint import load_module, read_config
from omni_server.models.windows import window_at

SAMPLE_RATE = 24000  # 12.5 Hz frames x 1920 samples; not stored in the config
WEIGHTS_PREFIX = "code2wav."
DEFAULT_VOICE = "ethan"  # transformers' `generate(speaker="Ethan")` default; first in `voices`


@dataclass
class CodeStream:
    """One request's streamed decode: the codes so far and how far audio has gone.

    `feed` only stores what it is given (it runs in the stage loop, where an exception would take
    the process down); the codes are validated by the step that reads them."""

    voice: str | None
    codes: Any = None  # [16, T] codec ids so far, as fed
    final: bool = False  # every frame is here
    done: bool = False  # every sample was returned
    frames: int = 0  # frames whose samples were returned: samples [0, 1920*frames - 555)
    consumed: int = 0  # frames no later window reads
    emitted: int = 0  # samples returned
    checked: torch.Tensor | None = field(default=None, repr=False)  # validated codes of the last step

    def feed(self, final: bool, codes: Any = None, **_: Any) -> None:
        """All codes so far ([16, T], a growing prefix) and whether they are complete."""
        if self.final:
            return
        if codes is not None:
            self.codes = codes
        self.final = bool(final)


class Code2Wav:
    """Decodes talker codec frames to waveforms in float32: several requests at a time (`batch`),
    or streamed (`open_stream`, `stream_step`), the stream equal to the full decode.

    `codes` are `[16, T]` integer ids in [0, codebook_size): one row per quantizer (codebook), one
    column per 12.5 Hz frame, the layout of transformers' `Qwen3OmniMoeCode2Wav.forward` input
    without its batch axis. The voice is the talker's choice and is ignored here; `voices` lists
    the checkpoint's talker speakers only so the api has voices to offer and check."""

    def __init__(self, model_dir: str, device: str | torch.device = "cpu", chunk_frames: int = 25,
                 left_context_frames: int | None = None, first_chunk_frames: int | list[int] | None = None):
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

        full_config = read_config(model_dir)
        config = full_config.code2wav_config
        self.device = torch.device(device)
        if self.device.type == "cuda":
            # Deterministic cuDNN convolutions (as Qwen2.5's token2wav): the same codes, the same samples.
            torch.backends.cudnn.deterministic = True
        self.model = load_module(Qwen3OmniMoeCode2Wav, config, model_dir, WEIGHTS_PREFIX, self.device)

        self.sample_rate: int = SAMPLE_RATE
        self.num_quantizers: int = config.num_quantizers
        self.codebook_size: int = config.codebook_size
        self.max_frames: int = config.max_position_embeddings
        self.hop: int = int(math.prod(list(config.upsample_rates) + list(config.upsampling_ratios)))
        self.trim: int = _length_loss(config)  # samples(T) = hop * T - trim
        speakers = dict(getattr(full_config.talker_config, "speaker_id", None) or {})
        self.voices: list[str] = sorted(speakers, key=lambda v: (v != DEFAULT_VOICE, v)) or [DEFAULT_VOICE]

        # Frames before a window's first new frame that make its samples exact.
        self.conv_context_frames = 1 + _conv_reach(config)  # the first new sample belongs to frame f-1
        if all(t == "sliding_attention" for t in config.layer_types):
            attention = config.num_hidden_layers * (config.sliding_window - 1)
            self.receptive_field: int | None = attention + self.conv_context_frames
        else:  # a full-attention layer sees the whole prefix: every window starts at frame 0
            self.receptive_field = None
        starts = [] if first_chunk_frames is None else first_chunk_frames
        starts = [starts] if isinstance(starts, int) and not isinstance(starts, bool) else starts
        if not isinstance(starts, (list, tuple)):
            raise ValueError(f"first_chunk_frames must be a window size or a list of them, got {first_chunk_frames!r}")
        for name, value in (("chunk_frames", chunk_frames), *(("first_chunk_frames", v) for v in starts)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if left_context_frames is None:
            left_context_frames = self.receptive_field
        elif self.receptive_field is None:
            raise ValueError("left_context_frames must be left unset: this code2wav has full-attention layers, "
                             "so a window needs every earlier frame")
        elif (isinstance(left_context_frames, bool) or not isinstance(left_context_frames, int)
              or left_context_frames < self.receptive_field):
            raise ValueError(f"left_context_frames must be an integer >= the receptive field "
                             f"({self.receptive_field} frames), got {left_context_frames!r}")
        self.chunk_frames = chunk_frames
        # New frames of a stream's first windows, in order (small ones: audio starts after fewer
        # frames); `chunk_frames` each after them.
        self.start_windows: tuple[int, ...] = tuple(starts)
        self.left_context_frames: int | None = left_context_frames  # None: unbounded
        # Frames beyond `consumed` the next window reads: the left context plus the widest window
        # (the real model: 579 + 25, so its stage needs `stream_window` >= 604). Unbounded context: everything.
        widest = max([chunk_frames, *starts])
        self.stream_lead = self.max_frames if left_context_frames is None else left_context_frames + widest

    def num_samples(self, frames: int) -> int:
        """Waveform length for `frames` code frames (1920*T - 555 for the real model)."""
        return max(self.hop * frames - self.trim, 0)

    @torch.inference_mode()
    def __call__(self, codes) -> torch.Tensor:
        """1-D float32 CPU waveform for `codes` ([16, T])."""
        out = self.batch([{"codes": codes}])[0]
        if isinstance(out, Exception):
            raise out
        return out

    @torch.inference_mode()
    def batch(self, requests: list[dict]) -> list[torch.Tensor | ValueError]:
        """Waveforms for several requests ({"codes", "voice", "seed"}; voice and seed are ignored:
        the decode is deterministic) in one pass of transformers' forward. Shorter requests are
        right-padded: every layer is causal, so padding after a request's frames never reaches its
        samples. An invalid request gets its ValueError in its place."""
        results: list = [None] * len(requests)
        todo = []
        for i, req in enumerate(requests):
            try:
                codes = self._check(req.get("codes"))
            except ValueError as e:
                results[i] = e
                continue
            if codes.shape[1] == 0:
                results[i] = torch.zeros(0, dtype=torch.float32)
            else:
                todo.append((i, codes))
        if todo:
            length = max(c.shape[1] for _, c in todo)
            padded = torch.zeros(len(todo), self.num_quantizers, length, dtype=torch.long, device=self.device)
            for b, (_, c) in enumerate(todo):
                padded[b, :, :c.shape[1]] = c
            wav = self.model(padded)[:, 0]
            for b, (i, c) in enumerate(todo):
                results[i] = wav[b, :self.num_samples(c.shape[1])].float().cpu()
        return results

    # ---- streaming ----------------------------------------------------------------------------

    def open_stream(self, voice: str | None = None, seed: int | None = None) -> CodeStream:
        """A decode whose codes arrive over time (`CodeStream.feed`). Any voice is accepted: the
        waveform depends on the codes only."""
        return CodeStream(voice=voice)

    def stream_ready(self, stream: CodeStream) -> bool:
        """Whether `stream_step` would make progress on this stream now: a whole chunk of new frames
        is here, or the input is final (the rest, or the end)."""
        if stream.done:
            return False
        if stream.final:
            return True
        return _num_frames(stream.codes) - stream.frames >= window_at(stream.frames, self.start_windows,
                                                                      self.chunk_frames)

    @torch.inference_mode()
    def stream_step(self, streams: list[CodeStream]) -> list[torch.Tensor | ValueError]:
        """One window per ready stream (one padded pass for all), each stream's new samples (1-D
        float32 CPU, possibly empty). A stream is `done` once its last sample was returned; an
        invalid one gets a ValueError in its place and is done."""
        results: list = [torch.zeros(0, dtype=torch.float32)] * len(streams)
        windows = []  # (index, first frame, first conv frame, end frame)
        for k, st in enumerate(streams):
            if not self.stream_ready(st):
                continue
            try:
                codes = self._check(torch.zeros(self.num_quantizers, 0, dtype=torch.long) if st.codes is None else st.codes)
                if codes.shape[1] < st.frames:
                    raise ValueError(f"a stream's codes must only grow: {codes.shape[1]} frames after {st.frames}")
            except ValueError as e:
                st.done = True
                results[k] = e
                continue
            st.checked = codes
            total = codes.shape[1]
            end = min(st.frames + window_at(st.frames, self.start_windows, self.chunk_frames), total)
            if end == st.frames:  # final and every frame decoded
                st.done, st.checked, st.codes = True, None, None
                continue
            context = st.frames if self.left_context_frames is None else self.left_context_frames
            start = max(st.frames - context, 0)
            conv_start = max(st.frames - self.conv_context_frames, start)
            windows.append((k, start, conv_start, end))
        if windows:
            waves = self._decode_windows([(streams[k].checked, s, c, e) for k, s, c, e in windows])
            for (k, start, conv_start, end), wave in zip(windows, waves):
                st = streams[k]
                upto = self.num_samples(end)
                results[k] = wave[st.emitted - self.hop * conv_start:upto - self.hop * conv_start].float().cpu()
                st.emitted, st.frames = upto, end
                if self.left_context_frames is not None:  # the next window starts there
                    st.consumed = max(end - self.left_context_frames, 0)
                if st.final and end == st.checked.shape[1]:
                    st.done, st.codes = True, None
                st.checked = None
        return results

    def stream_all(self, codes) -> torch.Tensor:
        """`codes` decoded the streaming way, all at once (what a stream of them yields)."""
        st = self.open_stream()
        st.feed(codes=codes, final=True)
        pieces = []
        while not st.done:
            (piece,) = self.stream_step([st])
            if isinstance(piece, Exception):
                raise piece
            pieces.append(piece)
        return torch.cat(pieces) if pieces else torch.zeros(0)

    def _decode_windows(self, windows: list[tuple[torch.Tensor, int, int, int]]) -> list[torch.Tensor]:
        """transformers' forward over frames [start, end) of each (codes, start, conv_start, end),
        with the transformer at absolute positions and the conv stack on frames [conv_start, end)
        only: waveform samples from `hop * conv_start` on, right-padded across the batch."""
        model = self.model
        n, length = len(windows), max(e - s for _, s, _, e in windows)
        codes = torch.zeros(n, self.num_quantizers, length, dtype=torch.long, device=self.device)
        for b, (c, s, _, e) in enumerate(windows):
            codes[b, :, :e - s] = c[:, s:e]
        # Positions continue past each window's end (padding), so transformers sees one sequence per
        # row (no packed-sequence mask), and a real frame never attends the padding after it.
        positions = torch.tensor([s for _, s, _, _ in windows], device=self.device)[:, None] + \
            torch.arange(length, device=self.device)[None]
        hidden = model.code_embedding(codes + model.code_offset).mean(1)
        hidden = model.pre_transformer(inputs_embeds=hidden, position_ids=positions).last_hidden_state
        conv_length = max(e - c for _, _, c, e in windows)
        conv_in = hidden.new_zeros(n, hidden.shape[2], conv_length)
        for b, (_, s, c, e) in enumerate(windows):
            conv_in[b, :, :e - c] = hidden[b, c - s:e - s].T
        wav = conv_in
        for blocks in model.upsample:
            for block in blocks:
                wav = block(wav)
        for block in model.decoder:
            wav = block(wav)
        wav = wav.clamp(min=-1, max=1)[:, 0]
        return [wav[b, :self.num_samples(e - c)] for b, (_, _, c, e) in enumerate(windows)]

    def _check(self, codes) -> torch.Tensor:
        try:
            codes = torch.as_tensor(codes)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"codes must be an integer tensor of shape [{self.num_quantizers}, T]: {e}") from None
        if codes.dtype == torch.bool or codes.dtype.is_floating_point or codes.dtype.is_complex:
            raise ValueError(f"codes must be integer codec ids, got dtype {codes.dtype}")
        if codes.ndim != 2 or codes.shape[0] != self.num_quantizers:
            raise ValueError(f"codes must have shape [{self.num_quantizers}, T] (one row per codebook), "
                             f"got {list(codes.shape)}")
        if codes.shape[1] > self.max_frames:
            raise ValueError(f"{codes.shape[1]} code frames exceed the code2wav limit of {self.max_frames}")
        if codes.numel():
            # Checked here: an out-of-range embedding index on a GPU is a device assert that kills the
            # process, and an id of another codebook would silently read the wrong table.
            low, high = int(codes.min()), int(codes.max())
            if low < 0 or high >= self.codebook_size:
                raise ValueError(f"codec ids must lie in [0, {self.codebook_size - 1}], got [{low}, {high}]")
        return codes.to(self.device, torch.long)


def _num_frames(codes) -> int:
    shape = getattr(codes, "shape", None)
    return int(shape[-1]) if shape is not None and len(shape) == 2 else 0


def _length_loss(config) -> int:
    """Samples lost at the end: each decoder TransConv trims one input frame's worth,
    hop*T - ((((T*u - 1)*r1 - 1)*r2 - 1)...)."""
    loss = 0
    for rate in config.upsample_rates:
        loss = (loss + 1) * rate
    return loss


def _conv_reach(config) -> int:
    """Hidden frames before a sample's own frame (sample // hop) that the conv stack reads, walked
    backwards through it with every division rounded up (an upper bound)."""
    reach = 6  # final causal conv, kernel 7
    for rate in reversed(config.upsample_rates):
        reach += 6 * (1 + 3 + 9)  # residual units: kernel 7 at dilations 1, 3, 9 (their k1 convs read nothing)
        reach = -(-reach // rate)  # TransConv(2r, r): output block t reads inputs t and t+1
    reach += 6  # the decoder's first causal conv, kernel 7
    for ratio in reversed(config.upsampling_ratios):
        reach += 6  # ConvNeXt depthwise causal conv, kernel 7
        reach = -(-reach // ratio)  # TransConv(r, r): output block t reads input t only
    return reach
