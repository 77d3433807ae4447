"""BigVGAN's anti-aliased Snake activation as one expression (omni_server/models/antialias.py)
against transformers' module, in the tiny vocoder, and compiled once for every activation; and as
Triton kernels (antialias_triton.py), run on the CPU by Triton's interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniAntiAliasedActivation1d,
    Qwen2_5OmniDownSample1d,
    Qwen2_5OmniSnakeBeta,
)

from omni_server.models.antialias import AntiAliasedSnake, use_fused_activations
from omni_server.models.polyphase import use_polyphase_upsampling
from omni_server.models.qwen2_5_omni.token2wav import Token2Wav
from omni_server.models.tiny_checkpoints import TINY_OMNI
from tests.conftest import REPO


def _activation(channels: int, seed: int) -> torch.nn.Module:
    act = Qwen2_5OmniAntiAliasedActivation1d(Qwen2_5OmniSnakeBeta(channels)).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # (a checkpoint's values: log-scale, around 0)
        act.act.alpha.copy_(torch.randn(channels, generator=g, dtype=torch.float64) * 0.5)
        act.act.beta.copy_(torch.randn(channels, generator=g, dtype=torch.float64) * 0.5)
    return act


@pytest.mark.parametrize("length", [1, 2, 5, 64, 333])
@pytest.mark.parametrize("polyphase", [False, True])
def test_equals_transformers_activation(length, polyphase):
    act = _activation(7, length)
    if polyphase:  # (built from the polyphase upsampler as well as from transformers')
        assert use_polyphase_upsampling(act) == 1
    fused = AntiAliasedSnake(act, 7)
    x = torch.randn(3, 7, length, dtype=torch.float64, generator=torch.Generator().manual_seed(100 + length)) * 2
    want, got = act(x), fused(x)
    assert got.shape == want.shape == (3, 7, length)
    assert (got - want).abs().max().item() < 1e-12  # float64: the same sums in another order


def test_rejects_what_it_does_not_compute():
    act = _activation(4, 0)
    act.act = torch.nn.SiLU()
    with pytest.raises(ValueError, match="not a SnakeBeta activation"):
        AntiAliasedSnake(act, 4)
    act = _activation(4, 0)
    act.downsample = Qwen2_5OmniDownSample1d(3, 12)
    with pytest.raises(ValueError, match="unsupported downsampler"):
        AntiAliasedSnake(act, 4)
    act = _activation(4, 0)
    act.downsample.pad_right += 1  # (it would make n + 1 samples out of 2n)
    with pytest.raises(ValueError, match="unsupported downsampler padding"):
        AntiAliasedSnake(act, 4)


def test_tiny_vocoder_with_fused_activations_matches(tiny_models):
    """Every activation of the tiny vocoder replaced (the final one too), one function shared by
    all, and the waveform unchanged but for float32 rounding."""
    t2w = Token2Wav(str(tiny_models[TINY_OMNI]), polyphase_upsampling=True)
    mel = torch.randn(1, t2w.dit.mel_dim, 6, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = t2w._vocoder_body(mel)
    before = [m for m in t2w.vocoder.modules() if hasattr(m, "downsample")]
    made = []
    assert use_fused_activations(t2w.vocoder, wrap=lambda fn: made.append(fn) or fn) == len(before) > 1
    assert len(made) == 1  # (their filters are the same: one function, one compile)
    assert not [m for m in t2w.vocoder.modules() if hasattr(m, "downsample")]
    assert use_fused_activations(t2w.vocoder) == 0  # (nothing left to replace)
    with torch.inference_mode():
        got = t2w._vocoder_body(mel)
    assert got.shape == want.shape and (got - want).abs().max().item() < 1e-5


def test_one_compile_per_batch_kind_serves_every_activation(tiny_models):
    """Compiled with dynamic shapes, the shared function traces once per kind of batch and channel
    count (1 or more: Dynamo specialises a size of 1; the tiny vocoder's last activation has one
    channel, the 7B's 24) and never again for other sizes or lengths: what the warm-up compiles is
    all that is ever compiled."""
    t2w = Token2Wav(str(tiny_models[TINY_OMNI]), polyphase_upsampling=True)
    traced = []

    def backend(gm, example_inputs):
        traced.append(gm)
        return gm.forward

    use_fused_activations(t2w.vocoder, wrap=lambda fn: torch.compile(fn, dynamic=True, backend=backend))
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    batches = ((1, 20), (2, 20), (4, 31), (1, 57), (3, 9), (2, 64))
    with torch.inference_mode():
        for rows, frames in batches:
            t2w._vocoder_body(torch.randn(rows, t2w.dit.mel_dim, frames, generator=g))
    channels = {m.alpha.shape[0] for m in t2w.vocoder.modules() if isinstance(m, AntiAliasedSnake)}
    assert len(channels) > 2 and len(traced) == len({(rows == 1, c == 1) for rows, _ in batches for c in channels})


def test_token2wav_checks_compile_vocoder(tiny_models):
    with pytest.raises(ValueError, match="compile_vocoder must be true, false, \"activations\" or \"triton\""):
        Token2Wav(str(tiny_models[TINY_OMNI]), compile_vocoder="snake")
    with pytest.raises(ValueError, match="\"activations\" needs CUDA graphs captured at start"):
        Token2Wav(str(tiny_models[TINY_OMNI]), compile_vocoder="activations")  # (CPU: no graphs)


# Run in a child process: TRITON_INTERPRET must be set before the kernels are defined, and it runs
# them on the CPU (numpy), one program at a time.
_TRITON_CHECK = """
import sys, torch
from tests.test_antialias import _activation
from omni_server.models.antialias import AntiAliasedSnake, use_fused_activations
from omni_server.models.antialias_triton import triton_antialiased_snake
from omni_server.models.polyphase import use_polyphase_upsampling
from omni_server.models.qwen2_5_omni.token2wav import Token2Wav
worst = 0.0
for polyphase in (False, True):
    for length in (1, 2, 5, 64, 333, 1100):  # (1100: rows of two blocks of 1024)
        act = _activation(7, length).float()
        if polyphase:
            use_polyphase_upsampling(act)
        fused = AntiAliasedSnake(act, 7, make=triton_antialiased_snake)
        x = torch.randn(3, 7, length, generator=torch.Generator().manual_seed(100 + length)) * 2
        want, got = act(x), fused(x)
        assert got.shape == want.shape == (3, 7, length) and got.dtype == torch.float32
        worst = max(worst, (got - want).abs().max().item())
assert worst < 2e-5, worst
t2w = Token2Wav(sys.argv[1], polyphase_upsampling=True)
mel = torch.randn(1, t2w.dit.mel_dim, 6, generator=torch.Generator().manual_seed(0))
with torch.inference_mode():
    want = t2w._vocoder_body(mel)
    assert use_fused_activations(t2w.vocoder, make=triton_antialiased_snake) > 1
    got = t2w._vocoder_body(mel)
assert got.shape == want.shape and (got - want).abs().max().item() < 1e-5
print("ok", worst)
"""


def test_triton_kernels_equal_transformers_activation(tiny_models):
    """The Triton activation against transformers' module (float32; lengths that are shorter than
    the filters, so both ends' replicate paddings meet) and in the tiny vocoder, every activation
    replaced: the waveform unchanged but for float32 rounding."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", _TRITON_CHECK, str(tiny_models[TINY_OMNI])], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stderr[-3000:]


def test_triton_kernels_build_for_the_h200_on_any_host(tmp_path, monkeypatch):
    """Triton's interpreter (above) runs the kernels' Python, not their compile: build them for
    sm_90 (PTX and cubin; no GPU needed) with the 7B vocoder's filter sizes, so an error only the
    GPU compiler sees shows here too."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from omni_server.models import antialias_triton as at

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    act = AntiAliasedSnake(_activation(4, 0), 4, make=lambda *filters: filters)
    up, down, up_pad, up_offset, down_left, _ = act.fn
    target, ptr = GPUTarget("cuda", 90, 32), "*fp32"
    phases = ASTSource(fn=at._phases, signature=dict.fromkeys(["x_ptr", "alpha_ptr", "inv_beta_ptr", "even_ptr",
                                                              "odd_ptr", "out_ptr"], ptr)
                       | dict.fromkeys(["n", "length", "channels"], "i32")
                       | dict.fromkeys(["UP_TAPS", "UP_SHIFT", "LEAD", "BLOCK"], "constexpr"),
                       constexprs={"UP_TAPS": len(up[0]), "UP_SHIFT": up_offset - up_pad, "LEAD": down_left,
                                   "BLOCK": at.BLOCK})
    down_k = ASTSource(fn=at._down, signature=dict.fromkeys(["p_ptr", "down_ptr", "out_ptr"], ptr)
                       | dict.fromkeys(["n", "length"], "i32") | dict.fromkeys(["DOWN_TAPS", "BLOCK"], "constexpr"),
                       constexprs={"DOWN_TAPS": len(down), "BLOCK": at.BLOCK})
    for src, pointers in ((phases, 6), (down_k, 3)):
        # (as launched: the tensors' addresses 16-byte aligned, which Triton specialises on)
        src.attrs = {(i,): [["tt.divisibility", 16]] for i in range(pointers)}
        kernel = compile(src, target=target)
        assert kernel.asm["cubin"] and "st.global" in kernel.asm["ptx"]


def test_triton_activation_checks_its_inputs():
    from omni_server.models.antialias_triton import triton_antialiased_snake

    with pytest.raises(ValueError, match="unsupported downsampler padding"):
        triton_antialiased_snake(((1.0,), (1.0,)), (0.5, 0.5), 0, 0, 1, 1)
    with pytest.raises(ValueError, match="phases differ in length"):
        triton_antialiased_snake(((1.0,), (1.0, 0.0)), (0.5, 0.5), 0, 0, 1, 0)
    fn = triton_antialiased_snake(((1.0,), (1.0,)), (0.5, 0.5), 0, 0, 1, 0)
    with pytest.raises(ValueError, match="computes in float32"):
        fn(torch.zeros(1, 1, 4, dtype=torch.float64), torch.ones(1, 1), torch.ones(1, 1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton kernels need a GPU")
def test_token2wav_with_triton_activations_on_cuda(tiny_models):
    """compile_vocoder "triton" as served (graphs captured at start): every window's vocoder graph
    replays the kernels, and the audio equals the plain vocoder's to float32 rounding."""
    model = str(tiny_models[TINY_OMNI])
    fast = Token2Wav(model, device="cuda", polyphase_upsampling=True, compile_vocoder="triton", warmup_graphs=True,
                     max_graph_batch=2)
    plain = Token2Wav(model, device="cuda", polyphase_upsampling=True, compile_vocoder=False)
    assert any(isinstance(m, AntiAliasedSnake) for m in fast.vocoder.modules())
    captured = len(fast.vocoder_graphs.graphs)
    assert captured and not fast.vocoder_graphs.failed  # (a failed capture falls back to eager)
    codes = torch.randint(0, 100, (90,), generator=torch.Generator().manual_seed(3))
    a, b = fast.stream_all(codes, seed=4), plain.stream_all(codes, seed=4)
    assert a.shape == b.shape and (a - b).abs().max().item() < 1e-4
    assert len(fast.vocoder_graphs.graphs) == captured and not fast.vocoder_graphs.failed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton kernels need a GPU")
def test_triton_activation_refuses_a_first_call_inside_a_capture():
    # (its filters go to the device on the first call: a copy a CUDA graph capture cannot hold)
    from omni_server.models.antialias_triton import triton_antialiased_snake

    fn = triton_antialiased_snake(((1.0,), (1.0,)), (0.5, 0.5), 0, 0, 1, 0)
    x, ones = torch.zeros(1, 1, 8, device="cuda"), torch.ones(1, 1, device="cuda")
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            fn(x, ones, ones)
