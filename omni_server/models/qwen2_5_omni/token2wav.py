"""Qwen2.5-Omni token2wav: talker codec codes -> 24 kHz waveform (DiT flow matching + BigVGAN).

The networks are transformers' own modules; only the DiT's `sample` loop is restated here (and its
layers' forward, dit.py, to make their attention masks once per solve), because
transformers draws its starting noise from the global RNG.  A serving process decodes many requests
concurrently, so the noise comes from a per-call generator instead: a request's seed alone decides
its waveform, and no call disturbs any other RNG user.  The loop is otherwise the same sequence of
float32 operations as transformers' (`Qwen2_5OmniToken2WavDiTModel.sample` with its
`RungeKutta4ODESolver`), so for the same noise the results agree to rounding.

Streaming (`open_stream` / `stream_step`): codes arrive in pieces and audio leaves in pieces. The DiT
runs on windows of `chunk_frames` new mel frames (`first_chunk_frames`, one size or a list, in the
first windows: a small first window means earlier first audio, and growing ones after it keep each
window ready before the audio before it has played) with `past_frames` of left and `future_frames` of
right context (whole DiT blocks, so a window's block mask matches the full sequence's); the vocoder
runs on the new mel with `vocoder_context_frames` either side and holds back the last
`vocoder_context_frames` until their right context exists. Every window's noise is the slice of the
request's one noise sequence at the same positions, and which windows run depends only on the codes,
never on when they arrived: a streamed waveform equals the same codes decoded by `stream_all`, and a
response of fewer than (first window + `future_frames`) mel frames equals the full decode (exactly;
with `dit_past_cache` up to float rounding, ~1e-7: the first window attends through the past path to
masked-out empty keys, other shapes than the whole decode's).

`dit_past_cache`: a window holds no past frames. Only the DiT layers that look back attend across
windows, so a stream keeps, for each of the solve's evaluations, those layers' keys and values of
its last settled block(s) (rotary positions counted from the stream's start) and the next window
attends to them: each window computes its new and future frames only (1,216 instead of 1,648 frame
evaluations for 10 s of speech with the 7B configs' windows), and its past is the one its stream's
earlier windows actually decoded, not a re-solve of it from less history.
"""

from __future__ import annotations

import functools
import logging
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from omni_server.models.antialias import use_fused_activations
from omni_server.models.checkpoint import cast_keeping_rotary, load_module, read_config
from omni_server.models.graphs import ShapeGraphs, pow2
from omni_server.models.polyphase import use_polyphase_upsampling
from omni_server.models.windows import window_at
from omni_server.stage.errors import RequestError
from .dit import BACKENDS, backend_error, block_masks, fuse_gelu, fuse_qkv, run_layer, run_layer_with_past, windows
from .speakers import load_speakers

log = logging.getLogger(__name__)

DEFAULT_SAMPLE_RATE = 24000
WEIGHTS_PREFIX = "token2wav."

# transformers' RK4 uses these Python floats; the same constants keep the step bit-identical.
_ONE_THIRD = 1 / 3
_TWO_THIRDS = 2 / 3
_EVALS_PER_STEP = 4  # DiT evaluations per RK4 step


@dataclass
class CodeStream:
    """One request's streamed decode: the codes so far and how far audio has gone."""

    voice: str
    noise: torch.Generator
    codes: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    final: bool = False  # every code is here
    done: bool = False  # every sample was returned
    settled: int = 0  # mel frames the DiT decoded
    consumed: int = 0  # codes no later window reads
    x0: torch.Tensor | None = None  # the noise drawn and still needed, [frames, mel_dim]
    x0_start: int = 0  # mel frame index of x0[0]
    mel: torch.Tensor | None = None  # decoded mel not vocoded with full context yet, [1, mel_dim, n]
    mel_start: int = 0  # mel frame index of mel[..., 0]
    emitted: int = 0  # mel frames whose audio was returned
    # dit_past_cache: the keys and values the DiT's look-back layers saw in the last settled frames,
    # per evaluation of the solve ([evals, layers, 2, guidance halves, heads, frames, head_dim]),
    # of which the last `past_valid` are real (a stream's first windows may have fewer).
    past: torch.Tensor | None = None
    past_valid: int = 0

    def feed(self, codes: torch.Tensor, final: bool) -> None:
        """All codes so far (a growing prefix) and whether they are complete."""
        if self.final:
            return
        self.codes, self.final = torch.as_tensor(codes, dtype=torch.long).reshape(-1), final


@dataclass
class WindowPast:
    """The windows of one DiT pass under `dit_past_cache`, one entry each: the window's first frame
    in its stream (its rotary positions start there), the new frames it settles, its stream's past
    keys and values (None: none yet) and how many of their frames are real. The pass sets `kept`:
    each stream's past for its next window."""

    starts: list[int]
    settles: list[int]
    caches: list[torch.Tensor | None]
    frames: list[int]
    kept: list[torch.Tensor] | None = None


class Token2Wav:
    """Decodes talker code sequences to waveforms in float32, several at a time (`batch`), or
    streamed (`open_stream`, `stream_step`)."""

    def __init__(self, model_dir: str, device: str | torch.device = "cpu", chunk_frames: int = 72,
                 past_frames: int | None = None, future_frames: int = 24, vocoder_context_frames: int = 20,
                 first_chunk_frames: int | list[int] | None = None, cuda_graphs: bool = True, max_graphs: int = 32,
                 max_graph_batch: int = 32, tf32: bool = False, warmup_graphs: bool = False,
                 dit_dtype: Literal["float32", "bfloat16", "float16"] = "float32", polyphase_upsampling: bool = False,
                 compile: bool | Literal["blocks"] = False,
                 compile_vocoder: bool | Literal["activations", "triton"] = True,
                 dit_attention: Literal["cudnn", "efficient", "flash", "math"] | None = None,
                 dit_graph: Literal["solve", "step"] = "solve",
                 dit_fused_qkv: bool = False, dit_past_cache: bool = False, dit_gelu_epilogue: bool = False):
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel

        config = read_config(model_dir).token2wav_config
        self.device = torch.device(device)
        if dit_dtype not in DIT_DTYPES:
            raise ValueError(f"dit_dtype must be one of {sorted(DIT_DTYPES)}, got {dit_dtype!r}")
        if dit_attention is not None and dit_attention not in BACKENDS:
            raise ValueError(f"dit_attention must be null (PyTorch's choice) or one of {sorted(BACKENDS)}, "
                             f"got {dit_attention!r}")
        # The one attention kernel the DiT may use (null: PyTorch picks per call among those that
        # take the inputs; on the H200 its pick varied between runs, 268 vs 356 ms a batch-16 step).
        self._attention_backend = None if dit_attention is None else BACKENDS[dit_attention]
        if tf32 and self.device.type == "cuda":
            # float32 weights and activations, TF32 tensor-core matmuls and convolutions (~10 bits of
            # mantissa in the products): several times the DiT's fp32 throughput. Process-wide, which
            # is this generator's own stage process.
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        if self.device.type == "cuda":
            # cuDNN may pick nondeterministic (atomic-add) algorithms for the vocoder's convolutions
            # and transposed convolutions (the suspected cause of one seed giving two waveforms on the H200).
            # Process-wide, which is this generator's own stage process.
            torch.backends.cudnn.deterministic = True
        model = load_module(Qwen2_5OmniToken2WavModel, config, model_dir, WEIGHTS_PREFIX, self.device)
        self.dit = model.code2wav_dit_model
        # Each layer's mask kind (blocks behind, ahead): the masks are made once per solve, per kind.
        kinds = windows(self.dit)
        self._mask_kinds = sorted(set(kinds))
        self._layer_kind = [self._mask_kinds.index(k) for k in kinds]
        # dit_past_cache: windows start at their first new frame; the layers that look back attend
        # to the keys and values of the stream's last `_past_len` settled frames, kept per stream.
        self.dit_past_cache = bool(dit_past_cache)
        self._past_len = max(behind for behind, _ in kinds) * self.dit.block_size
        self._past_layers = sum(1 for behind, _ in kinds if behind)
        self._keeps_past = self.dit_past_cache and self._past_len > 0
        self.vocoder = model.code2wav_bigvgan_model
        if polyphase_upsampling:  # the same output to rounding, without a transposed convolution
            use_polyphase_upsampling(self.vocoder)

        dit_config = config.dit_config
        self.sample_rate: int = int(getattr(config, "sample_rate", None) or DEFAULT_SAMPLE_RATE)
        self.max_codes: int = dit_config.max_position_embeddings // dit_config.repeats
        self._num_embeds: int = dit_config.num_embeds  # the codec table has num_embeds + 1 rows
        self._speakers = {
            name: (s.cond.to(self.device, torch.float32), s.ref_mel.to(self.device, torch.float32))
            for name, s in load_speakers(model_dir).items()
        }
        self.voices: list[str] = sorted(self._speakers)
        block, repeats = dit_config.block_size, dit_config.repeats
        if past_frames is not None and dit_past_cache:
            log.warning("token2wav: past_frames is not used with dit_past_cache (windows hold no past frames)")
        past_frames = 48 if past_frames is None else past_frames
        starts = [chunk_frames] if first_chunk_frames is None else first_chunk_frames
        starts = [starts] if isinstance(starts, int) else list(starts)
        if not starts:
            raise ValueError("first_chunk_frames must be a window size or a non-empty list of them")
        for name, value, unit in (("chunk_frames", chunk_frames, block),
                                  *(("first_chunk_frames", size, block) for size in starts),
                                  ("past_frames", past_frames, block), ("future_frames", future_frames, repeats)):
            # (future_frames 0 made a stream's audio depend on when its last codes came: the vocoder
            # held back its context, or not, by whether the final flag came with them)
            positive = name.endswith("chunk_frames") or name == "future_frames"
            if not isinstance(value, int) or value < 0 or value % unit or (positive and value == 0):
                raise ValueError(f"{name} must be a {'positive' if positive else 'non-negative'} "
                                 f"multiple of {unit} (the DiT's {'block size' if unit == block else 'code rate'}), "
                                 f"got {value}")
        if not isinstance(vocoder_context_frames, int) or vocoder_context_frames < 0:
            raise ValueError(f"vocoder_context_frames must be a whole number >= 0, got {vocoder_context_frames!r}")
        self.chunk_frames, self.past_frames, self.future_frames = chunk_frames, past_frames, future_frames
        # New frames of the stream's first windows, in order; `chunk_frames` each after them.
        self.start_windows: tuple[int, ...] = tuple(starts)
        self.first_chunk_frames = starts[0]
        self.vocoder_context_frames = vocoder_context_frames
        # The frames a stream's windows span (past context + new + future), smallest first: the
        # DiT graphs' frame sizes, so no regular window computes padding (a stream's shorter last
        # window rounds up to the next). Codes a stream must have beyond those it consumed before
        # its next window can run: as many as the widest window spans.
        past = 0 if self.dit_past_cache else past_frames  # (frames of past a window holds)
        spans, settled, k = set(), 0, 0
        while True:
            size = starts[k] if k < len(starts) else chunk_frames
            spans.add(min(settled, past) + size + future_frames)
            if k >= len(starts) and settled >= past:  # every later window spans the same
                break
            settled, k = settled + size, k + 1
        self.frame_buckets: list[int] = sorted(spans)
        self.stream_lead = self.frame_buckets[-1] // repeats
        self.hop = 1  # waveform samples per mel frame
        for rate in config.bigvgan_config.upsample_rates:
            self.hop *= int(rate)
        # CUDA graphs of the DiT's ODE solve (see DiTGraphs): the DiT is small, so eager mode spends
        # its time launching ~30k kernels per window, not computing.
        graphs = cuda_graphs and self.device.type == "cuda"
        # compile: the graphs capture the DiT's layers and the vocoder compiled by torch.compile
        # (fused element-wise kernels: norms, modulation, rotary, GELU, Snake). Compiled at start
        # only (an eager run of the compiled code precedes each capture, all of them in the
        # warm-up); anything outside the graphs runs the plain modules, so no serving step compiles.
        # compile "blocks": the DiT's layers compiled one block at a time, so its 22 layers share
        # one compiled block (they differ only in the attention mask they are given, dit.py); the
        # CPU host compiled the 7B shape's DiT (then 3 blocks) in 25.6 s instead of 79.3 s, and ran
        # it at 0.49 instead of 0.41 s per call (no fusion across blocks). compile_vocoder false: the DiT only
        # (the vocoder took most of the compile on the CPU host: 111 s cold, 36 s from the cache).
        # compile_vocoder "activations": the vocoder's anti-aliased Snake activations only, each
        # (pad, upsample, Snake, pad, downsample: ~10 kernels) one expression compiled once for all
        # of them (omni_server/models/antialias.py): they were ~80 of the vocoder's 107 ms per
        # batch-16 call on the H200. With or without `compile`. The modules are replaced, so the
        # vocoder's runs outside its graphs run them too: compiled with dynamic shapes, batch 1
        # and larger batches each compile in the warm-up, and no size met later (a stream's last
        # piece, a batch past the graphs) compiles again. compile_vocoder "triton": the same
        # activations as two hand-written Triton kernels instead (omni_server/models/antialias_triton.py:
        # a plain walk along each row, where Inductor's dynamic-shape kernels divide by runtime
        # sizes per element), JIT-built in the warm-up and then for no size again.
        if compile not in (False, True, "blocks"):
            raise ValueError(f"compile must be true, false or \"blocks\", got {compile!r}")
        if compile_vocoder not in (False, True, "activations", "triton"):
            raise ValueError(f"compile_vocoder must be true, false, \"activations\" or \"triton\", got {compile_vocoder!r}")
        if compile and not (graphs and warmup_graphs):
            raise ValueError("compile needs CUDA graphs captured at start (a CUDA device, cuda_graphs and warmup_graphs)")
        if compile_vocoder in ("activations", "triton") and not (graphs and warmup_graphs):
            raise ValueError(f"compile_vocoder \"{compile_vocoder}\" needs CUDA graphs captured at start (a CUDA "
                             "device, cuda_graphs and warmup_graphs)")
        if dit_gelu_epilogue and self.device.type != "cuda":
            raise ValueError("dit_gelu_epilogue needs a CUDA device (cuBLASLt's GELU epilogue; the CPU kernel "
                             "computes the exact GELU, not the checkpoint's tanh form)")
        if compile == "blocks":
            dit_layers = functools.partial(self._dit_body, block=torch.compile(run_layer, dynamic=True),
                                           block_with_past=torch.compile(run_layer_with_past, dynamic=True))
        else:
            dit_layers = torch.compile(self._dit_body, dynamic=True) if compile else self._dit_body
        if compile_vocoder == "activations":
            use_fused_activations(self.vocoder, wrap=lambda fn: torch.compile(fn, dynamic=True))
        elif compile_vocoder == "triton":
            from omni_server.models.antialias_triton import triton_antialiased_snake  # (Triton: CUDA hosts only)

            use_fused_activations(self.vocoder, make=triton_antialiased_snake)
        vocoder = torch.compile(self._vocoder_body, dynamic=True) if compile and compile_vocoder is True \
            else self._vocoder_body
        # dit_graph: what one DiT graph holds, a whole ODE solve ("solve") or one solver step
        # ("step", replayed per step: each warm-up capture records 1/9 of the launches; DiTStepGraphs).
        if dit_graph not in ("solve", "step"):
            raise ValueError(f"dit_graph must be \"solve\" or \"step\", got {dit_graph!r}")
        if not graphs:
            self.graphs = None
        elif dit_graph == "step":
            self.graphs = DiTStepGraphs(self._graph_step(dit_layers), self._solve_masks, max_graphs, max_graph_batch,
                                        self.frame_buckets, warm_each=compile, eager=self._graph_step())
        else:
            self.graphs = DiTGraphs(functools.partial(self._rk4, layers=dit_layers), max_graphs, max_graph_batch,
                                    self.frame_buckets, warm_each=compile, eager=self._rk4)
        # The pass sizes the graphs serve without padding rows (the stage picks among them: stream_order.py).
        self.stream_batch_sizes = None if self.graphs is None else \
            [1 << i for i in range(self.graphs.max_batch.bit_length())]
        # The vocoder's ~2,600 ops per call, likewise: one graph per (batch bucket, mel length).
        self.vocoder_graphs = ShapeGraphs(vocoder, max_graphs, "token2wav vocoder", warm_each=True,
                                          eager=self._vocoder_body) if graphs else None
        # transformers' amplitude_to_db floor, made once on the device (capturable).
        self._min_level = torch.exp(torch.tensor(-115 / 20.0 * math.log(10), dtype=torch.float32)).to(self.device)
        # The DiT's speaker encoder sees only the voice's reference mel (or, for the unconditioned
        # half of guidance, zeros of its shape): encode both once per voice.
        with torch.inference_mode():
            encode = self.dit.input_embed.spk_encoder
            self._voice_codes = {name: (encode(mel), encode(torch.zeros_like(mel)))
                                 for name, (_, mel) in self._speakers.items()}
        # dit_dtype bfloat16 / float16: the DiT's transformer in half precision (tensor-core math,
        # fused attention, half the bytes; transformers runs it in float32). The ODE state, the
        # time embedding, the rotary tables and the guidance stay float32.
        self.dit_dtype = DIT_DTYPES[dit_dtype]
        if self.dit_dtype != torch.float32:
            cast_keeping_rotary(self.dit, self.dit_dtype)  # (the rotary frequencies' float32 values)
            self.dit.time_embed.float()
            self.dit.rotary_embed.float()
            self._voice_codes = {name: tuple(c.to(self.dit_dtype) for c in codes)
                                 for name, codes in self._voice_codes.items()}
        if dit_fused_qkv:  # (dit.fuse_qkv: one projection GEMM a layer instead of three)
            fuse_qkv(self.dit)
        if dit_gelu_epilogue:  # (dit.fuse_gelu: the feed-forward's GELU in its first GEMM's epilogue)
            fuse_gelu(self.dit)
        if self._attention_backend is not None:
            attn = self.dit.transformer_blocks[0].attn
            why = backend_error(self._attention_backend, attn.heads, attn.inner_dim // attn.heads,
                                self.dit_dtype, self.device)
            if why is not None:  # the same numbers either way: fall back rather than fail to start
                log.warning("token2wav: dit_attention %s cannot run here (%s); PyTorch picks the kernel",
                            dit_attention, why)
                self._attention_backend = None
        if self.graphs is not None and warmup_graphs:
            self._warm_graphs()  # (compiles too: an eager run precedes each capture)

    @torch.inference_mode()
    def _warm_graphs(self) -> None:
        """Capture now (not on the first requests), for every batch bucket, the DiT graphs of every
        streaming window size (with `stream_step`'s default solver settings) and the vocoder graphs
        of a stream's input lengths; after that nothing new is captured (other shapes run eagerly)."""
        t0, repeats = time.monotonic(), self.dit.repeats
        grid = self._time_grid(10, -1.0)
        # Every frame bucket a streaming window can fall in (replies end with shorter windows).
        buckets = self.stream_batch_sizes  # 1, 2, 4, ... <= max_batch
        # (Each capture's seconds, for the log: the first of each kind includes any compile.)
        dit_s, vocoder_s = [], []
        for frames in self.frame_buckets:
            for rows in buckets:
                codes = [torch.zeros(frames // repeats, dtype=torch.long)] * rows
                noise = [torch.zeros(frames, self.dit.mel_dim)] * rows
                # (streaming windows' graphs: with a past under dit_past_cache)
                past = WindowPast([0] * rows, [frames] * rows, [None] * rows, [0] * rows) if self._keeps_past else None
                if self.graphs.serves(rows, frames):  # (False once a capture failed: no eager runs here)
                    t = time.monotonic()
                    self._sample_mels(codes, [self.voices[0]] * rows, noise, grid, 0.5, past=past)
                    dit_s.append(time.monotonic() - t)
        for length in sorted(self._stream_vocoder_lengths()):
            for rows in buckets:
                if not self.vocoder_graphs.failed:
                    t = time.monotonic()
                    self._vocoder_batch(torch.zeros(rows, self.dit.mel_dim, length, device=self.device))
                    vocoder_s.append(time.monotonic() - t)
        self.graphs.frozen = self.vocoder_graphs.frozen = True  # no capture stalls while serving
        log.info("token2wav: %d DiT and %d vocoder CUDA graphs captured in %.1f s (DiT %.1f s, the first %.1f s; "
                 "vocoder %.1f s, the first %.1f s)", len(self.graphs.graphs), len(self.vocoder_graphs.graphs),
                 time.monotonic() - t0, sum(dit_s), (dit_s or [0.0])[0], sum(vocoder_s), (vocoder_s or [0.0])[0])

    @torch.inference_mode()
    def __call__(self, codes: torch.Tensor, voice: str | None = None, seed: int | None = None, num_steps: int = 10,
                 guidance_scale: float = 0.5, sway_coefficient: float | None = -1.0) -> torch.Tensor:
        """1-D float32 CPU waveform at `sample_rate` for `codes` ([n] or [1, n] codec ids);
        `voice` None is the first voice."""
        out = self.batch([{"codes": codes, "voice": voice, "seed": seed}], num_steps=num_steps,
                         guidance_scale=guidance_scale, sway_coefficient=sway_coefficient)[0]
        if isinstance(out, Exception):
            raise out
        return out

    @torch.inference_mode()
    def batch(self, requests: list[dict], num_steps: int = 10, guidance_scale: float = 0.5,
              sway_coefficient: float | None = -1.0) -> list[torch.Tensor | ValueError]:
        """Waveforms for several requests ({"codes", "voice", "seed"}) decoded together: one DiT pass
        over the batch (padded; padding never attended), then the vocoder per request. Each result
        equals the request decoded alone up to float rounding; an invalid request gets its
        ValueError in its place and does not affect the others."""
        grid = self._time_grid(num_steps, sway_coefficient)
        results: list = [None] * len(requests)
        todo = []
        for i, req in enumerate(requests):
            try:
                todo.append((i, *self._check(req.get("codes"), req.get("voice")), req.get("seed")))
            except ValueError as e:
                results[i] = e
        for i, codes, _, _ in todo:
            if codes.numel() == 0:
                results[i] = torch.zeros(0, dtype=torch.float32)
        todo = [t for t in todo if t[1].numel()]
        if todo:
            noise = [torch.randn([t[1].numel() * self.dit.repeats, self.dit.mel_dim], generator=_rng(t[3]))
                     for t in todo]
            mels = self._sample_mels([t[1] for t in todo], [t[2] for t in todo], noise, grid, guidance_scale)
            for (i, *_), wave in zip(todo, self._vocode([(mel, 0, None) for mel in mels])):
                results[i] = wave
        return results

    # ---- streaming ----------------------------------------------------------------------------

    def open_stream(self, voice: str | None = None, seed: int | None = None) -> CodeStream:
        """A decode whose codes arrive over time (`CodeStream.feed`); ValueError for an unknown voice."""
        voice = self.voices[0] if voice is None else voice
        if voice not in self._speakers:
            raise RequestError(f"unknown voice {voice!r}; valid voices: {', '.join(self.voices)}")
        return CodeStream(voice=voice, noise=_rng(seed), x0=torch.zeros(0, self.dit.mel_dim))

    def stream_ready(self, stream: CodeStream) -> bool:
        """Whether `stream_step` would make progress on this stream now."""
        if stream.done:
            return False
        return stream.final or stream.settled + self._chunk(stream.settled) + self.future_frames <= \
            stream.codes.numel() * self.dit.repeats

    @torch.inference_mode()
    def stream_step(self, streams: list[CodeStream], num_steps: int = 10, guidance_scale: float = 0.5,
                    sway_coefficient: float | None = -1.0) -> list[torch.Tensor | ValueError]:
        """One DiT window per ready stream (one padded pass for all), then each stream's newly
        settled audio (1-D float32 CPU, possibly empty). A stream is `done` once its last sample
        was returned; an invalid one gets a ValueError in its place and is done."""
        grid = self._time_grid(num_steps, sway_coefficient)
        # (a kept past holds one entry per evaluation of the solve, and per guidance half)
        past_shape = ((grid.shape[0] - 1) * _EVALS_PER_STEP, 2 if guidance_scale >= 1e-5 else 1)
        results: list = [torch.zeros(0)] * len(streams)
        windows = []  # (index, codes, noise, first new frame in the window, new frames, window's first frame)
        for k, st in enumerate(streams):
            if not self.stream_ready(st):
                continue
            try:
                if st.past is not None and (st.past.shape[0], st.past.shape[3]) != past_shape:
                    raise ValueError("a stream's solver settings (num_steps, guidance) changed between its windows")
                plan = self._window(st)
            except ValueError as e:
                st.done, st.past = True, None
                results[k] = e
                continue
            if plan is None:  # nothing left for the DiT: flush the vocoder
                results[k] = self._vocode_stream(st, None)
            else:
                windows.append((k, *plan))
        if windows:
            past = None
            if self._keeps_past:
                past = WindowPast(starts=[w[5] for w in windows], settles=[w[4] for w in windows],
                                  caches=[streams[w[0]].past for w in windows],
                                  frames=[streams[w[0]].past_valid for w in windows])
            mels = self._sample_mels([w[1] for w in windows], [streams[w[0]].voice for w in windows],
                                     [w[2] for w in windows], grid, guidance_scale, past=past)
            if past is not None:
                for (k, *_, n, _), kept in zip(windows, past.kept):
                    st = streams[k]
                    st.past, st.past_valid = kept, min(self._past_len, st.past_valid + n)
            plans = [self._vocode_plan(streams[k], mel[:, :, offset:offset + n])
                     for (k, _, _, offset, n, _), mel in zip(windows, mels)]
            for (k, *_), piece in zip(windows, self._vocode(plans)):
                results[k] = piece
        return results

    def stream_all(self, codes: torch.Tensor, voice: str | None = None, seed: int | None = None,
                   **kwargs) -> torch.Tensor:
        """`codes` decoded the streaming way, all at once (what a stream of them yields)."""
        st = self.open_stream(voice, seed)
        st.feed(codes, final=True)
        pieces = []
        while not st.done:
            (piece,) = self.stream_step([st], **kwargs)
            if isinstance(piece, Exception):
                raise piece
            pieces.append(piece)
        return torch.cat(pieces)

    def _window(self, st: CodeStream) -> tuple[torch.Tensor, torch.Tensor, int, int, int] | None:
        """The next DiT window of a ready stream: (codes, noise, offset, count) of the frames it
        settles and the window's first frame; None when every frame is settled already."""
        codes, _ = self._check(st.codes, st.voice, limit=False)
        repeats = self.dit.repeats
        total = codes.numel() * repeats
        first = st.settled
        size = self._chunk(first)
        middle = first + size + self.future_frames <= total
        if not middle and first >= total:
            return None
        past = 0 if self.dit_past_cache else self.past_frames
        start = max(first - past, 0)
        end = first + size + self.future_frames if middle else total
        settled = size if middle else total - first
        have = st.x0_start + st.x0.shape[0]
        if end > have:  # the noise continues one sequence (draws from one generator)
            st.x0 = torch.cat([st.x0, torch.randn([end - have, self.dit.mel_dim], generator=st.noise)])
        noise = st.x0[start - st.x0_start:end - st.x0_start]
        st.settled = first + settled
        keep = max(st.settled - past, 0)  # the next window's start
        st.consumed = keep // repeats
        st.x0, st.x0_start = st.x0[keep - st.x0_start:], keep
        return codes[start // repeats:end // repeats], noise, first - start, settled, start

    def _chunk(self, settled: int) -> int:
        """New frames of the window that starts at frame `settled` (a sum of the windows before)."""
        return window_at(settled, self.start_windows, self.chunk_frames)

    def _vocode_plan(self, st: CodeStream, new_mel: torch.Tensor | None) -> tuple[torch.Tensor, int, int] | None:
        """Append newly settled mel frames; the vocoder input that yields the audio whose context
        is complete (all of it once the DiT is done, else all but the last `vocoder_context_frames`
        frames) as (mel [1, mel_dim, n], first sample kept, samples kept), or None for none."""
        if new_mel is not None:
            st.mel = new_mel if st.mel is None else torch.cat([st.mel, new_mel], dim=2)
        avail = st.mel_start + (0 if st.mel is None else st.mel.shape[2])
        last = st.final and st.settled >= st.codes.numel() * self.dit.repeats
        ctx = self.vocoder_context_frames
        upto = avail if last else max(avail - ctx, st.emitted)
        plan = None
        if upto > st.emitted:
            lo = max(st.emitted - ctx, st.mel_start)
            plan = (st.mel[:, :, lo - st.mel_start:], (st.emitted - lo) * self.hop, (upto - st.emitted) * self.hop)
            st.emitted = upto
            cut = max(upto - ctx, st.mel_start)  # left context of the next piece
            st.mel, st.mel_start = st.mel[:, :, cut - st.mel_start:], cut
        if last:
            st.done, st.mel, st.past = True, None, None
        return plan

    def _vocode_stream(self, st: CodeStream, new_mel: torch.Tensor | None) -> torch.Tensor:
        return self._vocode([self._vocode_plan(st, new_mel)])[0]

    def _stream_vocoder_lengths(self) -> set[int]:
        """The vocoder's input lengths (mel frames) in a long stream, but for its last piece: the
        windows' own planning run on stand-in mel (one channel) until they repeat."""
        st = CodeStream(voice=self.voices[0], noise=_rng(0))  # never final: no last piece
        lengths = set()
        for _ in range(len(self.start_windows) + 3):
            size = self._chunk(st.settled)
            st.settled += size
            plan = self._vocode_plan(st, torch.zeros(1, 1, size))
            if plan is not None:
                lengths.add(plan[0].shape[2])
        return lengths

    def _vocoder_body(self, mel: torch.Tensor) -> torch.Tensor:
        """transformers' BigVGAN forward ([B, mel_dim, T] -> [B, samples], clamped), minus its final
        squeeze and copy to the CPU and with its dB floor made once: the same float32 operations,
        and nothing that a CUDA graph cannot capture."""
        v = self.vocoder
        decibels = 20 * torch.log10(torch.clamp(torch.exp(mel), min=self._min_level)) - 20
        hidden = v.conv_pre(v.normalize_spectrogram(decibels, 1, -115))
        for layer in range(v.num_upsample_layers):
            hidden = v.ups[layer][0](hidden)
            blocks = v.resblocks[layer * v.num_residual_blocks:(layer + 1) * v.num_residual_blocks]
            hidden = sum(block(hidden) for block in blocks) / v.num_residual_blocks
        return torch.clamp(v.conv_post(v.activation_post(hidden)), min=-1.0, max=1.0)[:, 0]

    def _vocoder_batch(self, mels: torch.Tensor) -> torch.Tensor:
        """[B, mel_dim, T] -> [B, samples] on the CPU; through a CUDA graph when one serves."""
        graphs, count = self.vocoder_graphs, mels.shape[0]
        rows = pow2(count)
        if graphs is None or rows > self.graphs.max_batch or not graphs.has_room((rows, mels.shape[2])):
            return self._vocoder_body(mels).cpu()
        if rows > count:  # rows are independent: pad with copies of the first
            mels = torch.cat([mels, mels[:1].expand(rows - count, -1, -1)])
        return graphs.run((rows, mels.shape[2]), (mels,))[:count].cpu()

    def _vocode(self, plans: list[tuple[torch.Tensor, int, int | None] | None]) -> list[torch.Tensor]:
        """Audio pieces (1-D float32 CPU) for vocoder plans (mel, first sample, samples or None for
        all); inputs of one length run as one batch
        (the vocoder treats batch rows independently), each of the rest alone."""
        pieces = [torch.zeros(0)] * len(plans)
        by_length: dict[int, list[int]] = {}
        for i, plan in enumerate(plans):
            if plan is not None:
                by_length.setdefault(plan[0].shape[2], []).append(i)
        for group in by_length.values():
            waves = self._vocoder_batch(torch.cat([plans[i][0] for i in group]))
            for i, wave in zip(group, waves):
                _, skip, keep = plans[i]
                pieces[i] = wave[skip:None if keep is None else skip + keep].float().cpu()
        return pieces

    def _check(self, codes, voice: str | None, limit: bool = True) -> tuple[torch.Tensor, str]:
        voice = self.voices[0] if voice is None else voice
        if voice not in self._speakers:
            raise RequestError(f"unknown voice {voice!r}; valid voices: {', '.join(self.voices)}")
        codes = torch.as_tensor(codes)
        if codes.ndim == 2 and codes.shape[0] == 1:
            codes = codes[0]
        if codes.ndim != 1:
            raise ValueError(f"codes must have shape [n] or [1, n], got {list(codes.shape)}")
        if limit and codes.numel() > self.max_codes:
            raise ValueError(f"{codes.numel()} codes exceed the token2wav limit of {self.max_codes} per call")
        if codes.numel():
            # Checked here: an out-of-range embedding index on a GPU is a device assert that kills the process.
            low, high = int(codes.min()), int(codes.max())
            if low < 0 or high > self._num_embeds:
                raise ValueError(f"codec ids must lie in [0, {self._num_embeds}], got [{low}, {high}]")
        return codes.to(self.device, torch.long), voice

    def _time_grid(self, num_steps: int, sway_coefficient: float | None) -> torch.Tensor:
        if num_steps < 2:
            raise ValueError(f"num_steps must be at least 2, got {num_steps}")
        grid = torch.linspace(0, 1, num_steps, device=self.device, dtype=torch.float32)
        if sway_coefficient is not None:
            # "Sway sampling": spends more steps near t=0 for negative coefficients.
            grid += sway_coefficient * (torch.cos(torch.pi / 2 * grid) - 1 + grid)
        # transformers' solver only returns the endpoint for a non-decreasing grid; outside
        # roughly [-1, 1.75] the sway folds the grid back and its result is meaningless.
        if bool((grid[1:] < grid[:-1]).any()):
            raise ValueError(f"sway_coefficient {sway_coefficient} makes the time grid non-monotonic")
        return grid

    def _sample_mels(self, codes: list[torch.Tensor], voices: list[str], noise: list[torch.Tensor],
                     grid: torch.Tensor, guidance_scale: float, pad: bool | None = None,
                     past: WindowPast | None = None) -> list[torch.Tensor]:
        """Mel spectrograms [1, mel_dim, frames_i]: transformers' DiT `sample` (flow matching, RK4
        3/8 rule, classifier-free guidance) over a padded batch, from the given starting noise
        ([frames_i, mel_dim] each, on CPU). `pad` (default: when a CUDA graph can serve the call)
        rounds the batch and frame counts up to the graphs' buckets; padding never changes a result
        beyond rounding. Under `dit_past_cache`, `past` describes streaming windows and receives
        their streams' kept keys and values (None: whole sequences, decoded as without it)."""
        dit, repeats = self.dit, self.dit.repeats
        lengths = [c.numel() * repeats for c in codes]
        count, frames = len(codes), max(lengths)
        shape = DiTGraphs.bucket(count, frames, self.frame_buckets)
        graphs = self.graphs if self.graphs is not None and self.graphs.serves(count, frames) else None
        if pad is None:
            pad = graphs is not None
        if not pad or shape is None:  # graphs only ever see bucketed shapes
            graphs = None
        else:
            rows, frames = shape
            # Extra rows repeat the first request (real inputs, no empty attention rows); dropped below.
            codes, voices, noise = (list(v) + [v[0]] * (rows - count) for v in (codes, voices, noise))
            lengths = lengths + [lengths[0]] * (rows - count)
        n = len(codes)
        # (padding rows repeat window 0's past, as their inputs repeat its codes)
        rows_past = None if past is None else \
            WindowPast(*(v + v[:1] * (n - count) for v in (past.starts, past.settles, past.caches, past.frames)))
        code_batch = torch.zeros(n, frames // repeats, dtype=torch.long, device=self.device)
        x = torch.zeros(n, frames, dit.mel_dim, device=self.device)
        for b, (c, x0) in enumerate(zip(codes, noise)):
            code_batch[b, :c.numel()] = c
            x[b, :lengths[b]] = x0.to(self.device)

        cfg = guidance_scale >= 1e-5
        halves = 2 if cfg else 1
        speaker = torch.cat([self._speakers[v][0] for v in voices]).to(self.dit_dtype)  # [n, enc_emb_dim]
        ref = torch.cat([self._voice_codes[v][0] for v in voices])
        code_emb = dit.text_embed(code_batch)
        if cfg:  # second half: voice, reference and codes dropped
            speaker = torch.cat([speaker, torch.zeros_like(speaker)])
            ref = torch.cat([ref, torch.cat([self._voice_codes[v][1] for v in voices])])
            code_emb = torch.cat([code_emb, dit.text_embed(code_batch, drop_code=True)])
        fixed = torch.cat([ref.unsqueeze(1).expand(-1, frames, -1), code_emb,
                           speaker.unsqueeze(1).expand(-1, frames, -1)], dim=-1)
        positions = torch.arange(frames, device=self.device)[None].expand(n * halves, -1)
        if past is not None:  # rotary positions from the stream's start (kept keys were rotated so)
            positions = positions + torch.tensor(rows_past.starts, device=self.device).repeat(halves)[:, None]
        cos, sin = dit.rotary_embed(fixed, positions)
        kv = () if past is None else self._past_inputs(rows_past, frames, halves, grid, fixed.dtype)
        # One head's worth ([rows, 1, F, F]): every head has the same mask, and attention broadcasts it.
        block_diff = dit._create_block_diff(fixed[:, :, :1])[:, :1]
        if past is not None:  # keys: the kept past (P frames, the blocks before the window's), then the window
            block_diff = self._past_block_diff(rows_past, frames, halves)
        if any(length < frames for length in lengths):
            # A real frame never attends padding: those keys fall outside every layer's block window.
            valid = torch.arange(frames, device=self.device)[None] < torch.tensor(lengths, device=self.device)[:, None]
            valid = valid.repeat(halves, 1)
            if past is not None:
                valid_keys = torch.cat([torch.ones_like(valid[:, :1]).expand(-1, self._past_len), valid], dim=1)
            else:
                valid_keys = valid
            hide = valid[:, None, :, None] & ~valid_keys[:, None, None, :]
            block_diff = block_diff.masked_fill(hide, frames + dit.block_size + self._past_len)
        inputs = (x, fixed, cos, sin, block_diff, *kv, grid)
        options = (cfg, guidance_scale)
        x = graphs.solve(inputs, options) if graphs is not None else self._rk4(*inputs, *options)
        if past is not None:
            x, kept = x
            # [evals, layers, 2, halves * n, ...] -> each window's [evals, layers, 2, halves, ...]
            kept = kept.unflatten(3, (halves, n))
            past.kept = [kept[:, :, :, :, b].clone() for b in range(count)]
        return [x[b:b + 1, :lengths[b]].permute(0, 2, 1) for b in range(count)]

    def _past_inputs(self, past: WindowPast, frames: int, halves: int, grid: torch.Tensor,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The pass's kept keys and values ([evals, layers, 2, halves * rows, heads, P, head_dim]:
        row half * rows + b is window b's, zeros where a stream has none yet) and each row's P key
        indices (into past + window) that its next window keeps: the last P of those it settles."""
        attn = self.dit.transformer_blocks[0].attn
        heads, head_dim, P = attn.heads, attn.inner_dim // attn.heads, self._past_len
        evals = (grid.shape[0] - 1) * _EVALS_PER_STEP
        none = torch.zeros(evals, self._past_layers, 2, halves, heads, P, head_dim, dtype=dtype, device=self.device)
        stacked = torch.stack([none if c is None else c for c in past.caches], dim=4).flatten(3, 4)
        keep = torch.tensor(past.settles, device=self.device)[:, None] + torch.arange(P, device=self.device)
        keep = keep.clamp_(max=P + frames - 1).repeat(halves, 1)[:, None, :, None]
        return stacked, keep

    def _past_block_diff(self, past: WindowPast, frames: int, halves: int) -> torch.Tensor:
        """Key block - query block ([rows, 1, F, P + F]) with the kept past's P frames before the
        window's F as the blocks right before it; past frames a stream does not have yet lie
        outside every layer's window."""
        P, block, device = self._past_len, self.dit.block_size, self.device
        key_block = torch.div(torch.arange(-P, frames, device=device), block, rounding_mode="floor")
        query_block = torch.arange(frames, device=device) // block
        rows = len(past.frames)
        diff = (key_block[None, :] - query_block[:, None]).expand(rows * halves, 1, -1, -1)
        missing = torch.arange(P, device=device)[None] < P - torch.tensor(past.frames, device=device)[:, None]
        missing = torch.cat([missing, torch.zeros(rows, frames, dtype=torch.bool, device=device)], dim=1)
        return diff.masked_fill(missing.repeat(halves, 1)[:, None, None, :], frames + block + P)

    def _rk4(self, x: torch.Tensor, fixed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             block_diff: torch.Tensor, *rest, layers: Callable[..., torch.Tensor] | None = None):
        """The ODE solve from noise `x` to mel frames: fixed shapes, no host syncs (CUDA-graphable).
        `rest`: (grid, cfg, guidance_scale), under `dit_past_cache` (past, keep, grid, cfg,
        guidance_scale), and then the result is (x, kept: [evals, ...] as `past`).
        `layers`: `_dit_body` or a compiled one."""
        *kv, grid, cfg, guidance_scale = rest
        masks = self._solve_masks(block_diff, fixed.dtype)  # once per solve, not per layer call
        return _each_step(x, grid, kv, lambda x, i, extra: self._rk4_step(
            x, grid[i:i + 2], fixed, cos, sin, masks, cfg, guidance_scale, layers, *extra))

    def _solve_masks(self, block_diff: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
        if block_diff.shape[3] == block_diff.shape[2]:  # no past keys
            return block_masks(block_diff, self._mask_kinds, dtype)
        # (block_diff's keys: P past frames, then the window's; only layers that look back see the past)
        return [block_masks(block_diff if behind else block_diff[..., self._past_len:], [(behind, ahead)], dtype)[0]
                for behind, ahead in self._mask_kinds]

    def _graph_step(self, layers: Callable[..., torch.Tensor] | None = None) -> Callable[..., torch.Tensor]:
        """`_rk4_step` over flat tensor arguments, as `DiTStepGraphs` captures it:
        (x, t, fixed, cos, sin, *masks, cfg, guidance_scale), under `dit_past_cache`
        (x, t, fixed, cos, sin, *masks, past, keep, cfg, guidance_scale)."""
        kinds = len(self._mask_kinds)

        def step(x, t, fixed, cos, sin, *rest):
            masks, rest = list(rest[:kinds]), rest[kinds:]
            if len(rest) == 4:  # (past, keep, cfg, guidance_scale)
                past, keep, *rest = rest
                return self._rk4_step(x, t, fixed, cos, sin, masks, *rest, layers=layers, past=past, keep=keep)
            return self._rk4_step(x, t, fixed, cos, sin, masks, *rest, layers=layers)
        return step

    def _rk4_step(self, x: torch.Tensor, t: torch.Tensor, fixed: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, masks: list[torch.Tensor], cfg: bool, guidance_scale: float,
                  layers: Callable[..., torch.Tensor] | None = None, past: torch.Tensor | None = None,
                  keep: torch.Tensor | None = None):
        """One step of the solve, from time t[0] to t[1] (`t`: two values of the grid). With `past`
        (the step's evaluations' kept keys and values, [4, layers, 2, rows, heads, P, head_dim]),
        also returns what each evaluation keeps for the next window, shaped alike."""
        dit, rows = self.dit, fixed.shape[0]
        layers = self._dit_body if layers is None else layers
        kept = []

        def velocity(t: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
            # (The casts are no-ops in float32.)
            temb = dit.time_embed(t.repeat(rows)).to(fixed.dtype)
            state = state.to(fixed.dtype)
            h = dit.input_embed.proj(torch.cat([state.repeat(rows // state.shape[0], 1, 1), fixed], dim=-1))
            if past is None:
                out = layers(h, temb, cos, sin, masks)
            else:
                out, evaluation_kept = layers(h, temb, cos, sin, masks, past=past[len(kept)], keep=keep)
                kept.append(evaluation_kept)
            out = out.float()
            if not cfg:
                return out
            guided, null = torch.chunk(out, 2, dim=0)
            return guided + (guided - null) * guidance_scale

        # RK4 "3/8 rule", operand order as in transformers so float32 rounding matches.
        t0, t1 = t[0], t[1]
        dt = t1 - t0
        k1 = velocity(t0, x)
        k2 = velocity(t0 + dt * _ONE_THIRD, x + dt * k1 * _ONE_THIRD)
        k3 = velocity(t0 + dt * _TWO_THIRDS, x + dt * (k2 - k1 * _ONE_THIRD))
        k4 = velocity(t1, x + dt * (k1 - k2 + k3))
        x = x + (k1 + 3 * (k2 + k3) + k4) * dt / 8
        return x if past is None else (x, torch.stack(kept))

    def _dit_body(self, h: torch.Tensor, temb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  masks: list[torch.Tensor], block: Callable[..., torch.Tensor] | None = None,
                  past: torch.Tensor | None = None, keep: torch.Tensor | None = None,
                  block_with_past: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None):
        """The DiT's transformer layers and output projection (one velocity evaluation's bulk), each
        layer with its kind's mask (`block_masks`). `block`: `run_layer` or a compiled one (the
        layer is an argument, so one compiled copy serves every layer: torch.compile takes a
        module's parameters as inputs, not constants). With `past` (this evaluation's kept keys and
        values, [layers that look back, 2, rows, heads, P, head_dim]) those layers attend to it too
        (`block_with_past`: `run_layer_with_past` or a compiled one), and the result is (output,
        what they keep, shaped as `past`)."""
        dit, run = self.dit, run_layer if block is None else block
        run_past = run_layer_with_past if block_with_past is None else block_with_past
        kept = []
        for layer, kind in zip(dit.transformer_blocks, self._layer_kind):
            if past is not None and self._mask_kinds[kind][0]:
                h, layer_kept = run_past(layer, h, temb, cos, sin, masks[kind], self._attention_backend,
                                         past[len(kept)], keep)
                kept.append(layer_kept)
            else:
                h = run(layer, h, temb, cos, sin, masks[kind], self._attention_backend)
        out = dit.proj_out(dit.norm_out(h, temb))
        return out if past is None else (out, torch.stack(kept))


DIT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DiTGraphs(ShapeGraphs):
    """The DiT's ODE solves as CUDA graphs: a captured solve replays its ~30k kernel launches at
    once. Shapes are bucketed (rows to a power of two, frames to the next of `frame_buckets`, the
    streaming windows' spans) so a few graphs serve every streaming window; windows wider than the
    widest bucket or batches above `max_batch` run eagerly."""

    def __init__(self, solve, max_graphs: int, max_batch: int, frame_buckets: list[int], warm_each: bool = False,
                 eager=None):
        super().__init__(solve, max_graphs, "token2wav DiT", warm_each=warm_each, eager=eager)
        self.max_batch, self.frame_buckets = max_batch, frame_buckets

    @staticmethod
    def bucket(rows: int, frames: int, frame_buckets: list[int]) -> tuple[int, int] | None:
        wide = next((b for b in frame_buckets if b >= frames), None)
        return None if wide is None else (pow2(rows), wide)

    def serves(self, rows: int, frames: int) -> bool:
        shape = self.bucket(rows, frames, self.frame_buckets)
        return shape is not None and shape[0] <= self.max_batch and self.has_room(shape)

    def warm_run(self, inputs: tuple[torch.Tensor, ...], options: tuple) -> None:
        # One solver step (of the default grid's nine): the steps run the same kernels at the same
        # shapes (only the time values differ), so this warms all of them for a ninth of the host
        # time (on the H200 a warm start spent ~1.1 s per DiT capture: this run, then the capture,
        # each a host pass over the whole solve's 792 compiled block calls in the 7B's DiT).
        self.fn(*inputs[:-1], inputs[-1][:2], *options)

    def solve(self, inputs: tuple[torch.Tensor, ...], options: tuple) -> torch.Tensor:
        # The grid's values are a static input like the others: only its length shapes the graph.
        # (Under dit_past_cache, streaming windows pass their past too; whole decodes do not.)
        kind = "past" if len(inputs) > 6 else ""
        return self.run((inputs[0].shape[0], inputs[0].shape[1], inputs[-1].shape[0], kind, *options), inputs, options)


class DiTStepGraphs(DiTGraphs):
    """`dit_graph: step`: one graph per shape holds ONE solver step (4 of the solve's 36 DiT
    evaluations with the default grid), replayed once per step, the state carried from each replay
    into the next. A capture records a ninth of a whole solve's ~30k launches, so a shape's
    warm-up (an eager step, then the capture) is 2 steps of host work instead of 10; serving
    replays 9 graphs per solve instead of one. The masks are made once per solve, outside the graphs. Any grid length
    replays the same graph."""

    def __init__(self, step, masks: Callable[[torch.Tensor, torch.dtype], list[torch.Tensor]], max_graphs: int,
                 max_batch: int, frame_buckets: list[int], warm_each: bool = False, eager=None):
        super().__init__(step, max_graphs, max_batch, frame_buckets, warm_each=warm_each, eager=eager)
        self.masks = masks

    def warm_run(self, inputs: tuple[torch.Tensor, ...], options: tuple) -> None:
        ShapeGraphs.warm_run(self, inputs, options)  # (the step itself: nothing to leave out)

    def solve(self, inputs: tuple[torch.Tensor, ...], options: tuple):
        x, fixed, cos, sin, block_diff, *kv, grid = inputs
        masks = self.masks(block_diff, fixed.dtype)
        key = (x.shape[0], x.shape[1], "step", "past" if kv else "", *options)
        # (dit_past_cache: each replay takes and gives its step's evaluations' keys and values)
        return _each_step(x, grid, kv, lambda x, i, extra: self.run(
            key, (x, grid[i:i + 2], fixed, cos, sin, *masks, *extra), options))


def _each_step(x: torch.Tensor, grid: torch.Tensor, kv: list, step: Callable):
    """A solve's steps in order, `step(x, i, extra) -> x`. With `kv` (the pass's kept keys and values
    for every evaluation, and the keep indices), `extra` is step i's evaluations' share and the keep
    indices, each step returns (x, what it keeps), and the solve (x, all steps' kept)."""
    past, keep = kv or (None, None)
    kept = []
    for i in range(grid.shape[0] - 1):
        extra = () if past is None else (past[i * _EVALS_PER_STEP:(i + 1) * _EVALS_PER_STEP], keep)
        x = step(x, i, extra)
        if past is not None:
            x, step_kept = x
            kept.append(step_kept)
    return x if past is None else (x, torch.cat(kept))


def _rng(seed: int | None) -> torch.Generator:
    # On CPU, so that a seed means the same noise on every device.
    return torch.Generator(device="cpu").manual_seed(secrets.randbits(63) if seed is None else seed)
