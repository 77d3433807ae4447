"""Top-k sampling inside vLLM's logits pass, for requests vLLM then samples greedily.

A talker samples every codec token with temperature, top-k, top-p and a repetition penalty, one
token per step at a few ms per step, so the sampler's host work counts. vLLM's sampler rebuilds the
penalty's token counts from every request's Python token list each step (a [batch, longest output]
tensor, then vocab-sized bins) and sorts the whole vocabulary for top-k / top-p. Here, per step:
the repetition penalty reads a seen-token mask kept on the device (each step adds only the new
tokens), top-k comes first (torch.topk), top-p works on those k, and the token is drawn by the same
exponential race as vLLM's. The row leaves as one-hot logits (0 at the token, -inf elsewhere), and
the request, given to vLLM as greedy (temperature 0, no penalty), takes that token.

The order and the distribution are transformers' (repetition penalty over prompt and output
tokens, temperature, top-k, top-p): tests/test_sampling.py compares them.

Registered as a vLLM logits processor (its extension point), on stages that use it only. Each
drawn token joins its request's seen mask on the device at the next step (the request's output list
grew: vLLM kept the token), so the sampler never reads token values from the host, and our model
runner tells vLLM so (`reads_output_tokens`): vLLM otherwise waits, before every step's sampling,
for the previous step's tokens to reach the host for a custom logits processor.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from omni_server.stage.transfer import to_device

# SamplingParams.extra_args key: [temperature, top_k, top_p, repetition_penalty, seed or None].
SPEC = "omni_sampling"
# Above this many candidates a full sort is no worse than top-k; vLLM samples such requests.
MAX_TOP_K = 1024
LOGITS_PROCESSOR = "omni_server.stage.sampling:OmniSampler"
_EPS = 1e-5  # vLLM's: a lower temperature is greedy
_MIX = 0x9E3779B97F4A7C15  # spreads (seed, position) pairs over generator seeds


def takes(temperature: float, top_k: int, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
          logprobs: int | None = None) -> bool:
    """Whether this sampler draws a request's tokens (otherwise vLLM does: also for OpenAI's
    presence / frequency penalties, which this one does not apply, and for logprobs)."""
    return (temperature >= _EPS and 0 < top_k <= MAX_TOP_K and not presence_penalty and not frequency_penalty
            and logprobs is None)


def vllm_params(temperature: float, top_k: int, top_p: float, repetition_penalty: float,
                seed: int | None) -> tuple[dict[str, Any], list]:
    """SamplingParams fields for a request this sampler takes (vLLM: greedy, no penalty) and its
    extra_args entry."""
    given = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0, "seed": None}
    return given, [float(temperature), int(top_k), float(top_p), float(repetition_penalty), seed]


def requested(params) -> tuple[float, int | None]:
    """(temperature, seed) a request asked for, whichever sampler draws its tokens."""
    spec = params.extra_args.get(SPEC) if params is not None and params.extra_args else None
    if spec is not None:
        return spec[0], spec[4]
    if params is None:
        return 0.0, None
    return params.temperature, params.seed


def candidates(logits: torch.Tensor, seen: torch.Tensor | None, penalty: torch.Tensor | None,
               temperature: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
               k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The distribution each row samples from: (probs [n, k] unnormalised, token ids [n, k]).

    logits [n, V] float32; seen [n, V] bool (prompt and output tokens so far) with penalty [n];
    temperature [n]; top_k [n] int (None: every row k); top_p [n] (None: 1); k = max top_k."""
    x = logits
    if penalty is not None:
        p = penalty[:, None]
        x = torch.where(seen, torch.where(x > 0, x / p, x * p), x)
    x = x / temperature[:, None]
    vals, ids = x.topk(k, dim=-1)  # sorted, largest first
    if top_k is not None:
        col = torch.arange(k, device=x.device)
        vals = vals.masked_fill(col[None, :] >= top_k[:, None], float("-inf"))
    probs = vals.softmax(dim=-1)
    if top_p is not None:
        # Keep the smallest prefix reaching top_p: a token stays if the mass before it is short of it.
        probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= top_p[:, None], 0.0)
    return probs, ids


def reads_output_tokens(logits_processors) -> bool:
    """Whether a stage's custom logits processors need the values of the output tokens on the host
    (vLLM assumes any custom one does); this sampler does not."""
    return any(p not in (LOGITS_PROCESSOR, OmniSampler) for p in logits_processors or ())


class _Req:
    __slots__ = ("temperature", "top_k", "top_p", "penalty", "seed", "outputs", "listed", "tail", "position",
                 "last")

    def __init__(self, spec: list, outputs: list[int]):
        self.temperature, self.top_k, self.top_p, self.penalty, self.seed = spec
        # vLLM's live list of the request's output tokens: one more after each step whose token it
        # kept (under async scheduling a -1 placeholder that nobody fills in for us; see `_account`).
        self.outputs = outputs
        self.listed = len(outputs)  # its length at the last step
        self.tail = outputs[-1] if outputs else None  # and its last entry then
        self.position = len(outputs)  # output tokens kept so far: the index of the one drawn next
        self.last: int | None = None  # its row in the last step's drawn tokens


class _Layout(NamedTuple):
    """The batch's sampled rows and their settings as device tensors (rebuilt when the batch changes)."""

    rows: list[int]  # batch rows drawn here, ascending
    reqs: list[_Req]
    index: torch.Tensor | None  # those rows on the device; None: every row of the batch
    k: int  # the largest top-k
    top_k: torch.Tensor | None  # per row; None: all k
    top_p: torch.Tensor | None  # None: all 1
    penalty: torch.Tensor | None  # None: no row penalised
    temperature: torch.Tensor
    seeded: list[tuple[int, _Req]]  # (position in rows, request) of seeded requests
    # rows * vocab on the device, for the penalised rows (None: penalty) when every row is
    # penalised: the usual step marks last step's tokens with one add and one fill.
    flat_rows: torch.Tensor | None


class OmniSampler(LogitsProcessor):
    """Samples the requests whose SamplingParams.extra_args carry SPEC; leaves other rows alone."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.device = torch.device(device)
        self.vocab = vllm_config.model_config.get_vocab_size()
        self.max_rows = vllm_config.scheduler_config.max_num_seqs
        self.reqs: dict[int, _Req] = {}  # batch row -> request
        self.seen: torch.Tensor | None = None  # [max_rows, vocab] bool, allocated on first use
        self._layout: _Layout | None = None
        self._gen = torch.Generator(device=self.device)  # seeded requests' draws
        self._drawn: torch.Tensor | None = None  # the last step's tokens, [rows drawn], on the device

    def is_argmax_invariant(self) -> bool:
        return False  # it chooses the token

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for row in batch_update.removed:
            self.reqs.pop(row, None)
        for row, params, prompt, outputs in batch_update.added:
            spec = params.extra_args.get(SPEC) if params is not None and params.extra_args else None
            if spec is None:
                self.reqs.pop(row, None)
                continue
            req = self.reqs[row] = _Req(spec, outputs)
            if req.penalty != 1.0:
                # (A request added back after a pause brings its output tokens as values.)
                self._reset_seen(row, [*(prompt or ()), *(t for t in outputs if t >= 0)])
        for a, b, how in batch_update.moved:
            ra, rb = self.reqs.pop(a, None), self.reqs.pop(b, None)
            if ra is not None:
                self.reqs[b] = ra
            if how == MoveDirectionality.SWAP and rb is not None:
                self.reqs[a] = rb
            if self.seen is not None:
                if how == MoveDirectionality.SWAP:  # (indices via pinned memory: no stall of the GPU queue)
                    self.seen.index_copy_(0, self._to_device([a, b]), self.seen[self._to_device([b, a])])
                else:
                    self.seen[b] = self.seen[a]
        self._layout = None

    def _reset_seen(self, row: int, tokens: list[int]) -> None:
        if self.seen is None:
            self.seen = torch.zeros(self.max_rows, self.vocab, dtype=torch.bool, device=self.device)
        self.seen[row] = False
        self._mark([row * self.vocab + t for t in tokens if 0 <= t < self.vocab])

    def _mark(self, flat: list[int]) -> None:
        """Set seen[i // vocab, i % vocab] for each i. (Not `seen[rows, cols] = True`: an advanced
        index assignment copies its Python value from pageable memory, which waits for the queued
        steps: 1.2 ms per step on an H200, more than this sampler saves.)"""
        if flat:
            self.seen.view(-1).index_fill_(0, self._to_device(flat), True)

    def _to_device(self, values: list, dtype=torch.long) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=dtype), self.device)  # (behind the queued steps)

    def _build_layout(self, n_rows: int) -> _Layout:
        rows = sorted(self.reqs)
        reqs = [self.reqs[r] for r in rows]
        whole = rows == list(range(n_rows))
        index = None if whole else self._to_device(rows)
        k = max(r.top_k for r in reqs)
        top_k = None if all(r.top_k == k for r in reqs) else self._to_device([r.top_k for r in reqs])
        top_p = None if all(r.top_p >= 1.0 for r in reqs) else self._to_device([r.top_p for r in reqs], torch.float32)
        penalized = any(r.penalty != 1.0 for r in reqs)
        penalty = self._to_device([r.penalty for r in reqs], torch.float32) if penalized else None
        temperature = self._to_device([r.temperature for r in reqs], torch.float32)
        seeded = [(i, r) for i, r in enumerate(reqs) if r.seed is not None]
        every = all(r.penalty != 1.0 for r in reqs)
        flat_rows = self._to_device([r * self.vocab for r in rows]) if penalized and every else None
        return _Layout(rows, reqs, index, k, top_k, top_p, penalty, temperature, seeded, flat_rows)

    def _account(self, lay: _Layout) -> None:
        """Count the tokens vLLM kept from the last step's draws (a request's output list grew by
        one) and add the penalised requests' kept draws to the seen mask, from the device.

        vLLM fills in a request's -1 placeholders only while some request in the batch needs token
        values (its own penalties, bad words), and then folds a run of unfilled ones into the one
        token it fills: the list shrinks, its last entry turns real, and that step's draw was
        kept (a discarded draw, of a prompt prefilled in chunks, leaves the list as it was)."""
        usual = lay.flat_rows is not None and self._drawn is not None and len(self._drawn) == len(lay.rows)
        rows, drawn_at = [], []
        for i, (row, req) in enumerate(zip(lay.rows, lay.reqs)):
            out, last = req.outputs, req.last
            n = len(out)
            folded = 0 < n <= req.listed and req.tail is not None and req.tail < 0 and out[-1] >= 0
            kept = n > req.listed or folded
            req.listed, req.tail, req.last = n, (out[-1] if n else None), None
            if not kept:
                usual = False
                continue
            req.position += 1
            if req.penalty == 1.0:
                continue  # (then flat_rows is None: not the usual path)
            if last is not None:
                usual &= last == i
                rows.append(row), drawn_at.append(last)
            else:  # (not drawn here: its token as a value, if it is one)
                usual = False
                if 0 <= out[-1] < self.vocab:
                    self._mark([row * self.vocab + out[-1]])
        if not rows:
            return
        if usual:  # every row kept its token and none moved: no index to send
            flat = lay.flat_rows + self._drawn
        else:
            flat = self._to_device([r * self.vocab for r in rows]) + self._drawn[self._to_device(drawn_at)]
        self.seen.view(-1).index_fill_(0, flat, True)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.reqs:
            return logits
        if self._layout is None:
            self._layout = self._build_layout(logits.shape[0])
        lay = self._layout
        self._account(lay)
        seen = None
        if lay.penalty is not None:
            v = logits.shape[1]
            seen = self.seen[: len(lay.rows), :v] if lay.index is None else self.seen[lay.index, :v]
        x = logits if lay.index is None else logits[lay.index]
        probs, ids = candidates(x, seen, lay.penalty, lay.temperature, lay.top_k, lay.top_p, min(lay.k, x.shape[1]))
        q = torch.empty_like(probs)
        q.exponential_()
        for i, req in lay.seeded:
            # A seeded draw depends on (seed, output position) only: vLLM drops a request from the
            # batch while it is not scheduled (a talker waiting for input) and adds it back, and a
            # recomputed one draws the same again.
            self._gen.manual_seed((req.seed * _MIX + req.position) % 2**63)
            q[i].exponential_(generator=self._gen)
        token = ids.gather(1, probs.div_(q).argmax(dim=-1, keepdim=True))
        self._drawn = token.view(-1)
        for i, req in enumerate(lay.reqs):
            req.last = i
        chosen = torch.full_like(x, float("-inf")).scatter_(1, token, 0.0)
        if lay.index is None:
            return chosen
        return logits.index_copy_(0, lay.index, chosen)
