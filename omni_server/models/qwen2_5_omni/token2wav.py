"""Qwen2.5-Omni token2wav: talker codec codes -> 24 kHz waveform (DiT flow matching + BigVGAN).

The networks are transformers' own modules; only the DiT's `sample` loop is restated here, because
transformers draws its starting noise from the global RNG.  A serving process decodes many requests
concurrently, so the noise comes from a per-call generator instead: a request's seed alone decides
its waveform, and no call disturbs any other RNG user.  The loop is otherwise the same sequence of
float32 operations as transformers' (`Qwen2_5OmniToken2WavDiTModel.sample` with its
`RungeKutta4ODESolver`), so for the same noise the results agree to rounding.
"""

from __future__ import annotations

import secrets

import torch

from .checkpoint import load_tensors, read_config
from .speakers import load_speakers

DEFAULT_SAMPLE_RATE = 24000
WEIGHTS_PREFIX = "token2wav."

# transformers' RK4 uses these Python floats; the same constants keep the step bit-identical.
_ONE_THIRD = 1 / 3
_TWO_THIRDS = 2 / 3


class Token2Wav:
    """Decodes talker code sequences to waveforms in float32, several at a time (`batch`)."""

    def __init__(self, model_dir: str, device: str | torch.device = "cpu"):
        from transformers.initialization import no_init_weights
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel

        config = read_config(model_dir).token2wav_config
        self.device = torch.device(device)
        # Every parameter is overwritten by the checkpoint: skip the random init (slow for the real
        # model), and keep the global RNG out of it as well.
        with torch.random.fork_rng(devices=[]), no_init_weights():
            model = Qwen2_5OmniToken2WavModel._from_config(config, attn_implementation="sdpa")
        result = model.load_state_dict(load_tensors(model_dir, WEIGHTS_PREFIX), strict=False)
        if result.missing_keys or result.unexpected_keys:
            raise ValueError(f"token2wav weights in {model_dir} do not match the model: "
                             f"missing {result.missing_keys}, unexpected {result.unexpected_keys}")
        # The DiT and vocoder are only trained / validated in float32 (transformers forces it too).
        model = model.float().eval().to(self.device)
        self.dit = model.code2wav_dit_model
        self.vocoder = model.code2wav_bigvgan_model

        dit_config = config.dit_config
        self.sample_rate: int = int(getattr(config, "sample_rate", None) or DEFAULT_SAMPLE_RATE)
        self.max_codes: int = dit_config.max_position_embeddings // dit_config.repeats
        self._num_embeds: int = dit_config.num_embeds  # the codec table has num_embeds + 1 rows
        self._speakers = {
            name: (s.cond.to(self.device, torch.float32), s.ref_mel.to(self.device, torch.float32))
            for name, s in load_speakers(model_dir).items()
        }
        self.voices: list[str] = sorted(self._speakers)
        # The DiT's speaker encoder sees only the voice's reference mel (or, for the unconditioned
        # half of guidance, zeros of its shape): encode both once per voice.
        with torch.inference_mode():
            encode = self.dit.input_embed.spk_encoder
            self._voice_codes = {name: (encode(mel), encode(torch.zeros_like(mel)))
                                 for name, (_, mel) in self._speakers.items()}

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
            mels = self._sample_mels([t[1] for t in todo], [t[2] for t in todo], [t[3] for t in todo], grid,
                                     guidance_scale)
            for (i, *_), mel in zip(todo, mels):
                results[i] = self.vocoder(mel).reshape(-1).float().cpu()
        return results

    def _check(self, codes, voice: str | None) -> tuple[torch.Tensor, str]:
        voice = self.voices[0] if voice is None else voice
        if voice not in self._speakers:
            raise ValueError(f"unknown voice {voice!r}; valid voices: {', '.join(self.voices)}")
        codes = torch.as_tensor(codes)
        if codes.ndim == 2 and codes.shape[0] == 1:
            codes = codes[0]
        if codes.ndim != 1:
            raise ValueError(f"codes must have shape [n] or [1, n], got {list(codes.shape)}")
        if codes.numel() > self.max_codes:
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

    def _sample_mels(self, codes: list[torch.Tensor], voices: list[str], seeds: list[int | None],
                     grid: torch.Tensor, guidance_scale: float) -> list[torch.Tensor]:
        """Mel spectrograms [1, mel_dim, frames_i]: transformers' DiT `sample` (flow matching, RK4
        3/8 rule, classifier-free guidance) over a padded batch, with seeded per-request noise."""
        dit, repeats = self.dit, self.dit.repeats
        lengths = [c.numel() * repeats for c in codes]
        frames, n = max(lengths), len(codes)
        code_batch = torch.zeros(n, frames // repeats, dtype=torch.long, device=self.device)
        x = torch.zeros(n, frames, dit.mel_dim, device=self.device)
        for b, (c, seed) in enumerate(zip(codes, seeds)):
            code_batch[b, :c.numel()] = c
            # Drawn on CPU so that a seed means the same noise on every device.
            g = torch.Generator(device="cpu").manual_seed(secrets.randbits(63) if seed is None else seed)
            x[b, :lengths[b]] = torch.randn([lengths[b], dit.mel_dim], generator=g).to(self.device)

        cfg = guidance_scale >= 1e-5
        halves = 2 if cfg else 1
        speaker = torch.cat([self._speakers[v][0] for v in voices])  # [n, enc_emb_dim]
        ref = torch.cat([self._voice_codes[v][0] for v in voices])
        code_emb = dit.text_embed(code_batch)
        if cfg:  # second half: voice, reference and codes dropped
            speaker = torch.cat([speaker, torch.zeros_like(speaker)])
            ref = torch.cat([ref, torch.cat([self._voice_codes[v][1] for v in voices])])
            code_emb = torch.cat([code_emb, dit.text_embed(code_batch, drop_code=True)])
        fixed = torch.cat([ref.unsqueeze(1).expand(-1, frames, -1), code_emb,
                           speaker.unsqueeze(1).expand(-1, frames, -1)], dim=-1)
        positions = torch.arange(frames, device=self.device)[None].expand(n * halves, -1)
        rotary = dit.rotary_embed(fixed, positions)
        block_diff = dit._create_block_diff(fixed[:, :, :1])
        valid = torch.arange(frames, device=self.device)[None] < torch.tensor(lengths, device=self.device)[:, None]
        if not bool(valid.all()):
            # A real frame never attends padding: those keys fall outside every layer's block window.
            valid = valid.repeat(halves, 1)
            hide = valid[:, None, :, None] & ~valid[:, None, None, :]
            block_diff = block_diff.masked_fill(hide, float(frames + dit.block_size))

        def velocity(t: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
            temb = dit.time_embed(t.repeat(n * halves))
            h = dit.input_embed.proj(torch.cat([state.repeat(halves, 1, 1), fixed], dim=-1))
            for block in dit.transformer_blocks:
                h = block(h, temb, position_embeddings=rotary, block_diff=block_diff)
            out = dit.proj_out(dit.norm_out(h, temb))
            if not cfg:
                return out
            guided, null = torch.chunk(out, 2, dim=0)
            return guided + (guided - null) * guidance_scale

        # RK4 "3/8 rule", operand order as in transformers so float32 rounding matches.
        for t0, t1 in zip(grid[:-1], grid[1:]):
            dt = t1 - t0
            k1 = velocity(t0, x)
            k2 = velocity(t0 + dt * _ONE_THIRD, x + dt * k1 * _ONE_THIRD)
            k3 = velocity(t0 + dt * _TWO_THIRDS, x + dt * (k2 - k1 * _ONE_THIRD))
            k4 = velocity(t1, x + dt * (k1 - k2 + k3))
            x = x + (k1 + 3 * (k2 + k3) + k4) * dt / 8
        return [x[b:b + 1, :lengths[b]].permute(0, 2, 1) for b in range(n)]
