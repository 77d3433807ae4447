"""Qwen3-Omni-MoE code2wav generator on the tiny checkpoint, against transformers' own module.

Exactness is asserted in float64 (the generator's module converted after loading): there the only
rounding left is transformers' float32 RMSNorm / rotary internals, so a streamed decode that used too
little context, or spliced pieces at the wrong sample, would show (a too-short context differs by
~1). In float32 the tiny random model's activations reach ~20 and oneDNN's ConvTranspose1d rounds
differently for different lengths, so a window and the full sequence differ by float32 noise
(~1.5e-5 measured); the float32 checks allow that.
"""

from __future__ import annotations

import pytest
import torch

from omni_server.stage import generators

KEY = "tiny-qwen3-omni-moe"
Q = 16  # quantizers
EXACT = 1e-6  # float64
F32_NOISE = 5e-5


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return str(tiny_models[KEY])


@pytest.fixture(scope="module")
def gen(model_dir):
    return generators.load("qwen3_omni_moe.code2wav")(model_dir, "cpu", chunk_frames=8)


@pytest.fixture(scope="module")
def gen64(model_dir):
    g = generators.load("qwen3_omni_moe.code2wav")(model_dir, "cpu", chunk_frames=32)
    g.model.double()
    return g


@pytest.fixture(scope="module")
def hf_code2wav(model_dir):
    """transformers' module loaded its own way (from_pretrained of the whole model is too slow):
    the checkpoint's code2wav tensors by plain safetensors reading."""
    from safetensors.torch import load_file
    from transformers import AutoConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    config = AutoConfig.from_pretrained(model_dir).code2wav_config
    module = Qwen3OmniMoeCode2Wav._from_config(config, attn_implementation="sdpa")
    state = {k[len("code2wav."):]: v for k, v in load_file(f"{model_dir}/model.safetensors").items()
             if k.startswith("code2wav.")}
    module.load_state_dict(state, strict=True)
    return module.float().eval()


def _codes(frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2048, (Q, frames), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def _full(g, codes: torch.Tensor) -> torch.Tensor:
    return g.model(codes[None].to(torch.long))[0, 0]


def _stream(g, codes: torch.Tensor, cuts: list[int], final_alone: bool = False,
            spoil_consumed: bool = False) -> torch.Tensor:
    """Feed `codes` in pieces ending at `cuts` (then the end), stepping whenever ready.
    `spoil_consumed`: overwrite the frames the stream says it no longer reads (they must not matter)."""
    st = g.open_stream("ethan", seed=None)
    pieces = []
    ends = [c for c in cuts if c < codes.shape[1]] + [codes.shape[1]]
    for n, end in enumerate(ends):
        final = n == len(ends) - 1 and not final_alone
        fed = codes[:, :end].clone()
        if spoil_consumed:
            fed[:, :st.consumed] = 0
        st.feed(codes=fed, final=final)
        if end >= st.consumed + g.stream_lead:
            assert g.stream_ready(st), "a stream holding stream_lead frames past consumed must be ready"
        while g.stream_ready(st):
            (piece,) = g.stream_step([st])
            assert not isinstance(piece, Exception), piece
            assert piece.dtype == torch.float32 and piece.ndim == 1
            pieces.append(piece)
            assert st.consumed <= st.frames <= end
    if final_alone:
        st.feed(final=True)  # no new codes, just the end
        while g.stream_ready(st):
            (piece,) = g.stream_step([st])
            pieces.append(piece)
    assert st.done and not g.stream_ready(st)
    return torch.cat(pieces)


def test_registered_and_reports(gen, model_dir):
    assert generators.load("qwen3_omni_moe.code2wav").__name__ == "Code2Wav"
    assert gen.sample_rate == 24000
    # The api needs a non-empty voice list; the talker's speakers, transformers' default first.
    assert gen.voices == ["ethan", "aiden", "chelsie"]
    assert gen.num_samples(10) == 1920 * 10 - 555
    # docs/qwen3_omni.md: 2 sliding layers x 71 frames + the conv stack (~10 frames).
    assert 142 < gen.receptive_field <= 160
    assert gen.left_context_frames == gen.receptive_field
    assert gen.stream_lead == gen.receptive_field + 8


def test_full_decode_equals_transformers(gen, hf_code2wav):
    for frames, seed in ((1, 1), (37, 2)):
        codes = _codes(frames, seed)
        with torch.inference_mode():
            ref = hf_code2wav(codes[None])[0, 0]
        wave = gen.batch([{"codes": codes, "voice": None, "seed": None}])[0]
        assert wave.dtype == torch.float32 and wave.shape == (1920 * frames - 555,)
        assert (wave - ref).abs().max() <= 1e-5
    # [16, 0]: nothing to say, no samples
    assert gen.batch([{"codes": torch.zeros(Q, 0, dtype=torch.long)}])[0].numel() == 0


def test_batch_of_lengths_equals_each_alone(gen64):
    codes = [_codes(n, 10 + n) for n in (30, 5, 1, 17)]
    together = gen64.batch([{"codes": c, "voice": v} for c, v in zip(codes, ["ethan", "aiden", None, "x"])])
    for c, wave in zip(codes, together):
        alone = gen64.batch([{"codes": c}])[0]
        assert wave.shape == alone.shape == (1920 * c.shape[1] - 555,)
        assert (wave - alone).abs().max() <= EXACT


def test_stream_beyond_receptive_field_equals_full(gen64):
    # Long enough that later windows drop their oldest frames (receptive field < 165 - 32).
    codes = _codes(165, 7)
    full = _full(gen64, codes)
    streamed = _stream(gen64, codes, cuts=[40, 41, 100, 150])
    assert streamed.shape == full.shape
    assert (streamed - full).abs().max() <= EXACT


@pytest.mark.parametrize("cuts,final_alone", [
    ([], False),  # everything at once
    (list(range(1, 40)), False),  # one code frame at a time
    ([3, 8, 9, 25], True),  # uneven pieces, the end announced separately
])
def test_stream_arrival_patterns_equal_full(gen, cuts, final_alone):
    codes = _codes(40, 3)
    full = _full(gen, codes)
    streamed = _stream(gen, codes, cuts, final_alone)
    assert streamed.shape == full.shape
    assert (streamed - full).abs().max() <= F32_NOISE
    # Which windows run depends only on the codes: every arrival pattern gives the same bits.
    assert torch.equal(streamed, _stream(gen, codes, []))


def test_small_first_windows_start_audio_early_and_equal_full(model_dir):
    """`first_chunk_frames` [2, 3]: the first audio after 2 frames, windows ending at 2, 5, then
    every 8; the stream is still the full decode, whatever the arrival pattern, and beyond the
    receptive field too."""
    g = generators.load("qwen3_omni_moe.code2wav")(model_dir, "cpu", chunk_frames=8, first_chunk_frames=[2, 3])
    g.model.double()
    codes = _codes(180, 11)
    st = g.open_stream(None, None)
    st.feed(codes=codes[:, :1], final=False)
    assert not g.stream_ready(st)
    st.feed(codes=codes[:, :2], final=False)
    (piece,) = g.stream_step([st])
    assert st.frames == 2 and piece.numel() == 1920 * 2 - 555
    ends = []
    st.feed(codes=codes[:, :29], final=False)
    while g.stream_ready(st):
        g.stream_step([st])
        ends.append(st.frames)
    assert ends == [5, 13, 21, 29]
    full = _full(g, codes)
    for cuts in ([], list(range(1, 180, 7)), [2, 4, 5, 100]):
        streamed = _stream(g, codes, cuts)
        assert streamed.shape == full.shape
        assert (streamed - full).abs().max() <= EXACT
    assert g.stream_lead == g.left_context_frames + 8
    assert generators.load("qwen3_omni_moe.code2wav")(model_dir, "cpu", chunk_frames=4, first_chunk_frames=6).stream_lead \
        == g.left_context_frames + 6


def test_stream_one_frame_windows_and_consumed(model_dir):
    g = generators.load("qwen3_omni_moe.code2wav")(model_dir, chunk_frames=1)
    g.model.double()
    codes = _codes(12, 5)
    full = _full(g, codes)
    # Frames below `consumed` are never read again: spoiling them changes nothing.
    streamed = _stream(g, codes, list(range(1, 12)), spoil_consumed=True)
    assert (streamed - full).abs().max() <= EXACT


def test_streams_stepped_together(gen64):
    a, b = _codes(20, 8), _codes(9, 9)
    sa, sb = gen64.open_stream(None, None), gen64.open_stream("nobody-in-particular", 3)
    sa.feed(codes=a, final=True)
    sb.feed(codes=b[:, :4], final=False)
    assert gen64.stream_ready(sa) and not gen64.stream_ready(sb)  # 4 < chunk_frames
    pieces_a = []
    pa, pb = gen64.stream_step([sa, sb])
    pieces_a.append(pa)
    assert pb.numel() == 0 and not sb.done
    sb.feed(codes=b, final=True)
    out_b = []
    while not (sa.done and sb.done):
        pa, pb = gen64.stream_step([sa, sb])
        pieces_a.append(pa)
        out_b.append(pb)
    assert (torch.cat(pieces_a) - _full(gen64, a)).abs().max() <= EXACT
    assert (torch.cat(out_b) - _full(gen64, b)).abs().max() <= EXACT


@pytest.mark.parametrize("codes,match", [
    (torch.zeros(8, 5, dtype=torch.long), r"shape \[16, T\]"),
    (torch.zeros(5, 16, dtype=torch.long), r"shape \[16, T\]"),
    (torch.zeros(16, dtype=torch.long), r"shape \[16, T\]"),
    (torch.zeros(1, 16, 5, dtype=torch.long), r"shape \[16, T\]"),
    (torch.full((16, 5), 2048), r"\[0, 2047\]"),
    (torch.full((16, 5), -1), r"\[0, 2047\]"),
    (torch.zeros(16, 5), "integer"),
    (None, r"shape \[16, T\]"),
    ("abc", "integer"),
])
def test_bad_codes(gen, codes, match):
    good = _codes(3, 4)
    bad, ok = gen.batch([{"codes": codes}, {"codes": good}])
    assert isinstance(bad, ValueError)
    assert bad.args and __import__("re").search(match, str(bad)), str(bad)
    assert isinstance(ok, torch.Tensor) and ok.numel() == 1920 * 3 - 555  # the others still decode
    if codes is None:  # to a stream, no codes means no new codes (test_stream_ended_without_codes)
        return
    st = gen.open_stream(None, None)
    st.feed(codes=codes, final=True)
    assert gen.stream_ready(st)
    (err,) = gen.stream_step([st])
    assert isinstance(err, ValueError) and st.done and not gen.stream_ready(st)


def test_too_many_frames(gen):
    (err,) = gen.batch([{"codes": torch.zeros(Q, gen.max_frames + 1, dtype=torch.long)}])
    assert isinstance(err, ValueError) and "limit" in str(err)


def test_shrinking_stream_is_an_error(gen):
    st = gen.open_stream(None, None)
    st.feed(codes=_codes(10, 1), final=False)
    (piece,) = gen.stream_step([st])
    assert piece.numel() == 1920 * 8 - 555
    st.feed(codes=_codes(3, 1), final=True)
    (err,) = gen.stream_step([st])
    assert isinstance(err, ValueError) and st.done


@pytest.mark.parametrize("kwargs,match", [
    ({"chunk_frames": 0}, "chunk_frames"),
    ({"chunk_frames": -3}, "chunk_frames"),
    ({"chunk_frames": 2.5}, "chunk_frames"),
    ({"chunk_frames": True}, "chunk_frames"),
    ({"first_chunk_frames": [4, 0]}, "first_chunk_frames"),
    ({"first_chunk_frames": 2.0}, "first_chunk_frames"),
    ({"first_chunk_frames": "4"}, "first_chunk_frames"),
    ({"left_context_frames": 25}, "receptive field"),  # transformers' chunked_decode default: not exact
    ({"left_context_frames": 100.0}, "receptive field"),
])
def test_bad_constructor_args(model_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        generators.load("qwen3_omni_moe.code2wav")(model_dir, "cpu", **kwargs)


def test_larger_left_context_accepted(model_dir, gen):
    g = generators.load("qwen3_omni_moe.code2wav")(model_dir, "cpu", chunk_frames=4,
                                                    left_context_frames=gen.receptive_field + 10)
    assert g.left_context_frames == gen.receptive_field + 10 and g.stream_lead == g.left_context_frames + 4


def test_stream_ended_without_codes(gen):
    st = gen.open_stream(None, None)
    assert not gen.stream_ready(st)
    st.feed(final=True)
    (piece,) = gen.stream_step([st])
    assert isinstance(piece, torch.Tensor) and piece.numel() == 0 and st.done
