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
    """Decodes one talker code sequence at a time, in float32, with a chosen voice."""

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

    @torch.inference_mode()
    def __call__(self, codes: torch.Tensor, voice: str | None = None, seed: int | None = None, num_steps: int = 10,
                 guidance_scale: float = 0.5, sway_coefficient: float | None = -1.0) -> torch.Tensor:
        """1-D float32 CPU waveform at `sample_rate` for `codes` ([n] or [1, n] codec ids);
        `voice` None is the first voice."""
        voice = self.voices[0] if voice is None else voice
        if voice not in self._speakers:
            raise ValueError(f"unknown voice {voice!r}; valid voices: {', '.join(self.voices)}")
        codes = torch.as_tensor(codes)
        if codes.ndim == 2 and codes.shape[0] == 1:
            codes = codes[0]
        if codes.ndim != 1:
            raise ValueError(f"codes must have shape [n] or [1, n], got {list(codes.shape)}")
        if codes.numel() == 0:
            return torch.zeros(0, dtype=torch.float32)
        if codes.numel() > self.max_codes:
            raise ValueError(f"{codes.numel()} codes exceed the token2wav limit of {self.max_codes} per call")
        # Checked here: an out-of-range embedding index on a GPU is a device assert that kills the process.
        low, high = int(codes.min()), int(codes.max())
        if low < 0 or high > self._num_embeds:
            raise ValueError(f"codec ids must lie in [0, {self._num_embeds}], got [{low}, {high}]")

        cond, ref_mel = self._speakers[voice]
        mel = self._sample_mel(codes.to(self.device, torch.long)[None], cond, ref_mel, seed, num_steps,
                               guidance_scale, sway_coefficient)
        return self.vocoder(mel).reshape(-1).float().cpu()

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

    def _sample_mel(self, codes: torch.Tensor, cond: torch.Tensor, ref_mel: torch.Tensor, seed: int | None,
                    num_steps: int, guidance_scale: float, sway_coefficient: float | None) -> torch.Tensor:
        """Mel spectrogram [1, mel_dim, frames]: transformers' DiT `sample`, with seeded noise."""
        frames = codes.shape[1] * self.dit.repeats
        grid = self._time_grid(num_steps, sway_coefficient)

        # Drawn on CPU so that a seed means the same noise on every device.
        generator = torch.Generator(device="cpu").manual_seed(secrets.randbits(63) if seed is None else seed)
        x = torch.randn([1, frames, self.dit.mel_dim], generator=generator, dtype=ref_mel.dtype).to(self.device)
        speaker = cond.unsqueeze(1).repeat(1, frames, 1)

        def velocity(t: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
            if guidance_scale < 1e-5:
                return self.dit(hidden_states=state, speaker_embedding=speaker, condition_vector=ref_mel,
                                quantized_code=codes, time_step=t, drop_audio_conditioning=False,
                                drop_code=False, apply_cfg=False)
            # One batched pass: conditioned half, then the half with voice and codes dropped.
            both = self.dit(hidden_states=state, quantized_code=codes, speaker_embedding=speaker,
                            condition_vector=ref_mel, time_step=t, apply_cfg=True)
            guided, null = torch.chunk(both, 2, dim=0)
            return guided + (guided - null) * guidance_scale

        # RK4 "3/8 rule", operand order as in transformers so float32 rounding matches.
        for t0, t1 in zip(grid[:-1], grid[1:]):
            dt = t1 - t0
            k1 = velocity(t0, x)
            k2 = velocity(t0 + dt * _ONE_THIRD, x + dt * k1 * _ONE_THIRD)
            k3 = velocity(t0 + dt * _TWO_THIRDS, x + dt * (k2 - k1 * _ONE_THIRD))
            k4 = velocity(t1, x + dt * (k1 - k2 + k3))
            x = x + (k1 + 3 * (k2 + k3) + k4) * dt / 8
        return x.permute(0, 2, 1)
