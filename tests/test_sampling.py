"""omni_server/stage/sampling.py: the distribution is transformers' (the reference's talker
sampling), the draws follow it, and the per-row state follows vLLM's batch updates."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from omni_server.stage.sampling import (LOGITS_PROCESSOR, SPEC, OmniSampler, candidates, reads_output_tokens, requested,
                                        takes, vllm_params)


def _reference(logits: torch.Tensor, seen: list[int], penalty: float, temperature: float, top_k: int,
               top_p: float) -> torch.Tensor:
    """transformers' sampling distribution for one row (generate()'s processor order)."""
    x = logits[None].clone()
    if seen:
        x = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([seen]), x)
    x = TemperatureLogitsWarper(temperature)(None, x)
    x = TopKLogitsWarper(top_k)(None, x)
    if top_p < 1.0:
        x = TopPLogitsWarper(top_p)(None, x)
    return x.softmax(-1)[0]


def _dense(probs: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    out = torch.zeros(probs.shape[0], vocab, dtype=torch.float64)
    return out.scatter_(1, ids, (probs / probs.sum(-1, keepdim=True)).double())


def test_candidates_are_transformers_distribution():
    g = torch.Generator().manual_seed(0)
    vocab = 300
    rows = [  # penalty, temperature, top_k, top_p: the talker's, and others mixed in one batch
        (1.05, 0.9, 40, 0.8), (1.3, 0.7, 40, 0.8), (1.05, 1.2, 7, 1.0), (2.0, 0.9, 25, 0.3),
        (1.05, 0.9, 1, 0.8), (1.0, 1.0, 40, 0.95)]
    logits = torch.randn(len(rows), vocab, generator=g) * 3
    seen_ids = [torch.randperm(vocab, generator=g)[:n].tolist() for n in (30, 5, 60, 0, 12, 20)]
    seen = torch.zeros(len(rows), vocab, dtype=torch.bool)
    for i, ids in enumerate(seen_ids):
        seen[i, ids] = True
    pen, temp, k, p = (torch.tensor(c) for c in zip(*rows))
    probs, ids = candidates(logits, seen, pen.float(), temp.float(), k, p.float(), int(k.max()))
    ours = _dense(probs, ids, vocab)
    for i, (penalty, temperature, top_k, top_p) in enumerate(rows):
        ref = _reference(logits[i], seen_ids[i], penalty, temperature, top_k, top_p).double()
        assert torch.allclose(ours[i], ref, atol=1e-6), i
        assert int((ref > 0).sum()) == int((ours[i] > 0).sum()) <= top_k


def _config(max_rows: int, vocab: int):
    return SimpleNamespace(model_config=SimpleNamespace(get_vocab_size=lambda: vocab),
                           scheduler_config=SimpleNamespace(max_num_seqs=max_rows))


def _params(temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05, seed=None) -> SamplingParams:
    given, spec = vllm_params(temperature, top_k, top_p, repetition_penalty, seed)
    return SamplingParams(**given, extra_args={SPEC: spec})


def _add(lp: OmniSampler, size: int, added: list, removed=(), moved=()) -> None:
    lp.update_state(BatchUpdate(batch_size=size, removed=list(removed), added=added, moved=list(moved)))


def _chosen(out: torch.Tensor) -> list[int]:
    """The one token a row leaves with (0 there, -inf elsewhere)."""
    assert torch.isinf(out).sum(-1).eq(out.shape[1] - 1).all()
    return out.argmax(-1).tolist()


def test_draws_follow_the_distribution():
    vocab, rows = 50, 4096
    torch.manual_seed(0)  # the unseeded draws' global generator: the same 20k draws every run
    g = torch.Generator().manual_seed(1)
    row = torch.randn(vocab, generator=g) * 2
    prompt = [3, 4, 5]
    lp = OmniSampler(_config(rows, vocab), torch.device("cpu"), False)
    _add(lp, rows, [(i, _params(), prompt, []) for i in range(rows)])
    counts = torch.zeros(vocab)
    for _ in range(5):
        counts += torch.bincount(torch.tensor(_chosen(lp.apply(row.expand(rows, vocab).clone()))), minlength=vocab)
    ref = _reference(row, prompt, 1.05, 0.9, 40, 0.8)
    assert 0.5 * (counts / counts.sum() - ref).abs().sum() < 0.02  # total variation over 20k draws
    assert counts[ref == 0].sum() == 0


def test_penalty_reads_the_prompt_and_each_kept_draw():
    """top-k 1 is argmax of the penalised logits: a seen token loses its lead (penalty 4 flips a
    3 vs 2 lead), the others keep theirs. vLLM appends to the live output list after each step
    whose token it keeps: the sampler then marks its own draw (from the device), whatever value
    the list holds (async scheduling's -1 placeholder, never filled in for it)."""
    vocab = 10
    lp = OmniSampler(_config(4, vocab), torch.device("cpu"), False)
    outputs: list[int] = []
    _add(lp, 1, [(0, _params(temperature=1.0, top_k=1, repetition_penalty=4.0), [7], outputs)])
    logits = torch.full((1, vocab), -5.0)
    logits[0, 7], logits[0, 2], logits[0, 5] = 3.0, 2.0, 1.0  # seen: 0.75, 0.5, 0.25
    assert _chosen(lp.apply(logits.clone())) == [2]  # 7 is in the prompt
    outputs.append(-1)
    assert _chosen(lp.apply(logits.clone())) == [5]  # 2 now seen too
    outputs.append(-1)
    assert _chosen(lp.apply(logits.clone())) == [7]  # all three seen: 0.75 leads again


def test_a_draw_vllm_discards_is_not_seen():
    """A row whose step vLLM throws away (a prompt prefilled in chunks samples a token that is
    not kept; the output list does not grow) leaves the seen mask alone; the next kept one counts."""
    vocab = 10
    lp = OmniSampler(_config(4, vocab), torch.device("cpu"), False)
    outputs: list[int] = []
    _add(lp, 1, [(0, _params(temperature=1.0, top_k=1, repetition_penalty=4.0), [], outputs)])
    logits = torch.full((1, vocab), -5.0)
    logits[0, 2], logits[0, 5] = 2.0, 1.0
    assert _chosen(lp.apply(logits.clone())) == [2]  # discarded: the list stays empty
    assert _chosen(lp.apply(logits.clone())) == [2]  # kept
    outputs.append(-1)
    assert _chosen(lp.apply(logits.clone())) == [5]


def _fold(outputs: list[int], token: int) -> None:
    """What vLLM's update_async_output_token_ids does to a list ending in unfilled placeholders
    once some request in the batch needs token values: the run becomes the one token it fills."""
    while outputs and outputs[-1] == -1:
        outputs.pop()
    outputs.append(token)


def test_placeholders_folded_by_vllm_still_count_as_one_kept_draw():
    """A list vLLM shrinks (a run of -1 placeholders folded into one real token) means the last
    draw was kept: it is marked, and a seeded request's draw positions go on counting (its draws
    do not repeat earlier noise)."""
    vocab = 10
    lp = OmniSampler(_config(4, vocab), torch.device("cpu"), False)
    outputs: list[int] = []
    _add(lp, 1, [(0, _params(temperature=1.0, top_k=1, repetition_penalty=100.0), [], outputs)])
    logits = torch.full((1, vocab), -5.0)
    logits[0, 1], logits[0, 9], logits[0, 8] = 3.0, 2.0, 1.0
    assert _chosen(lp.apply(logits.clone())) == [1]
    outputs.append(-1)
    assert _chosen(lp.apply(logits.clone())) == [9]
    outputs.append(-1)
    _fold(outputs, 9)  # [-1, -1] -> [9]: shorter, its last entry real
    assert _chosen(lp.apply(logits.clone())) == [8]  # 1 and 9 seen
    outputs.append(-1)  # (filled in again before the next step: the batch still needs values)
    outputs[-1] = 8
    logits[0, 7] = 0.5
    assert _chosen(lp.apply(logits.clone())) == [7]

    def draws(fold_at):
        lp = OmniSampler(_config(1, 64), torch.device("cpu"), False)
        out: list[int] = []
        _add(lp, 1, [(0, _params(top_p=1.0, repetition_penalty=1.0, seed=5), [], out)])
        got = []
        for step in range(8):
            got += _chosen(lp.apply(torch.zeros(1, 64)))
            out.append(-1)
            if step == fold_at:
                _fold(out, got[-1])
        return got

    assert draws(fold_at=4) == draws(fold_at=None)


def test_kept_draws_follow_their_requests_across_batch_changes():
    """Rows that move, leave or arrive between a draw and the next step: each kept draw is marked
    in its own request's row (the index path), then the usual all-rows path resumes."""
    vocab = 12
    lp = OmniSampler(_config(4, vocab), torch.device("cpu"), False)
    outs = [[], [], []]
    p = _params(temperature=1.0, top_k=1, repetition_penalty=100.0)
    _add(lp, 3, [(i, p, [], outs[i]) for i in range(3)])
    logits = torch.zeros(3, vocab)
    logits[0, 1], logits[1, 2], logits[2, 3] = 5.0, 5.0, 5.0  # each row's favourite
    logits[:, 9] = 4.0  # everyone's second choice
    assert _chosen(lp.apply(logits.clone())) == [1, 2, 3]
    for o in outs:
        o.append(-1)
    # Row 0's request leaves; row 2's moves into its place; row 1 keeps its place.
    _add(lp, 2, [], removed=[0], moved=[(2, 0, MoveDirectionality.UNIDIRECTIONAL)])
    moved = logits[[2, 1]].clone()  # the rows' logits follow their requests
    assert _chosen(lp.apply(moved.clone())) == [9, 9]  # 3 and 2 seen: both fall back to 9
    for o in outs[1:]:
        o.append(-1)
    moved[:, 8] = 3.0
    assert _chosen(lp.apply(moved.clone())) == [8, 8]  # 9 seen too, by each


def test_top_k_above_the_vocabulary_takes_all_of_it():
    torch.manual_seed(0)
    lp = OmniSampler(_config(2, 6), torch.device("cpu"), False)
    _add(lp, 2, [(0, _params(top_k=40, top_p=1.0, repetition_penalty=1.0), [], []),
                 (1, _params(top_k=3, top_p=1.0, repetition_penalty=1.0), [], [])])
    logits = torch.tensor([[0.0, 0.1, 0.2, 0.3, 0.4, 0.5]]).expand(2, 6).clone()  # near uniform
    drawn = [_chosen(lp.apply(logits.clone())) for _ in range(200)]
    assert {d[0] for d in drawn} == set(range(6)) and {d[1] for d in drawn} == {3, 4, 5}


def test_rows_of_other_requests_are_left_alone_and_state_moves_with_the_request():
    vocab = 12
    lp = OmniSampler(_config(4, vocab), torch.device("cpu"), False)
    plain = SamplingParams(temperature=0.5)
    _add(lp, 3, [(0, plain, [1], []), (1, _params(temperature=1.0, top_k=1, repetition_penalty=9.0), [4], []),
                 (2, _params(temperature=1.0, top_k=1, repetition_penalty=9.0), [6], [])])
    logits = torch.arange(vocab, dtype=torch.float32).flip(0).expand(3, vocab).clone()  # 0 best, 11 worst
    logits[:, 4], logits[:, 6] = 20.0, 19.0  # 4 leads, then 6
    out = lp.apply(logits.clone())
    assert torch.equal(out[0], logits[0])
    assert _chosen(out[1:]) == [6, 4]  # row 1 saw 4, row 2 saw 6
    # Row 0 finishes; vLLM moves row 2 into its place: row 2's seen tokens go with it.
    _add(lp, 2, [], removed=[0], moved=[(2, 0, MoveDirectionality.UNIDIRECTIONAL)])
    assert _chosen(lp.apply(logits[:2].clone())) == [4, 6]
    _add(lp, 2, [], moved=[(0, 1, MoveDirectionality.SWAP)])
    assert _chosen(lp.apply(logits[:2].clone())) == [6, 4]
    # A new request in a freed row starts from its own prompt.
    _add(lp, 2, [(0, _params(temperature=1.0, top_k=1, repetition_penalty=9.0), [], [])], removed=[0])
    assert _chosen(lp.apply(logits[:2].clone())) == [4, 4]


def test_seeded_requests_repeat_and_differ_by_seed():
    """A seeded request's draws depend on its seed and output position only: the same on any row,
    and the same when vLLM takes the request out of the batch for a while (not scheduled) and adds it
    back; another seed draws otherwise."""
    vocab, rows, steps = 64, 3, 8
    logits = torch.zeros(rows, vocab)  # uniform over the top 40: seeds decide

    def run(seeds, hold_at=None):
        lp = OmniSampler(_config(rows, vocab), torch.device("cpu"), False)
        outputs = [[] for _ in seeds]
        params = [_params(top_p=1.0, repetition_penalty=1.0, seed=s) for s in seeds]
        _add(lp, rows, [(i, params[i], [], outputs[i]) for i in range(rows)])
        for step in range(steps):
            if step == hold_at:  # row 0 sits out a step (the others' draws go on), then comes back
                _add(lp, rows - 1, [], removed=[0], moved=[(2, 0, MoveDirectionality.UNIDIRECTIONAL)])
                for i, t in zip((2, 1), _chosen(lp.apply(logits[:2].clone()))):
                    outputs[i].append(t)
                _add(lp, rows, [(2, params[0], [], outputs[0])], moved=[(0, 2, MoveDirectionality.SWAP)])
            for i, t in enumerate(_chosen(lp.apply(logits.clone()))):
                outputs[i].append(t)
        return outputs

    a = run([11, 12, 11])
    assert a == run([11, 12, 11])
    assert a[0] == a[2] != a[1]  # same seed, same draws, whatever the row
    held = run([11, 12, 11], hold_at=3)
    assert held[0] == a[0]  # as if it had never left
    assert len(held[2]) == steps + 1 and held[2][:steps] == a[2]  # a step more meanwhile, same stream


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs exist on CUDA only")
def test_no_step_waits_for_the_gpu():
    """Every batch change and step runs without a host sync (PyTorch's sync debug mode raises on
    one): a stage queues its steps ahead on the GPU, and one sync per step cost more than the
    sampler saves (an advanced-index assignment of the seen mask did: 1.2 ms per step)."""
    vocab, rows, dev = 64, 4, torch.device("cuda")
    lp = OmniSampler(_config(rows, vocab), dev, True)
    outputs = [[] for _ in range(rows)]
    logits = torch.randn(rows, vocab, device=dev)
    plain = SamplingParams(temperature=0.5)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _add(lp, 3, [(0, _params(seed=3), [1, 2], outputs[0]), (1, plain, [1], outputs[1]),
                     (2, _params(top_k=5, top_p=1.0), [7, 8, 9], outputs[2])])
        for step in range(6):
            lp.apply(logits[:3].clone())
            for out in outputs[:3]:
                out.append(step)
            if step == 2:
                _add(lp, 3, [], moved=[(0, 2, MoveDirectionality.SWAP)])
            if step == 4:  # a row leaves: rows 0 and 1 remain, one of them vLLM's
                _add(lp, 2, [], removed=[0], moved=[(2, 0, MoveDirectionality.UNIDIRECTIONAL)])
                _add(lp, 3, [(2, _params(repetition_penalty=1.2), [5], outputs[3])])
        out = lp.apply(logits[:3].clone())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out[1], logits[1])  # vLLM's row untouched
    _chosen(out[[0, 2]])


def test_who_samples_and_what_vllm_sees():
    assert takes(0.9, 40) and takes(1e-3, 1)
    assert not takes(0.0, 40) and not takes(0.9, 0) and not takes(0.9, 5000)
    assert not takes(0.9, 40, presence_penalty=0.5) and not takes(0.9, 40, frequency_penalty=-0.1)
    given, spec = vllm_params(0.9, 40, 0.8, 1.05, 7)
    params = SamplingParams(**given, extra_args={SPEC: spec})
    assert (params.temperature, params.top_k, params.repetition_penalty, params.seed) == (0.0, 0, 1.0, None)
    assert requested(params) == (0.9, 7)  # what the request asked (the Qwen3 code predictor samples by it)
    assert requested(SamplingParams(temperature=0.7, seed=3)) == (0.7, 3)
    # Whether vLLM must hand the stage's logits processors token values (it waits for them).
    assert not reads_output_tokens([LOGITS_PROCESSOR]) and not reads_output_tokens(None)
    assert reads_output_tokens([LOGITS_PROCESSOR, "some.module:Other"])


@pytest.mark.parametrize("sampler,top_k,expected", [("auto", 40, True), ("auto", None, False), ("vllm", 40, False),
                                                    ("omni", None, True)])
def test_stage_option(sampler, top_k, expected):
    from omni_server.config.schema import StageConfig

    stage = StageConfig(id=0, name="s", model="m", sampler=sampler, default_sampling={"top_k": top_k})
    assert stage.omni_sampler is expected


ENGINE_SCRIPT = r"""
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from omni_server.stage.sampling import LOGITS_PROCESSOR, SPEC, vllm_params

llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=8,
          gpu_memory_utilization=0.05, enable_prefix_caching=False, logits_processors=[LOGITS_PROCESSOR])
common = dict(max_tokens=24, ignore_eos=True, detokenize=False)

def ours(*args):
    given, spec = vllm_params(*args)
    return SamplingParams(**common, **given, extra_args={SPEC: spec})

params = [ours(1.0, 1, 1.0, 50.0, None), SamplingParams(**common, temperature=1.0, top_k=1, repetition_penalty=50.0),
          SamplingParams(**common, temperature=0.0), ours(0.9, 40, 0.8, 1.05, 5), ours(0.9, 40, 0.8, 1.05, 5),
          ours(0.9, 40, 0.8, 1.05, 6)]
prompt = TokensPrompt(prompt_token_ids=[11, 12, 13, 14, 15, 16, 17, 18])
outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def test_in_a_vllm_engine_it_matches_vllm_sampling(tiny_models):
    """In one batch of a real engine: our top-1 with a repetition penalty draws what vLLM's own
    sampler draws with the same settings (and not what greedy without it does); a seed repeats."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCHDYNAMO_DISABLE": "1",
           "VLLM_USE_V2_MODEL_RUNNER": "0"}
    proc = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, str(tiny_models["tiny-embeds-lm"])], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("TOKENS "))
    penalised, vllms, greedy, seed5, seed5_again, seed6 = json.loads(line[7:])
    assert penalised == vllms
    assert penalised != greedy
    assert len(set(penalised)) == len(penalised)  # a penalty of 50 leaves no seen token a chance here
    assert seed5 == seed5_again != seed6


RUNNER_SCRIPT = r"""
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from omni_server.stage.sampling import LOGITS_PROCESSOR, SPEC, vllm_params

llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=256, max_num_seqs=4, gpu_memory_utilization=0.1,
          enable_prefix_caching=False, logits_processors=[LOGITS_PROCESSOR],
          worker_cls="omni_server.stage.gpu_worker.GPUOmniWorker")
given, spec = vllm_params(1.0, 1, 1.0, 50.0, None)
params = SamplingParams(max_tokens=24, ignore_eos=True, detokenize=False, **given, extra_args={SPEC: spec})
out = llm.generate([TokensPrompt(prompt_token_ids=[11, 12, 13, 14])] * 2, params, use_tqdm=False)
flags = llm.collective_rpc(lambda self: (self.model_runner.input_batch.logitsprocs_need_output_token_ids,
                                         self.model_runner.use_async_scheduling))
print("RESULT " + json.dumps({"flags": flags, "tokens": [list(o.outputs[0].token_ids) for o in out]}))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="our GPU model runner needs CUDA")
def test_our_gpu_runner_hands_the_sampler_no_token_values(tiny_models):
    """With ours the only custom logits processor, our GPU runner tells vLLM's batch that no token
    values are needed (vLLM then does not wait for each step's tokens under async scheduling), and
    the repetition penalty still sees every kept draw (penalty 50 at top-1: no token repeats)."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_V2_MODEL_RUNNER": "0"}
    proc = subprocess.run([sys.executable, "-c", RUNNER_SCRIPT, str(tiny_models["tiny-embeds-lm"])], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[7:])
    assert result["flags"] == [[False, True]]  # no token values handed out; async scheduling on
    for tokens in result["tokens"]:
        assert len(set(tokens)) == len(tokens) == 24
