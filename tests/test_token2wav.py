"""Token2Wav against transformers' Qwen2.5-Omni token2wav, on the tiny checkpoint, CPU float32."""

from __future__ import annotations

import logging

import pytest
import torch

from omni_server.models.antialias import AntiAliasedSnake
from omni_server.models.qwen2_5_omni.dit import BACKENDS, block_masks, run_layer, windows
from omni_server.models.qwen2_5_omni.token2wav import Token2Wav
from omni_server.models.tiny_checkpoints import TINY_OMNI

VOICES = ["Chelsie", "Ethan"]
# Ordinary codec ids, below the talker's special ids (8292 pad .. 8296 mask), as a talker emits them.
CODES = torch.randint(0, 8292, (32,), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def model_dir(tiny_models) -> str:
    return str(tiny_models[TINY_OMNI])


@pytest.fixture(scope="module")
def t2w(model_dir) -> Token2Wav:
    return Token2Wav(model_dir)


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import Qwen2_5OmniForConditionalGeneration

    return Qwen2_5OmniForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference_wav(reference, codes: torch.Tensor, voice: str, seed: int, **kwargs) -> torch.Tensor:
    """What `generate()` does for one sample once the talker is done, with the global RNG seeded."""
    speaker = reference.speaker_map[voice]
    torch.manual_seed(seed)
    with torch.no_grad():
        wav = reference.token2wav(codes[None], conditioning=speaker["cond"].float().expand(1, -1),
                                  reference_mel=speaker["ref_mel"].float().expand(1, -1, -1), **kwargs)
    return wav.reshape(-1).float()


@pytest.mark.parametrize("voice", VOICES)
def test_matches_transformers(t2w, reference, voice):
    ref = reference_wav(reference, CODES, voice, seed=7)
    out = t2w(CODES, voice, seed=7)
    assert out.dtype == torch.float32 and out.device.type == "cpu" and out.ndim == 1
    assert out.shape == ref.shape
    assert ref.abs().max() > 0  # a silent reference would make the comparison vacuous
    assert (out - ref).abs().max().item() < 1e-3


def test_matches_transformers_without_guidance_or_sway(t2w, reference):
    settings = dict(num_steps=4, guidance_scale=0.0, sway_coefficient=None)
    ref = reference_wav(reference, CODES[:20], "Ethan", seed=3, **settings)
    out = t2w(CODES[:20], "Ethan", seed=3, **settings)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() < 1e-3


@pytest.mark.parametrize("guidance_scale", [0.5, 0.0])
def test_batch_equals_each_alone(t2w, guidance_scale):
    """Different lengths and voices in one DiT pass: padding is never attended, so each result is
    the request decoded alone; a bad request fails alone."""
    requests = [{"codes": CODES[:12], "voice": "Ethan", "seed": 1}, {"codes": CODES, "voice": "Chelsie", "seed": 2},
                {"codes": CODES[:5], "voice": "Nobody", "seed": 3}, {"codes": CODES[:0], "voice": None, "seed": 4},
                {"codes": CODES[3:25], "voice": None, "seed": 5}]
    out = t2w.batch(requests, guidance_scale=guidance_scale)
    assert isinstance(out[2], ValueError) and "Nobody" in str(out[2])
    assert out[3].numel() == 0
    for i in (0, 1, 4):
        alone = t2w(**requests[i], guidance_scale=guidance_scale)
        assert out[i].shape == alone.shape and alone.abs().max() > 0
        assert (out[i] - alone).abs().max().item() < 1e-4


def test_seed_decides_output(t2w):
    a = t2w(CODES, "Chelsie", seed=11)
    assert torch.equal(a, t2w(CODES, "Chelsie", seed=11))
    assert not torch.equal(a, t2w(CODES, "Chelsie", seed=12))
    assert not torch.equal(t2w(CODES, "Chelsie"), t2w(CODES, "Chelsie"))  # no seed: fresh noise


def test_leaves_global_rng_alone(t2w):
    before = torch.get_rng_state()
    t2w(CODES[:20], "Ethan", seed=5)
    t2w(CODES[:20], "Ethan")
    assert torch.equal(torch.get_rng_state(), before)


def test_batch_of_one_accepted(t2w):
    assert torch.equal(t2w(CODES[None, :20], "Ethan", seed=1), t2w(CODES[:20], "Ethan", seed=1))


def test_unknown_voice(t2w):
    assert t2w.voices == VOICES
    with pytest.raises(ValueError, match="Chelsie, Ethan"):
        t2w(CODES, "Nobody", seed=0)


def test_empty_codes(t2w):
    out = t2w(torch.zeros(0, dtype=torch.long), "Ethan", seed=0)
    assert out.shape == (0,) and out.dtype == torch.float32


def test_limits(t2w):
    assert t2w.sample_rate == 24000
    with pytest.raises(ValueError, match=str(t2w.max_codes)):
        t2w(torch.zeros(t2w.max_codes + 1, dtype=torch.long), "Ethan", seed=0)
    with pytest.raises(ValueError, match="codec ids"):
        t2w(torch.tensor([1, 2, 100_000]), "Ethan", seed=0)


def test_sharded_checkpoint_reads_only_needed_shards(model_dir, tmp_path):
    import json

    from safetensors.torch import load_file, save_file

    from omni_server.models.checkpoint import load_tensors

    full = load_file(f"{model_dir}/model.safetensors")
    shards = {"a.safetensors": {k: v for k, v in full.items() if not k.startswith("token2wav.")},
              "b.safetensors": {k: v for k, v in full.items() if k.startswith("token2wav.")}}
    for name, tensors in shards.items():
        save_file(tensors, tmp_path / name)
    weight_map = {k: name for name, tensors in shards.items() for k in tensors}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "a.safetensors").write_bytes(b"not read")  # would fail if opened

    sharded = load_tensors(str(tmp_path), "token2wav.")
    single = load_tensors(model_dir, "token2wav.")
    assert sharded.keys() == single.keys() and len(single) > 0
    assert all(torch.equal(sharded[k], single[k]) for k in single)


def test_missing_speakers_file(tmp_path):
    from omni_server.models.qwen2_5_omni.speakers import load_speakers

    with pytest.raises(FileNotFoundError, match="spk_dict.pt"):
        load_speakers(str(tmp_path))


# ---- streaming ---------------------------------------------------------------------------------

LONG = torch.randint(0, 8292, (150,), generator=torch.Generator().manual_seed(1))


def _feed_in_pieces(t2w, codes: torch.Tensor, sizes: list[int], seed: int, batch_with=None):
    """Feed `codes` in pieces of `sizes` (cycled), stepping whenever the stream is ready; returns
    the pieces of audio and how many came before the last code arrived."""
    st, other = t2w.open_stream("Ethan", seed), None
    if batch_with is not None:
        other = t2w.open_stream("Chelsie", 99)
        other.feed(codes=batch_with, final=True)
    pieces, early, k, i = [], 0, 0, 0
    while not st.done:
        if k < codes.numel():
            k = min(codes.numel(), k + sizes[i % len(sizes)])
            i += 1
            st.feed(codes=codes[:k], final=k == codes.numel())
        if t2w.stream_ready(st):
            streams = [st] + ([other] if other is not None and t2w.stream_ready(other) else [])
            piece = t2w.stream_step(streams)[0]
            pieces.append(piece)
            early += piece.numel() if k < codes.numel() else 0
    return pieces, early


@pytest.mark.parametrize("sizes", [[1], [7, 1, 30], [150]])
def test_stream_is_independent_of_arrival(t2w, sizes):
    # Which DiT windows run depends only on the codes: any arrival pattern gives the same samples.
    whole = t2w.stream_all(LONG, "Ethan", seed=5)
    pieces, early = _feed_in_pieces(t2w, LONG, sizes, seed=5)
    assert torch.equal(torch.cat(pieces), whole)
    assert whole.numel() == LONG.numel() * 2 * t2w.hop
    if sizes == [1]:
        assert early > 0  # audio left before the last code arrived


def test_stream_close_to_full_decode(t2w):
    # Windows see a bounded context, so a long stream differs from the one-window decode, but only
    # slightly (the tiny DiT's blocks barely interact); short ones are the same window.
    full, streamed = t2w(LONG, "Ethan", seed=5), t2w.stream_all(LONG, "Ethan", seed=5)
    assert full.abs().max() > 0
    assert (full - streamed).abs().max().item() < 1e-4
    short = LONG[:(t2w.first_chunk_frames + t2w.future_frames) // 2]
    assert (t2w(short, "Ethan", seed=5) - t2w.stream_all(short, "Ethan", seed=5)).abs().max().item() < 1e-5


@pytest.fixture(scope="module")
def t2w_small_first(model_dir) -> Token2Wav:
    return Token2Wav(model_dir, first_chunk_frames=24)


@pytest.mark.parametrize("which", ["t2w", "t2w_small_first"])
def test_stream_first_audio_needs_one_window(request, which):
    t2w = request.getfixturevalue(which)
    st = t2w.open_stream(None, 1)
    need = (t2w.first_chunk_frames + t2w.future_frames) // 2
    st.feed(codes=LONG[:need - 1], final=False)
    assert not t2w.stream_ready(st)
    st.feed(codes=LONG[:need], final=False)
    assert t2w.stream_ready(st)
    piece = t2w.stream_step([st])[0]
    # The window settles first_chunk_frames; the vocoder holds back its right context.
    assert piece.numel() == (t2w.first_chunk_frames - t2w.vocoder_context_frames) * t2w.hop
    assert not st.done
    # The next window waits for a whole chunk (plus look-ahead) beyond the first.
    st.feed(codes=LONG[:need + t2w.chunk_frames // 2 - 1], final=False)
    assert not t2w.stream_ready(st)


@pytest.fixture(scope="module")
def t2w_growing(model_dir) -> Token2Wav:
    return Token2Wav(model_dir, first_chunk_frames=[24, 48])


@pytest.mark.parametrize("which", ["t2w_small_first", "t2w_growing"])
def test_small_first_windows_keep_streams_arrival_independent(request, which):
    t2w = request.getfixturevalue(which)
    whole = t2w.stream_all(LONG, "Ethan", seed=5)
    pieces, early = _feed_in_pieces(t2w, LONG, [3], seed=5)
    assert torch.equal(torch.cat(pieces), whole) and early > 0
    assert whole.numel() == LONG.numel() * 2 * t2w.hop


def test_growing_windows_follow_their_list(t2w_growing):
    """first_chunk_frames [24, 48]: windows of 24, 48, then chunk_frames new frames, each run as soon
    as its frames + look-ahead are here; the audio equals one whole decode (the tiny DiT's blocks
    barely interact: the windows' bounded context changes little)."""
    t2w, repeats = t2w_growing, 2
    st = t2w.open_stream("Ethan", 5)
    settled, have = [], 0
    while not st.done:
        if not t2w.stream_ready(st):
            have += 1
            st.feed(codes=LONG[:have], final=have == LONG.numel())
            continue
        before = st.settled
        t2w.stream_step([st])
        if st.settled > before:
            settled.append((st.settled - before, have))
    sizes = [n for n, _ in settled]
    # (The last window takes every frame left: less than a window + its look-ahead.)
    assert sizes[:3] == [24, 48, 72] and sizes[-1] < 72 + 24 and sum(sizes) == LONG.numel() * repeats
    # Each window ran once its new frames and the 24 look-ahead frames were fed, not later.
    done = 0
    for size, fed in settled[:-1]:
        done += size
        assert fed == (done + t2w.future_frames) // repeats
    full = t2w(LONG, "Ethan", seed=5)
    assert (full - t2w.stream_all(LONG, "Ethan", seed=5)).abs().max().item() < 1e-4


def test_streams_batched_equal_each_alone(t2w):
    alone, _ = _feed_in_pieces(t2w, LONG, [5], seed=2)
    batched, _ = _feed_in_pieces(t2w, LONG, [5], seed=2, batch_with=LONG[:90])
    assert (torch.cat(alone) - torch.cat(batched)).abs().max().item() < 1e-5


def test_stream_errors(t2w):
    with pytest.raises(ValueError, match="unknown voice"):
        t2w.open_stream("Nobody", 0)
    st = t2w.open_stream(None, 0)
    st.feed(codes=torch.tensor([1, 2, 10**6]), final=True)
    (out,) = t2w.stream_step([st])
    assert isinstance(out, ValueError) and st.done
    empty = t2w.open_stream(None, 0)
    empty.feed(codes=torch.zeros(0, dtype=torch.long), final=True)
    (out,) = t2w.stream_step([empty])
    assert out.numel() == 0 and empty.done


# ---- dit_past_cache: a stream keeps its look-back layers' keys and values between windows -------

@pytest.fixture(scope="module")
def t2w_past(model_dir) -> Token2Wav:
    return Token2Wav(model_dir, dit_past_cache=True)


def test_past_cache_windows_start_at_their_first_new_frame(t2w_past, monkeypatch):
    # No past frames in any window: each is its new frames and the future block (72 + 24), and
    # together they settle every frame once.
    assert t2w_past.frame_buckets == [96] and t2w_past.stream_lead == 48
    seen = []
    solve = t2w_past._sample_mels
    monkeypatch.setattr(t2w_past, "_sample_mels", lambda codes, *a, past=None, **k: seen.append(
        (codes[0].numel() * 2, past.starts[0], past.settles[0])) or solve(codes, *a, past=past, **k))
    t2w_past.stream_all(LONG, "Ethan", seed=5)
    assert [start for _, start, _ in seen] == [72 * i for i in range(len(seen))]
    assert all(frames == settles + 24 for frames, _, settles in seen[:-1]) and seen[-1][0] == seen[-1][2]
    assert sum(settles for *_, settles in seen) == LONG.numel() * 2


def test_past_cache_stream_close_to_full_decode(t2w_past, t2w):
    full, streamed = t2w_past(LONG, "Ethan", seed=5), t2w_past.stream_all(LONG, "Ethan", seed=5)
    assert torch.equal(full, t2w(LONG, "Ethan", seed=5))  # a whole decode has no past to keep
    assert full.abs().max() > 0 and (full - streamed).abs().max().item() < 1e-4
    # The past it kept stands in for the past the other mode solves again: nearly the same waveform.
    assert (streamed - t2w.stream_all(LONG, "Ethan", seed=5)).abs().max().item() < 1e-5
    short = LONG[:(t2w_past.first_chunk_frames + t2w_past.future_frames) // 2]
    assert (t2w_past(short, "Ethan", seed=5) - t2w_past.stream_all(short, "Ethan", seed=5)).abs().max().item() < 1e-5


@pytest.mark.parametrize("sizes", [[1], [7, 1, 30]])
def test_past_cache_stream_is_independent_of_arrival(t2w_past, sizes):
    whole = t2w_past.stream_all(LONG, "Ethan", seed=5)
    pieces, early = _feed_in_pieces(t2w_past, LONG, sizes, seed=5)
    assert torch.equal(torch.cat(pieces), whole) and early > 0


def test_past_cache_streams_batched_equal_each_alone(t2w_past):
    # Streams at different windows share a pass (one with its past, one without yet): each keeps its own.
    alone, _ = _feed_in_pieces(t2w_past, LONG, [5], seed=2)
    batched, _ = _feed_in_pieces(t2w_past, LONG, [5], seed=2, batch_with=LONG[40:130])
    assert (torch.cat(alone) - torch.cat(batched)).abs().max().item() < 1e-5


def test_past_cache_is_what_the_next_window_attends_to(t2w_past):
    """The kept keys and values: one block of the layers that look back, per evaluation and guidance
    half; the next window's audio depends on them (changed, it changes), and a done stream lets them go."""
    dit = t2w_past.dit
    heads, head_dim = dit.transformer_blocks[0].attn.heads, dit.transformer_blocks[0].attn.inner_dim // dit.transformer_blocks[0].attn.heads
    looking_back = sum(1 for behind, _ in windows(dit) if behind)

    def second_piece(change):
        st = t2w_past.open_stream("Ethan", 3)
        st.feed(codes=LONG, final=True)
        t2w_past.stream_step([st])
        assert st.past.shape == (36, looking_back, 2, 2, heads, dit.block_size, head_dim) and st.past_valid == 24
        change(st)
        return t2w_past.stream_step([st])[0]

    same, scaled = second_piece(lambda st: None), second_piece(lambda st: setattr(st, "past", st.past * 1.5))
    assert same.numel() == scaled.numel() > 0 and (same - scaled).abs().max().item() > 1e-6
    st = t2w_past.open_stream("Ethan", 3)
    st.feed(codes=LONG[:60], final=True)
    while not st.done:
        t2w_past.stream_step([st])
    assert st.past is None


def test_past_cache_says_past_frames_goes_unused(model_dir, caplog):
    with caplog.at_level(logging.WARNING):
        t = Token2Wav(model_dir, dit_past_cache=True, past_frames=24)
    assert "past_frames is not used with dit_past_cache" in caplog.text and t.frame_buckets == [96]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        Token2Wav(model_dir, dit_past_cache=True)
    assert "past_frames" not in caplog.text


def test_past_cache_keeps_a_streams_solver_settings(t2w_past):
    st = t2w_past.open_stream(None, 0)
    st.feed(codes=LONG, final=True)
    t2w_past.stream_step([st])
    (out,) = t2w_past.stream_step([st], num_steps=4)  # its past holds 36 evaluations, not 12
    assert isinstance(out, ValueError) and "changed" in str(out) and st.done and st.past is None


def test_past_cache_as_close_to_the_full_decode_as_solving_the_past_again(model_dir):
    """On a DiT whose blocks interact strongly (the tiny one's attention weights redrawn larger),
    streaming with the kept past strays from the one-window decode no more than streaming that
    solves the past frames again: the kept past is the one the stream itself decoded, from all
    of its history."""
    gen = torch.Generator().manual_seed(0)
    weights = {}
    plain, kept = Token2Wav(model_dir), Token2Wav(model_dir, dit_past_cache=True)
    for t in (plain, kept):
        for i, layer in enumerate(t.dit.transformer_blocks):
            for name, scale in (("to_q", 4), ("to_k", 4), ("to_v", 3)):
                lin = getattr(layer.attn, name)
                w = weights.setdefault((i, name), torch.randn(lin.weight.shape, generator=gen) * scale
                                       / lin.weight.shape[1] ** 0.5)
                with torch.no_grad():
                    lin.weight.copy_(w)
    codes = LONG[:120]
    full = plain(codes, "Ethan", seed=5)
    assert torch.equal(full, kept(codes, "Ethan", seed=5))
    err_plain = (plain.stream_all(codes, "Ethan", seed=5) - full).abs()
    err_kept = (kept.stream_all(codes, "Ethan", seed=5) - full).abs()
    assert err_plain.mean().item() > 1e-6  # (the windows do interact: the comparison means something)
    assert err_kept.mean().item() <= 1.1 * err_plain.mean().item()
    assert err_kept.max().item() <= 1.5 * err_plain.max().item()


@pytest.mark.parametrize("kwargs", [{"chunk_frames": 0}, {"chunk_frames": 50}, {"past_frames": 10},
                                    {"first_chunk_frames": 0}, {"first_chunk_frames": 30},
                                    {"first_chunk_frames": []}, {"first_chunk_frames": [24, 30]},
                                    {"first_chunk_frames": [24, 0]},
                                    {"future_frames": 3}, {"vocoder_context_frames": -1}])
def test_bad_stream_settings(model_dir, kwargs):
    with pytest.raises(ValueError):
        Token2Wav(model_dir, **kwargs)


def _window_inputs(t2w, lengths):
    gen = torch.Generator().manual_seed(sum(lengths))
    codes = [torch.randint(0, 8292, (n,), generator=gen) for n in lengths]
    noise = [torch.randn(n * t2w.dit.repeats, t2w.dit.mel_dim, generator=gen) for n in lengths]
    return codes, [VOICES[i % 2] for i in range(len(lengths))], noise


def test_graph_buckets_pad_without_changing_results(t2w):
    # CUDA graphs serve padded shapes (rows to a power of two, frames to the next window span); the
    # padding itself, exercised here on CPU, must not change any request's mel.
    from omni_server.models.qwen2_5_omni.token2wav import DiTGraphs

    assert t2w.frame_buckets == [96, 144]  # first window 72 + 24 future; then 48 past + 72 + 24
    assert DiTGraphs.bucket(3, 100, [96, 144]) == (4, 144) and DiTGraphs.bucket(1, 96, [96, 144]) == (1, 96)
    assert DiTGraphs.bucket(1, 145, [96, 144]) is None  # wider than any window: eager
    codes, voices, noise = _window_inputs(t2w, [50, 23, 37])  # 100, 46, 74 frames -> 4 rows x 144
    grid = t2w._time_grid(10, -1.0)
    plain = t2w._sample_mels(codes, voices, noise, grid, 0.5, pad=False)
    padded = t2w._sample_mels(codes, voices, noise, grid, 0.5, pad=True)
    assert [m.shape for m in padded] == [m.shape for m in plain] == [(1, t2w.dit.mel_dim, n * 2) for n in (50, 23, 37)]
    for a, b in zip(plain, padded):
        assert (a - b).abs().max().item() < 1e-4


def test_dit_graphs_warm_with_one_solver_step(t2w, monkeypatch):
    """The eager run before each DiT capture solves one step of the grid's nine: the same layers at
    the same shapes (so every kernel the capture records is warm) for a ninth of the work."""
    from omni_server.models.qwen2_5_omni.token2wav import DiTGraphs

    solve, seen, layers = t2w._rk4, [], []
    monkeypatch.setattr(t2w, "_rk4", lambda *args: seen.append(args) or solve(*args))
    codes, voices, noise = _window_inputs(t2w, [50, 23])
    t2w._sample_mels(codes, voices, noise, t2w._time_grid(10, -1.0), 0.5)
    ((*inputs, cfg, scale),) = seen
    body = t2w._dit_body
    monkeypatch.setattr(t2w, "_dit_body", lambda h, *a: layers.append(h.shape) or body(h, *a))
    with torch.inference_mode():
        solve(*inputs, cfg, scale)
        full = list(layers)
        layers.clear()
        DiTGraphs(solve, 4, 4, t2w.frame_buckets).warm_run(tuple(inputs), (cfg, scale))
    assert len(full) == 36 and layers == full[:4]  # 4 evaluations per RK4 step, each at the solve's shape


class _Replayed:
    """A stand-in for a captured CUDA graph (this host has none): `replay` runs the captured
    function on the capture's own input tensors and writes its output where the capture's was."""

    def __init__(self, fn, static, options, out):
        self.fn, self.static, self.options, self.out = fn, static, options, out
        self.replays = 0

    def replay(self):
        self.replays += 1
        got = self.fn(*self.static, *self.options)
        for dst, src in zip(*((self.out, got) if isinstance(got, tuple) else ((self.out,), (got,)))):
            dst.copy_(src)


def _replay_captures(graphs, monkeypatch) -> list[_Replayed]:
    """Make `graphs` "capture" `_Replayed` stand-ins (listed in the returned list) on this host."""
    captured = []

    def capture(inputs, options):
        static = tuple(t.clone() for t in inputs)
        out = graphs.fn(*static, *options)
        captured.append(_Replayed(graphs.fn, static, options, out))
        return captured[-1], static, out

    monkeypatch.setattr(graphs, "_capture", capture)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: None)  # (read before a capture)
    return captured


def test_step_graphs_replay_one_solver_step_per_step(t2w, monkeypatch):
    """`dit_graph: step`: one graph per shape holds one RK4 step and is replayed once per step of
    the grid, each replay fed the state the last one left (through the graph's own input tensors),
    so the solve equals the eager one exactly; a grid of another length replays the same graph."""
    from omni_server.models.qwen2_5_omni.token2wav import DiTStepGraphs

    graphs = DiTStepGraphs(t2w._graph_step(), t2w._solve_masks, 4, 4, t2w.frame_buckets)
    captured = _replay_captures(graphs, monkeypatch)
    codes, voices, noise = _window_inputs(t2w, [50, 23, 37])
    with torch.inference_mode():
        for steps in (10, 4):
            grid = t2w._time_grid(steps, -1.0)
            padded = t2w._sample_mels(codes, voices, noise, grid, 0.5, pad=True)  # the eager solve, bucketed
            t2w.graphs = graphs
            try:
                stepped = t2w._sample_mels(codes, voices, noise, grid, 0.5)
            finally:
                t2w.graphs = None
            assert all(torch.equal(a, b) for a, b in zip(padded, stepped))
    assert len(captured) == 1 and len(graphs.graphs) == 1  # one shape: one graph, for both grids
    assert captured[0].replays == 9 + 3


def test_past_cache_step_graphs_replay_with_each_streams_past(t2w_past, monkeypatch):
    """Under `dit_past_cache` a step graph also takes its step's evaluations of the windows' kept
    keys and values and gives back what they keep: replayed, it equals the eager solve exactly,
    mels and kept pasts; a whole decode (no past) is another graph."""
    from omni_server.models.qwen2_5_omni.token2wav import DiTStepGraphs, WindowPast

    graphs = DiTStepGraphs(t2w_past._graph_step(), t2w_past._solve_masks, 4, 4, t2w_past.frame_buckets)
    captured = _replay_captures(graphs, monkeypatch)
    dit, gen = t2w_past.dit, torch.Generator().manual_seed(4)
    attn = dit.transformer_blocks[0].attn
    shape = (36, 1, 2, 2, attn.heads, dit.block_size, attn.inner_dim // attn.heads)
    codes, voices, noise = _window_inputs(t2w_past, [48, 36, 20])  # 96, 72 and 40 frames: 4 rows x 96

    def windows_past():  # a stream's first window, and two later ones with 24 and 12 past frames
        return WindowPast(starts=[0, 72, 144], settles=[72, 48, 40],
                          caches=[None, torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)],
                          frames=[0, 24, 12])

    with torch.inference_mode():
        grid = t2w_past._time_grid(10, -1.0)
        state = gen.get_state()
        eager_past = windows_past()
        padded = t2w_past._sample_mels(codes, voices, noise, grid, 0.5, pad=True, past=eager_past)
        gen.set_state(state)
        graph_past = windows_past()
        t2w_past.graphs = graphs
        try:
            stepped = t2w_past._sample_mels(codes, voices, noise, grid, 0.5, past=graph_past)
            whole = t2w_past._sample_mels(codes[:1], voices[:1], noise[:1], grid, 0.5)
        finally:
            t2w_past.graphs = None
    assert all(torch.equal(a, b) for a, b in zip(padded, stepped))
    assert len(graph_past.kept) == 3 and all(torch.equal(a, b) for a, b in zip(eager_past.kept, graph_past.kept))
    assert all(k.shape == shape for k in graph_past.kept)
    assert torch.equal(whole[0], t2w_past._sample_mels(codes[:1], voices[:1], noise[:1], grid, 0.5)[0])
    assert len(captured) == 2 and captured[0].replays == 9
    assert sorted(k[3] for k in graphs.graphs) == ["", "past"]


def test_graph_inputs_keep_their_layout():
    """A capture's own copies of its inputs keep their strides: the DiT's masks (rows at aligned
    offsets for the attention kernels) stay aligned in the graphs; expanded views copy whole."""
    from omni_server.models.graphs import _same_layout
    from omni_server.models.qwen2_5_omni.dit import block_masks

    mask = block_masks(torch.randint(-3, 3, (2, 1, 30, 30)).float(), [(1, 0)], torch.float32)[0]
    copy = _same_layout(mask)
    assert copy.stride() == mask.stride() != mask.clone().stride() and torch.equal(copy, mask)
    assert torch.equal(_same_layout(torch.ones(3, 1).expand(3, 4)), torch.ones(3, 4))


def test_dit_graph_option(model_dir):
    with pytest.raises(ValueError, match="dit_graph"):
        Token2Wav(model_dir, dit_graph="layer")
    cpu = Token2Wav(model_dir, dit_graph="step")
    assert cpu.graphs is None  # (no CUDA graphs on a CPU)
    assert cpu.stream_batch_sizes is None  # (eager: every pass size unpadded)


@pytest.mark.parametrize("first, chunk, spans", [([48, 48], 72, [72, 120, 144]),
                                                 ([48, 48, 72, 96], 144, [72, 120, 144, 168, 216]),
                                                 (24, 72, [48, 120, 144])])
def test_every_regular_window_fills_its_graph_bucket(model_dir, first, chunk, spans, monkeypatch):
    """The DiT graphs' frame sizes are the stream's window spans: no window but a stream's last
    computes padding (those used to round up to whole 48-frame units: the first 72-frame window
    of the 7B config ran as 96)."""
    t2w = Token2Wav(model_dir, chunk_frames=chunk, first_chunk_frames=first, past_frames=48, future_frames=24)
    assert t2w.frame_buckets == spans and t2w.stream_lead == spans[-1] // 2
    seen = []
    solve = t2w._sample_mels
    monkeypatch.setattr(t2w, "_sample_mels", lambda codes, *a, **k: seen.append(codes[0].numel() * 2) or
                        solve(codes, *a, **k))
    t2w.stream_all(torch.randint(0, 8000, (400,), generator=torch.Generator().manual_seed(3)), seed=0)
    assert len(seen) > 5 and all(frames in spans for frames in seen[:-1]) and seen[-1] <= spans[-1]


def test_vocoder_batches_equal_lengths_exactly(t2w):
    gen = torch.Generator().manual_seed(3)
    mels = [torch.randn(1, t2w.dit.mel_dim, n, generator=gen) for n in (30, 30, 17)]
    plans = [(m, 5, 200) for m in mels] + [None]
    pieces = t2w._vocode(plans)
    assert pieces[3].numel() == 0
    for m, piece in zip(mels, pieces):
        alone = t2w.vocoder(m).reshape(-1)[5:205]
        assert piece.shape == (200,) and (piece - alone).abs().max().item() < 1e-5


def test_vocoder_body_is_transformers_forward(t2w):
    # What the vocoder's CUDA graphs capture: transformers' BigVGAN forward, op for op.
    mels = torch.randn(3, t2w.dit.mel_dim, 40, generator=torch.Generator().manual_seed(5))
    body = t2w._vocoder_body(mels)
    for i in range(3):
        alone = t2w.vocoder(mels[i:i + 1]).reshape(-1)
        assert torch.equal(t2w._vocoder_body(mels[i:i + 1])[0], alone)  # bit for bit
        assert (body[i] - alone).abs().max().item() < 1e-6  # batched: conv rounding only


@pytest.mark.parametrize("first", [72, 24, [24, 48], [48, 48], [24, 24, 48]])
def test_graph_warm_up_covers_the_vocoder_lengths_of_a_stream(model_dir, first, monkeypatch):
    # warmup_graphs captures the vocoder for these lengths only (others run eagerly): they must be
    # every length a long stream passes it but the last piece's.
    t2w = Token2Wav(model_dir, chunk_frames=72, first_chunk_frames=first, past_frames=48, future_frames=24,
                    vocoder_context_frames=20)
    seen = []
    vocode = t2w._vocoder_batch
    monkeypatch.setattr(t2w, "_vocoder_batch", lambda mels: seen.append(mels.shape[2]) or vocode(mels))
    t2w.stream_all(torch.randint(0, 8000, (300,), generator=torch.Generator().manual_seed(3)), seed=0)
    assert len(seen) > 4 and set(seen[:-1]) == t2w._stream_vocoder_lengths()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("unit", ["solve", "step"])
def test_cuda_graph_solve_equals_eager(model_dir, unit):
    warmed = Token2Wav(model_dir, device="cuda", warmup_graphs=True, max_graph_batch=4, dit_graph=unit)
    assert warmed.stream_batch_sizes == [1, 2, 4]  # (the graphs' batch buckets: the stage prefers them)
    assert len(warmed.graphs.graphs) >= 3  # batch buckets 1, 2, 4 of the steady window at least
    graphed = Token2Wav(model_dir, device="cuda", dit_graph=unit)
    eager = Token2Wav(model_dir, device="cuda", cuda_graphs=False)
    grid = graphed._time_grid(10, -1.0)
    # Captured with one set of inputs, replayed with others of the same bucket (4 rows x 144
    # frames): each equals the eager solve of its own inputs.
    for lengths in ([50, 23, 37], [61, 70, 12, 44], [50, 23, 37]):
        codes, voices, noise = _window_inputs(graphed, lengths)
        want = eager._sample_mels(codes, voices, noise, grid, 0.5, pad=True)
        got = graphed._sample_mels(codes, voices, noise, grid, 0.5)
        for a, b in zip(want, got):
            assert a.shape == b.shape and (a - b).abs().max().item() < 1e-4
    assert len(graphed.graphs.graphs) == 1
    # The vocoder's graphs: batch 3 padded to 4, replayed with other mels of the same length.
    for seed in (1, 2):
        mels = torch.randn(3, graphed.dit.mel_dim, 112, generator=torch.Generator().manual_seed(seed)).cuda()
        assert (graphed._vocoder_batch(mels) - eager._vocoder_batch(mels)).abs().max().item() < 1e-4
    assert list(graphed.vocoder_graphs.graphs) == [(4, 112)]
    # tf32: TF32 matmuls and convolutions for the process (restored: other tests compare float32).
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        Token2Wav(model_dir, device="cuda", cuda_graphs=False, tf32=True)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
    # A streamed decode through graphs equals the eager one.
    assert (graphed.stream_all(LONG, seed=4) - eager.stream_all(LONG, seed=4)).abs().max().item() < 1e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("unit", ["solve", "step"])
def test_cuda_graphs_with_past_cache(model_dir, unit):
    """`dit_past_cache` through CUDA graphs (warmed at start, as served): the streams' kept pasts go
    in and out of the graphs, two streams in one pass at different windows, and the audio equals
    the eager decode's."""
    graphed = Token2Wav(model_dir, device="cuda", dit_graph=unit, dit_past_cache=True, warmup_graphs=True,
                        max_graph_batch=4)
    eager = Token2Wav(model_dir, device="cuda", cuda_graphs=False, dit_past_cache=True)
    # (keys: rows, frames, grid length or "step", "past" for streaming windows, then the options)
    assert graphed.graphs.graphs and all(key[3] == "past" for key in graphed.graphs.graphs)
    replays = []
    run = graphed.graphs.run
    graphed.graphs.run = lambda key, *a: replays.append(key in graphed.graphs.graphs) or run(key, *a)
    a, b = (_feed_in_pieces(t, LONG, [5], seed=2, batch_with=LONG[40:130])[0] for t in (graphed, eager))
    assert (torch.cat(a) - torch.cat(b)).abs().max().item() < 1e-4
    assert replays and all(replays)  # every window replayed a graph captured at start


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_dit_stays_close_to_float32(t2w, model_dir, dtype):
    half = Token2Wav(model_dir, dit_dtype=dtype)
    assert next(half.dit.transformer_blocks.parameters()).dtype == getattr(torch, dtype)
    # Kept in float32: the time embedding and the rotary tables (their inputs need the precision).
    assert next(half.dit.time_embed.parameters()).dtype == torch.float32
    assert half.dit.rotary_embed.inv_freq.dtype == torch.float32
    assert torch.equal(half.dit.rotary_embed.inv_freq, t2w.dit.rotary_embed.inv_freq)  # (values, not just the dtype)
    want, got = t2w(CODES, "Chelsie", seed=7), half(CODES, "Chelsie", seed=7)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert 0 < ((got - want).norm() / want.norm()).item() < 0.01
    # Streaming and batching take the same path.
    streamed = half.stream_all(CODES, voice="Chelsie", seed=7)
    assert ((streamed - want).norm() / want.norm()).item() < 0.01


def test_unknown_dit_dtype(model_dir):
    with pytest.raises(ValueError, match="dit_dtype"):
        Token2Wav(model_dir, dit_dtype="int8")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_decode_repeats_exactly(model_dir):
    """The same codes and seed give the same samples, graphed or eager (cuDNN's default algorithms
    for the vocoder's convolutions may add in any order)."""
    for graphs in (True, False):
        t2w = Token2Wav(model_dir, device="cuda", cuda_graphs=graphs)
        assert torch.backends.cudnn.deterministic
        first = t2w.stream_all(LONG, seed=4)
        assert all(torch.equal(first, t2w.stream_all(LONG, seed=4)) for _ in range(3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_of_a_half_precision_dit(model_dir):
    graphed = Token2Wav(model_dir, device="cuda", dit_dtype="bfloat16")
    eager = Token2Wav(model_dir, device="cuda", cuda_graphs=False, dit_dtype="bfloat16")
    full = Token2Wav(model_dir, device="cuda", cuda_graphs=False)
    a, b, c = (m.stream_all(LONG, seed=4) for m in (graphed, eager, full))
    assert graphed.graphs.graphs  # it did replay graphs
    assert ((a - b).norm() / b.norm()).item() < 0.01 and ((a - c).norm() / c.norm()).item() < 0.01


def test_compile_needs_graphs_captured_at_start(model_dir):
    # (Compiled code runs only inside graphs captured at start: no serving step ever compiles.)
    for mode in (True, "blocks"):
        with pytest.raises(ValueError, match="compile needs CUDA graphs captured at start"):
            Token2Wav(model_dir, compile=mode)
    with pytest.raises(ValueError, match="compile must be true, false or \"blocks\""):
        Token2Wav(model_dir, compile="yes")


@pytest.mark.parametrize("fused_qkv", [False, True])
def test_dit_compiled_block_by_block_equals_its_layers(model_dir, fused_qkv):
    # compile "blocks": one compiled `run_layer` for every layer (a module's parameters are inputs
    # to compiled code, and the layers differ only in the mask they are given), no compile on later calls.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # (the other case compiled run_layer already)
    t = Token2Wav(model_dir, dit_fused_qkv=fused_qkv)
    seen = []
    body = t._dit_body
    t._dit_body = lambda *args: seen.append(args) or body(*args)  # (this instance only: its inputs)
    with torch.inference_mode():
        frames = t.frame_buckets[0]
        t._sample_mels([torch.zeros(frames // t.dit.repeats, dtype=torch.long)] * 2, [t.voices[0]] * 2,
                       [torch.randn(frames, t.dit.mel_dim)] * 2, t._time_grid(2, -1.0), 0.5)
        args = seen[0]
        block = torch.compile(run_layer, dynamic=True)
        before = counters["stats"]["unique_graphs"]
        got = body(*args, block=block)
        compiled = counters["stats"]["unique_graphs"] - before
        again = body(*args, block=block)
        want = body(*args)
    assert len(set(windows(t.dit))) > 1 and compiled == 1
    assert counters["stats"]["unique_graphs"] - before == compiled  # the second call compiled nothing
    assert torch.equal(got, again) and (got - want).abs().max().item() < 1e-4


def test_dit_layers_with_masks_made_once_equal_transformers_layers(model_dir):
    # run_layer with block_masks' mask is transformers' DiTDecoderLayer with its block_diff, for
    # every kind of layer, also where padding keys are hidden; the masks' rows are aligned.
    t = Token2Wav(model_dir)
    frames, rows = 2 * t.dit.block_size + 4, 3  # (not a multiple of the alignment)
    torch.manual_seed(0)
    h = torch.randn(rows, frames, t.dit.config.hidden_size)
    temb = torch.randn(rows, t.dit.config.hidden_size)
    cos, sin = t.dit.rotary_embed(h, torch.arange(frames)[None].expand(rows, -1))
    block_diff = t.dit._create_block_diff(h[:, :, :1])[:, :1].clone()
    block_diff[1, :, :, frames - 3:] = float(frames + t.dit.block_size)  # row 1's last 3 keys: padding
    masks = block_masks(block_diff, t._mask_kinds, h.dtype)
    assert len(masks) == len(set(windows(t.dit))) >= 2
    for mask in masks:
        assert mask.shape == (rows, 1, frames, frames) and all(s % 8 == 0 for s in mask.stride()[:-1])
    with torch.inference_mode():
        for layer, kind in zip(t.dit.transformer_blocks, t._layer_kind):
            want = layer(h, temb, position_embeddings=(cos, sin), block_diff=block_diff)
            for backend in (None, BACKENDS["math"]):
                got = run_layer(layer, h, temb, cos, sin, masks[kind], backend)
                assert (got - want).abs().max().item() < 1e-5


def test_fused_qkv_projection_computes_the_three(model_dir):
    """`dit_fused_qkv`: one stacked projection per layer (biases too) gives the layers' outputs and
    the decode of three separate ones (the same dot products, summed maybe in another order)."""
    from omni_server.models.qwen2_5_omni.dit import fuse_qkv

    t = Token2Wav(model_dir)
    layer = t.dit.transformer_blocks[0]
    attn = layer.attn
    torch.manual_seed(0)
    with torch.no_grad():  # (the tiny checkpoint's biases are zeros: these must reach the stack)
        for p in (attn.to_q, attn.to_k, attn.to_v):
            p.bias.normal_()
    frames, rows = 2 * t.dit.block_size, 2
    h = torch.randn(rows, frames, t.dit.config.hidden_size)
    temb = torch.randn(rows, t.dit.config.hidden_size)
    cos, sin = t.dit.rotary_embed(h, torch.arange(frames)[None].expand(rows, -1))
    block_diff = t.dit._create_block_diff(h[:, :, :1])[:, :1]
    with torch.inference_mode():
        mask = block_masks(block_diff, t._mask_kinds, h.dtype)[t._layer_kind[0]]
        want = layer(h, temb, position_embeddings=(cos, sin), block_diff=block_diff)  # transformers'
        before = [p.weight.clone() for p in (attn.to_q, attn.to_k, attn.to_v)]
        fuse_qkv(t.dit)
        assert attn.qkv.weight.shape == (3 * attn.inner_dim, attn.to_q.in_features)
        # the three are views of the stack (one copy in memory); the stack is what runs:
        assert attn.to_k.weight.data_ptr() == attn.qkv.weight[attn.inner_dim:].data_ptr()
        assert torch.equal(attn.qkv.bias, torch.cat([attn.to_q.bias, attn.to_k.bias, attn.to_v.bias]))
        got = run_layer(layer, h, temb, cos, sin, mask)
        attn.to_q, attn.to_k, attn.to_v = None, None, None  # (the fused path reads only qkv)
        assert torch.equal(run_layer(layer, h, temb, cos, sin, mask), got)
    assert torch.equal(attn.qkv.weight, torch.cat(before))
    assert (got - want).abs().max().item() < 1e-5
    plain, fused = Token2Wav(model_dir), Token2Wav(model_dir, dit_fused_qkv=True)
    request = {"codes": torch.arange(30) % 100, "voice": plain.voices[0], "seed": 3}
    a, b = plain.batch([request])[0], fused.batch([request])[0]
    assert a.shape == b.shape and (a - b).abs().max().item() < 1e-4
    a, b = plain.stream_all(LONG, seed=2), fused.stream_all(LONG, seed=2)
    assert a.shape == b.shape and (a - b).abs().max().item() < 1e-4


def test_dit_attention_pins_a_backend(model_dir):
    with pytest.raises(ValueError, match="dit_attention must be null"):
        Token2Wav(model_dir, dit_attention="fast")
    request = {"codes": torch.arange(30) % 100, "voice": Token2Wav(model_dir).voices[0], "seed": 3}
    a = Token2Wav(model_dir).batch([request])[0]
    b = Token2Wav(model_dir, dit_attention="math").batch([request])[0]
    assert a.shape == b.shape and (a - b).abs().max().item() < 1e-4


def test_dit_attention_falls_back_where_its_kernel_cannot_run(model_dir, caplog):
    """A config's kernel choice (the 7B configs: cuDNN's, measured on the H200) must not stop a host
    without it from starting: PyTorch's choice instead, with a warning. (CPU: no cuDNN attention.)"""
    with caplog.at_level(logging.WARNING):
        t = Token2Wav(model_dir, dit_attention="cudnn")
    assert t._attention_backend is None
    assert "dit_attention cudnn cannot run here" in caplog.text
    assert Token2Wav(model_dir, dit_attention="math")._attention_backend is BACKENDS["math"]


def test_gelu_epilogue_is_refused_where_it_would_change_the_numbers(model_dir):
    """`dit_gelu_epilogue` on the CPU: a clear error (the CPU kernel's GELU is the exact one, not
    the checkpoint's tanh form); `fuse_gelu` only takes the DiT's Linear -> GELU(tanh) MLP."""
    from omni_server.models.qwen2_5_omni.dit import GeluEpilogueMLP

    with pytest.raises(ValueError, match="dit_gelu_epilogue needs a CUDA device"):
        Token2Wav(model_dir, dit_gelu_epilogue=True)
    mlp = Token2Wav(model_dir).dit.transformer_blocks[0].ff
    fused = GeluEpilogueMLP(mlp)
    assert fused.up is mlp.ff[0] and fused.down is mlp.ff[3]  # (the same parameters)
    mlp.ff[1] = torch.nn.GELU()
    with pytest.raises(ValueError, match="GELU\\(tanh\\)"):
        GeluEpilogueMLP(mlp)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLASLt's epilogue needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_epilogue_computes_the_mlp(model_dir, dtype):
    """`GeluEpilogueMLP` on a CUDA device: transformers' `DiTMLP` output (its GEMM and GELU fused).
    In bf16 it is at least as close to the float32 computation (the same weights) as the module is."""
    import copy

    from omni_server.models.qwen2_5_omni.dit import GeluEpilogueMLP

    mlp = Token2Wav(model_dir).dit.transformer_blocks[0].ff.to("cuda", dtype)
    torch.manual_seed(0)
    with torch.no_grad():  # (the tiny checkpoint's biases are zeros: the epilogue's bias must count)
        mlp.ff[0].bias.normal_()
    x = torch.randn(3, 70, mlp.ff[0].in_features, device="cuda", dtype=dtype)
    with torch.inference_mode():
        want, got = mlp(x), GeluEpilogueMLP(mlp)(x)
        exact = copy.deepcopy(mlp).float()(x.float())
    assert got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    else:  # Eager rounds the first GEMM's output to bf16 before the GELU, the epilogue does not. A
        # bound relative to the output failed (the second GEMM sums those roundings into outputs near
        # 0: H100 run of 2026-12-05, 0.0125 where |y| is small), so both are held to the float32 result.
        err_got, err_want = (got.float() - exact).abs(), (want.float() - exact).abs()
        assert err_got.mean() <= 1.1 * err_want.mean() and err_got.max() <= 1.5 * err_want.max()
        assert err_want.max() < 0.1 * exact.abs().max()  # (the reference itself is close)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("mode, vocoder, growing, unit", [
    (True, True, False, "solve"), ("blocks", True, False, "solve"), ("blocks", False, False, "solve"),
    ("blocks", "activations", False, "solve"), ("blocks", "activations", True, "solve"),
    ("blocks", "activations", True, "step"), ("blocks", "activations", True, "step+qkv"),
    ("blocks", "activations", True, "step+qkv+past"), ("blocks", "activations", True, "step+qkv+past+gelu")])
def test_cuda_graphs_of_compiled_code(model_dir, mode, vocoder, growing, unit):
    """The graphs capture the compiled DiT and vocoder (or the DiT only: `compile_vocoder` false;
    or the vocoder's activations only) (warmed, so no compile inside a capture), with the polyphase
    upsampler too, and replay what the eager float32 modules compute; `growing`: with the 7B
    configs' windows (48, 48, 72, 96, then 144 new frames), each size its own graphs; `unit`: a
    DiT graph per solve or per solver step (`dit_graph`; "+qkv": with `dit_fused_qkv`; "+past":
    with `dit_past_cache`, against the eager decode with it; "+gelu": with `dit_gelu_epilogue`)."""
    unit, *extras = unit.split("+")
    past = "past" in extras
    windows = dict(first_chunk_frames=[48, 48, 72, 96], chunk_frames=144) if growing else {}
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # (an earlier case compiled the same DiT blocks: without this it reuses them)
    before = counters["stats"]["unique_graphs"]
    compiled = Token2Wav(model_dir, device="cuda", compile=mode, compile_vocoder=vocoder, polyphase_upsampling=True,
                         warmup_graphs=True, dit_graph=unit, dit_fused_qkv="qkv" in extras, dit_past_cache=past,
                         dit_gelu_epilogue="gelu" in extras, **windows)
    assert (compiled.vocoder_graphs.fn != compiled._vocoder_body) == (vocoder is True)  # (a bound method equals its twin)
    fused = [m for m in compiled.vocoder.modules() if isinstance(m, AntiAliasedSnake)]
    assert bool(fused) == (vocoder == "activations")
    assert all(hasattr(m.fn, "_torchdynamo_orig_callable") for m in fused)  # (their function compiled)
    warmed = counters["stats"]["unique_graphs"]
    assert warmed > before  # compiled in the warm-up
    eager = Token2Wav(model_dir, device="cuda", cuda_graphs=False, dit_past_cache=past, **windows)
    a, b = compiled.stream_all(LONG, seed=4), eager.stream_all(LONG, seed=4)
    compiled.stream_all(LONG[:37], seed=5)  # a shorter last window: outside the graphs, eager
    assert counters["stats"]["unique_graphs"] == warmed  # nothing compiled while decoding
    assert compiled.graphs.graphs and compiled.vocoder_graphs.graphs  # it captured both
    assert not compiled.graphs.failed and not compiled.vocoder_graphs.failed
    assert a.shape == b.shape and (a - b).abs().max().item() < 1e-3


def test_window_settings_that_would_make_audio_depend_on_arrival_are_refused(model_dir):
    """future_frames 0: the vocoder held back its context or not by whether the final flag came with
    the last codes (the same codes' audio differed, ~1e-8); a context count that is not a number
    failed deep in the first decode."""
    with pytest.raises(ValueError, match="future_frames must be a positive multiple of 2"):
        Token2Wav(model_dir, future_frames=0)
    with pytest.raises(ValueError, match="vocoder_context_frames must be a whole number >= 0, got '20'"):
        Token2Wav(model_dir, vocoder_context_frames="20")
