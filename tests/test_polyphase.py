"""The polyphase 2x upsampler against transformers' BigVGAN UpSample1d, and token2wav with it."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniUpSample1d

from omni_server.models.polyphase import PolyphaseUpsample2x, use_polyphase_upsampling
from omni_server.models.qwen2_5_omni.token2wav import Token2Wav
from omni_server.models.tiny_checkpoints import TINY_OMNI


@pytest.mark.parametrize("length", [1, 2, 5, 64, 333])
def test_equals_the_transposed_convolution(length):
    up = Qwen2_5OmniUpSample1d(2, 12).double()
    poly = PolyphaseUpsample2x(up, 7)
    x = torch.randn(3, 7, length, dtype=torch.float64, generator=torch.Generator().manual_seed(length))
    want = up(x)
    got = poly(x)
    assert got.shape == want.shape == (3, 7, 2 * length)
    assert (got - want).abs().max().item() < 1e-12  # float64: the same sums in another order


def test_rejects_what_it_does_not_compute():
    with pytest.raises(ValueError, match="unsupported upsampler"):
        PolyphaseUpsample2x(Qwen2_5OmniUpSample1d(3, 12), 4)
    with pytest.raises(ValueError, match="unsupported upsampler"):
        PolyphaseUpsample2x(Qwen2_5OmniUpSample1d(2, 10), 4)  # crop 12: even, no tap shift


def test_token2wav_with_polyphase_upsampling_matches(tiny_models):
    model_dir = str(tiny_models[TINY_OMNI])
    plain = Token2Wav(model_dir)
    poly = Token2Wav(model_dir, polyphase_upsampling=True)
    ups = [m for m in poly.vocoder.modules() if isinstance(m, PolyphaseUpsample2x)]
    activations = [m for m in plain.vocoder.modules() if hasattr(m, "upsample")]
    assert len(ups) == len(activations) > 0  # every anti-aliased activation's upsampler
    assert all(u.weight is not None for u in ups)  # each knows its channels: one depthwise convolution
    assert use_polyphase_upsampling(poly.vocoder) == 0  # (nothing left to replace)
    codes = torch.randint(0, 8292, (40,), generator=torch.Generator().manual_seed(1))
    want = plain(codes, seed=3)
    got = poly(codes, seed=3)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-5


def test_compiled_once_for_repeated_calls():
    # The module keeps no state of its own calls: under torch.compile a second call of the same
    # shape reuses the first's code (a recompile there happened inside a CUDA graph capture on the
    # H200, where it cannot: the vocoder's graphs were lost, 2026-11-30f).
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    poly = PolyphaseUpsample2x(Qwen2_5OmniUpSample1d(2, 12), 5)
    step = torch.compile(poly, dynamic=True)
    x = torch.randn(2, 5, 50)
    first = step(x)
    compiled = counters["stats"]["unique_graphs"]
    again = step(x)
    assert counters["stats"]["unique_graphs"] == compiled
    assert torch.equal(first, again) and (first - poly(x)).abs().max().item() < 1e-5
