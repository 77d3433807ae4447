"""Qwen3-Omni code predictor: our batched frame loop equals transformers' code_predictor.generate."""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from omni_server.models.qwen3_omni_moe.code_predictor import CodePredictor


@lru_cache(maxsize=None)
def _hf_talker(model_dir):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval().talker


@torch.inference_mode()
def _hf_frame(talker, h: torch.Tensor, c0: int) -> tuple[list[int], torch.Tensor]:
    """As transformers' talker prepares its next step: the residual codes and the summed embeddings."""
    e0 = talker.get_input_embeddings()(torch.tensor([[c0]]))
    res = talker.code_predictor.generate(inputs_embeds=torch.cat([h[None, None], e0], dim=1),
                                         max_new_tokens=talker.config.num_code_groups - 1, do_sample=False,
                                         output_hidden_states=True, return_dict_in_generate=True)
    mid = [hid[0] for hid in res.hidden_states[1:]]
    last = talker.code_predictor.get_input_embeddings()[-1](res.sequences[..., -1:])
    total = torch.cat([e0] + mid + [last], dim=1).sum(1)[0]
    return res.sequences[0].tolist(), total


def test_greedy_frames_equal_transformers_batched(tiny_models):
    model_dir = tiny_models["tiny-qwen3-omni-moe"]
    talker = _hf_talker(model_dir)
    ours = CodePredictor(str(model_dir), "cpu")
    torch.manual_seed(0)
    hidden = talker.config.text_config.hidden_size
    h = torch.randn(3, hidden) * 3
    c0 = [5, 1777, 2047]
    e0 = talker.get_input_embeddings()(torch.tensor(c0))
    codes, residual = ours(h, e0)
    assert codes.shape == (3, 15)
    for i in range(3):
        want_codes, want_sum = _hf_frame(talker, h[i], c0[i])
        assert codes[i].tolist() == want_codes
        torch.testing.assert_close(e0[i] + residual[i], want_sum, rtol=1e-5, atol=1e-5)
    assert len({tuple(c.tolist()) for c in codes}) == 3  # the rows really differ


def test_sampled_rows_follow_their_own_generator(tiny_models):
    ours = CodePredictor(str(tiny_models["tiny-qwen3-omni-moe"]), "cpu")
    talker = _hf_talker(tiny_models["tiny-qwen3-omni-moe"])
    h = torch.randn(2, talker.config.text_config.hidden_size, generator=torch.Generator().manual_seed(3)) * 3
    e0 = talker.get_input_embeddings()(torch.tensor([7, 7]))
    gens = lambda: [torch.Generator().manual_seed(1), None]  # noqa: E731
    a, _ = ours(h, e0, gens())
    b, _ = ours(h, e0, gens())
    greedy, _ = ours(h, e0)
    assert torch.equal(a, b)  # same seed, same codes
    assert torch.equal(a[1], greedy[1])  # the greedy row is unaffected by its neighbour's sampling
    assert not torch.equal(a[0], greedy[0])  # the sampled row did sample
    alone, _ = ours(h[:1], e0[:1], [torch.Generator().manual_seed(1)])
    assert torch.equal(a[0], alone[0])  # a sampled row does not depend on its batch


def test_sampling_draws_from_the_filtered_distribution():
    """A sampled code is a draw from the top-k 50 / top-p 0.8 distribution (the reference's filters):
    frequencies over many uniforms match it, and codes outside it never come."""
    from omni_server.models.qwen3_omni_moe.code_predictor import _pick

    logits = torch.randn(2048, generator=torch.Generator().manual_seed(5)) * 2
    top = torch.topk(logits, 50)
    probs = torch.softmax(top.values, dim=-1)
    keep = torch.cumsum(probs, dim=-1) - probs < 0.8
    want = torch.zeros(2048)
    want[top.indices[keep]] = probs[keep] / probs[keep].sum()
    n = 40000
    u = torch.rand(n, generator=torch.Generator().manual_seed(6))
    codes = _pick(logits.expand(n, -1), u)
    got = torch.bincount(codes, minlength=2048).float() / n
    assert set(codes.unique().tolist()) <= set(top.indices[keep].tolist())
    assert 3 <= int(keep.sum()) < 50  # the filters cut something and leave a choice
    assert (got - want).abs().max() < 0.01
    greedy = _pick(logits.expand(3, -1), torch.tensor([-1.0, -1.0, 0.5]))
    assert greedy[:2].tolist() == [int(logits.argmax())] * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_cuda_graph_frames_equal_eager_frames(tiny_models):
    model_dir = str(tiny_models["tiny-qwen3-omni-moe"])
    graphed = CodePredictor(model_dir, "cuda")
    eager = CodePredictor(model_dir, "cuda", cuda_graphs=False)
    graphed.warm_up(8)
    assert sorted(graphed.graphs.graphs) == [(1,), (2,), (4,), (8,)] and not graphed.graphs.failed
    hidden = graphed.module.config.hidden_size
    g = torch.Generator(device="cuda").manual_seed(0)
    h, e0 = torch.randn(3, hidden, device="cuda", generator=g), torch.randn(3, hidden, device="cuda", generator=g)
    gens = lambda: [None, torch.Generator(device="cuda").manual_seed(1), None]  # noqa: E731
    for a, b in [(graphed(h, e0), eager(h, e0)), (graphed(h, e0, gens()), eager(h, e0, gens()))]:
        assert torch.equal(a[0], b[0])  # batch 3 ran padded to 4 in the graph
        torch.testing.assert_close(a[1], b[1])


def test_padded_graph_batches_return_each_rows_own_frame(tiny_models):
    """The CUDA path pads a batch to its graph's size (a power of two) and cuts the result back; on
    CPU, with the graph replaced by the frame function itself, that path equals the plain one."""
    from types import SimpleNamespace

    ours = CodePredictor(str(tiny_models["tiny-qwen3-omni-moe"]), "cpu")
    hidden = ours.module.config.hidden_size
    g = torch.Generator().manual_seed(4)
    h, e0 = torch.randn(3, hidden, generator=g) * 3, torch.randn(3, hidden, generator=g)
    gens = lambda: [torch.Generator().manual_seed(2), None, torch.Generator().manual_seed(3)]  # noqa: E731
    plain = ours(h, e0, gens())
    keys = []
    ours.graphs = SimpleNamespace(run=lambda key, inputs: keys.append(key) or ours._frame(*inputs))
    padded = ours(h, e0, gens())
    assert keys == [(4,)]
    assert torch.equal(padded[0], plain[0]) and padded[0].shape == (3, 15)
    torch.testing.assert_close(padded[1], plain[1])


def test_compiled_frames_equal_plain_frames(tiny_models):
    """`compile`: each layer's halves around its attention through torch.compile (Inductor's CPU
    code here, ~50 s to compile on a 2-core host; on CUDA the graphs capture them: the CUDA test
    below) give the plain frame's codes, greedy and sampled rows in one batch, and its residual to
    rounding; one batch size more compiles nothing new."""
    from torch._dynamo.utils import counters

    model_dir = str(tiny_models["tiny-qwen3-omni-moe"])
    plain, compiled = CodePredictor(model_dir, "cpu"), CodePredictor(model_dir, "cpu", compile=True)
    hidden = plain.module.config.hidden_size
    g = torch.Generator().manual_seed(5)
    h, e0 = torch.randn(3, hidden, generator=g) * 3, torch.randn(3, hidden, generator=g)
    gens = lambda: [torch.Generator().manual_seed(7), None, torch.Generator().manual_seed(8)]  # noqa: E731
    a, b = compiled(h, e0, gens()), plain(h, e0, gens())
    assert torch.equal(a[0], b[0])
    torch.testing.assert_close(a[1], b[1])
    assert compiled._halves is not None and plain._halves is None
    traced = counters["stats"]["unique_graphs"]
    a, b = compiled(h[:2], e0[:2]), plain(h[:2], e0[:2])  # (greedy, another batch size)
    assert torch.equal(a[0], b[0]) and counters["stats"]["unique_graphs"] == traced


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_cuda_graphs_of_the_compiled_frame_equal_eager_frames(tiny_models):
    """The graphs capture the frame with its compiled layer halves at warm-up (no compile while
    serving) and replay what the plain frame computes; a batch past the graphs runs the frame
    outside them, compiling nothing new."""
    from torch._dynamo.utils import counters

    model_dir = str(tiny_models["tiny-qwen3-omni-moe"])
    torch._dynamo.reset()
    compiled = CodePredictor(model_dir, "cuda", compile=True, max_graph_batch=4)
    eager = CodePredictor(model_dir, "cuda", cuda_graphs=False)
    compiled.warm_up(4)
    assert sorted(compiled.graphs.graphs) == [(1,), (2,), (4,)] and not compiled.graphs.failed
    traced = counters["stats"]["unique_graphs"]
    hidden = compiled.module.config.hidden_size
    g = torch.Generator(device="cuda").manual_seed(0)
    for rows in (3, 6):
        h, e0 = torch.randn(rows, hidden, device="cuda", generator=g), torch.randn(rows, hidden, device="cuda", generator=g)
        gens = lambda: [torch.Generator(device="cuda").manual_seed(1 + i) if i % 2 else None for i in range(rows)]  # noqa: E731
        for a, b in [(compiled(h, e0), eager(h, e0)), (compiled(h, e0, gens()), eager(h, e0, gens()))]:
            assert torch.equal(a[0], b[0])
            torch.testing.assert_close(a[1], b[1])
    assert counters["stats"]["unique_graphs"] == traced  # (6 rows: past the graphs, compiled already)


def test_code_predictor_options_come_from_additional_config():
    from types import SimpleNamespace

    from omni_server.models.qwen3_omni_moe.talker import code_predictor_options

    cfg = lambda extra: SimpleNamespace(additional_config=extra)  # noqa: E731
    assert code_predictor_options(cfg({})) == {}
    assert code_predictor_options(cfg({"code_predictor": {"compile": True}})) == {"compile": True}
    for bad in ({"compile": "yes"}, {"complie": True}, [1]):
        with pytest.raises(ValueError, match="additional_config.code_predictor"):
            code_predictor_options(cfg({"code_predictor": bad}))


def test_served_talker_reads_its_code_predictor_options(tiny_models, tmp_path):
    """The talker's `engine_args.additional_config.code_predictor` reaches the model in a real vLLM
    engine: a misspelt option stops `serve`, whose last line says which and what it takes."""
    from tests.conftest import REPO, Server

    server = Server(REPO / "tests/configs/qwen3_omni.yaml", tmp_path / "serve.log",
                    args=["--stage-arg", "talker.additional_config.code_predictor.complie=true"])
    try:
        assert server.proc.wait(300) == 1
    finally:
        server.stop()
    last = server.log_tail().splitlines()[-1]
    assert ("stage 1 (talker) failed to start (exit code 1): ValueError: additional_config.code_predictor.complie: "
            "True is not one of compile (bool), cuda_graphs (bool), max_graph_batch (int)") in last


def test_bfloat16_frames_equal_transformers_bfloat16(tiny_models):
    """In the dtype the served talker runs (bf16): the same codes as transformers' bf16 model, and
    the next input E0(c0) + residual rounded once as its one sum of the frame's embeddings is
    (its rotary frequencies stay float32 in any dtype; rounded, they changed ~1 frame in 4)."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model_dir = str(tiny_models["tiny-qwen3-omni-moe"])
    talker = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir, dtype=torch.bfloat16).eval().talker
    ours = CodePredictor(model_dir, "cpu", torch.bfloat16, cuda_graphs=False)
    assert ours.module.model.rotary_emb.inv_freq.dtype == torch.float32
    n = 32
    h = (torch.randn(n, talker.config.text_config.hidden_size, generator=torch.Generator().manual_seed(0)) * 3
         ).to(torch.bfloat16)
    c0 = torch.randint(0, 2048, (n,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        e0 = talker.get_input_embeddings()(c0)
        codes, residual = ours(h, e0)
        assert residual.dtype == torch.float32
        mine = (e0.float() + residual).to(torch.bfloat16)
        for i in range(n):
            want, total = _hf_bf16_frame(talker, h[i], e0[i])
            assert codes[i].tolist() == want, i
            torch.testing.assert_close(mine[i], total, rtol=2 ** -7, atol=0)  # (summation order: an ulp at most)


def _hf_bf16_frame(talker, h: torch.Tensor, e0: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    res = talker.code_predictor.generate(inputs_embeds=torch.stack([h, e0])[None],
                                         max_new_tokens=talker.config.num_code_groups - 1, do_sample=False)
    codes = res[0]
    embeds = talker.code_predictor.get_input_embeddings()
    parts = torch.stack([e0] + [embeds[j](codes[j:j + 1])[0] for j in range(len(codes))])
    return codes.tolist(), parts.sum(0)
