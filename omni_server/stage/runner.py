"""Model runners that also emit per-request final hidden states.

They subclass vLLM's V1 runners (GPUModelRunner, and CPUModelRunner which derives from it) and only
wrap `sample_tokens`: the forward pass and CUDA graphs are untouched. Rows are emitted only for
requests flagged with EMIT_HIDDEN (those with a downstream stage), as a HiddenCapture attached to
the step's ModelRunnerOutput as `omni_hidden` (the OmniScheduler takes it off). With prefix caching
every computed row is also kept at its KV slot (`prefix_rows`), so a request that starts on a cache
hit still emits its whole prompt.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch
from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from omni_server.stage import prefix_rows
from omni_server.stage.hidden import EMIT_HIDDEN, MROPE_POSITIONS, STEP_EMBEDS, HiddenCapture
from omni_server.stage.sampling import reads_output_tokens, requested
from omni_server.stage.transfer import host_index, receive, to_device


class _AsyncWithHidden(AsyncModelRunnerOutput):
    """Async-scheduling output: attach the capture when vLLM resolves the step's output."""

    def __init__(self, inner: AsyncModelRunnerOutput, capture: HiddenCapture):
        self._inner = inner
        self._capture = capture

    def get_output(self) -> ModelRunnerOutput:
        out = self._inner.get_output()
        out.omni_hidden = self._capture
        return out


class HiddenStatesEmitter:
    """Mixin over a vLLM V1 model runner; must precede the runner class in the MRO."""

    _copy_stream: torch.cuda.Stream | None = None
    _emit_aux = False  # the model's emitted rows are its auxiliary output, not the final states
    _prefix_rows: prefix_rows.PrefixRows | None = None

    def load_model(self, *args, **kwargs):
        super().load_model(*args, **kwargs)
        # A model whose consumers read an intermediate layer names it (`emitted_hidden_layer`) and
        # returns it as an auxiliary output, vLLM's EAGLE-3 mechanism (unused by our stages otherwise).
        model = self.get_model()
        layer = getattr(model, "emitted_hidden_layer", None)
        if layer is not None and not self.use_aux_hidden_state_outputs:
            model.set_aux_hidden_state_layers((layer,))
            self.use_aux_hidden_state_outputs = self._emit_aux = True

    def initialize_kv_cache(self, kv_cache_config, is_profiling: bool = False):
        super().initialize_kv_cache(kv_cache_config, is_profiling)
        if not is_profiling and prefix_rows.wanted(self.vllm_config):
            self._prefix_rows = prefix_rows.PrefixRows(kv_cache_config, self.model_config.get_hidden_size(),
                                                       self.dtype, self.device)

    def sample_tokens(self, grammar_output):
        state = self.execute_model_state
        if state is None or self.speculative_config is not None:
            return super().sample_tokens(grammar_output)
        hidden = state.aux_hidden_states[0] if self._emit_aux else state.hidden_states
        if self._prefix_rows is not None:
            # Every request's rows, not only emitting ones: a later request may start on any
            # block. Queued on the compute stream before the next step rebuilds the slot mapping.
            n = state.scheduler_output.total_num_scheduled_tokens
            self._prefix_rows.write(self.input_batch.block_table[0].slot_mapping.gpu[:n], hidden[:n])
        picks, everything = self._select_rows(state.scheduler_output)
        if not picks:
            return super().sample_tokens(grammar_output)
        # (request, offset in the step's rows, rows this step, first position, cached positions before it)
        req_ids = [rid for rid, *_ in picks]
        counts = [n + cached for _, _, n, _, cached in picks]
        starts = [start - cached for _, _, _, start, cached in picks]
        positions = {}
        if self.uses_mrope:
            for rid, start in zip(req_ids, starts):
                mrope = self.requests[rid].mrope_positions
                if start == 0 and mrope is not None:
                    positions[rid] = mrope[:, : len(self.requests[rid].prompt_token_ids or ())].clone()
        # A private copy of the rows, enqueued before sampling on the compute stream.
        if any(cached for *_, cached in picks):
            parts = []
            for rid, offset, n, _, cached in picks:
                if cached:  # a cache hit: the prefix's rows from its blocks' slots
                    parts.append(self._prefix_rows.read(self.requests[rid].block_ids[0], cached))
                parts.append(hidden[offset: offset + n])
            rows = torch.cat(parts)
        elif everything:
            rows = hidden[: sum(counts)].clone()
        else:
            idx = np.concatenate([np.arange(offset, offset + n) for _, offset, n, _, _ in picks])
            rows = hidden[to_device(torch.from_numpy(idx), self.device)]  # (pageable memory would sync the stream)
        ready = None
        if rows.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        out = super().sample_tokens(grammar_output)
        capture = self._to_host(req_ids, counts, starts, rows, ready)
        capture.positions = positions
        if isinstance(out, ModelRunnerOutput):
            out.omni_hidden = capture
            return out
        if isinstance(out, AsyncModelRunnerOutput):
            return _AsyncWithHidden(out, capture)
        return out

    def _select_rows(self, scheduler_output):
        """The step's emitting requests as (request, offset, rows, first position, cached positions:
        a new request's prefix cache hit), and whether they are all of the step's requests."""
        num_sched = scheduler_output.num_scheduled_tokens
        new = {r.req_id for r in scheduler_output.scheduled_new_reqs} if self._prefix_rows is not None else ()
        picks = []
        offset = 0
        everything = True
        for i, rid in enumerate(self.input_batch.req_ids):
            n = num_sched.get(rid, 0)
            if n == 0:
                continue
            params = self.requests[rid].sampling_params
            extra = params.extra_args if params is not None else None
            if extra and extra.get(EMIT_HIDDEN):
                start = int(self.input_batch.num_computed_tokens_cpu[i])
                picks.append((rid, offset, n, start, start if rid in new else 0))
            else:
                everything = False
            offset += n
        return picks, everything

    def _to_host(self, req_ids, counts, starts, rows: torch.Tensor, ready) -> HiddenCapture:
        if ready is None:
            return HiddenCapture(req_ids, counts, starts, rows)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream()
        stream = self._copy_stream
        # Wait only for the gather, not for sampling: the copy overlaps the sampler.
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            host.copy_(rows, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        # `rows` was allocated on the compute stream; keep it alive until the side-stream copy ends.
        rows.record_stream(stream)
        return HiddenCapture(req_ids, counts, starts, host, event)


class _AsyncWithFrames(AsyncModelRunnerOutput):
    def __init__(self, inner: AsyncModelRunnerOutput, frames: dict):
        self._inner, self._frames = inner, frames

    def get_output(self) -> ModelRunnerOutput:
        out = self._inner.get_output()
        out.omni_frames = self._frames
        return out


class StepPredictor:
    """Mixin over a vLLM V1 model runner for models that complete each sampled token into a frame
    (a talker with a code predictor). Such a model defines

        predict_step(hidden [B, H], token_embeds [B, H], generators) -> (codes [B, G], input_add [B, H])

    When output token k is fed back, the model predicts the rest of its frame from the final hidden
    state that produced it; `input_add` (float32) joins the token's input embedding, rounded once
    (before the forward, outside CUDA graphs, and before StepEmbedsAdder's rows: the mixin order),
    and [token, *codes] is that step's frame for the request
    (`ModelRunnerOutput.omni_frames`: {req_id: (k, frame)}). A request that is recomputed after
    preemption gets the same additions again. `generators`: None per greedy request, else its own
    seeded generator (sampling requests)."""

    def _predict_state(self) -> dict:
        return self.__dict__.setdefault("_predict", {"hidden": {}, "added": {}, "gen": {}})

    def _update_states(self, scheduler_output):
        result = super()._update_states(scheduler_output)
        st = self._predict_state()
        for rid in scheduler_output.finished_req_ids:
            for table in st.values():
                table.pop(rid, None)
        return result

    def sample_tokens(self, grammar_output):
        state = self.execute_model_state
        if state is not None and getattr(self.get_model(), "predict_step", None) is not None:
            # The row that samples each request's next token: its h for that token's frame. One
            # private copy per step (vLLM reuses its buffers); requests keep (copy, row).
            rows = state.sample_hidden_states.clone()
            hidden = self._predict_state()["hidden"]
            for i, rid in enumerate(self.input_batch.req_ids[: rows.shape[0]]):
                hidden[rid] = (rows, i)
        out = super().sample_tokens(grammar_output)
        frames = self.__dict__.pop("_frames_now", None)
        if frames:
            if isinstance(out, AsyncModelRunnerOutput):
                return _AsyncWithFrames(out, frames)
            if isinstance(out, ModelRunnerOutput):
                out.omni_frames = frames
        return out

    def _preprocess(self, scheduler_output, num_input_tokens, intermediate_tensors=None):
        result = super()._preprocess(scheduler_output, num_input_tokens, intermediate_tensors)
        inputs_embeds = result[1]
        model = self.get_model()
        predict = getattr(model, "predict_step", None)
        if predict is None or inputs_embeds is None:
            return result
        st = self._predict_state()
        num_sched = scheduler_output.num_scheduled_tokens
        batch = self.input_batch
        rows, rids, ks, hs = [], [], [], []
        offset = 0
        for i, rid in enumerate(batch.req_ids):
            n = num_sched.get(rid, 0)
            start, prompt_len = int(batch.num_computed_tokens_cpu[i]), int(batch.num_prompt_tokens[i])
            added = st["added"].setdefault(rid, [])
            for pos in range(max(start, prompt_len), start + n):
                k = pos - prompt_len  # output token k is fed at this position
                row = offset + pos - start
                if k < len(added):  # recomputed after preemption: the same addition again
                    inputs_embeds[row] = (inputs_embeds[row].float() + added[k]).to(inputs_embeds.dtype)
                elif k == len(added) and rid in st["hidden"]:
                    step_rows, i_row = st["hidden"][rid]
                    rows.append(row), rids.append(rid), ks.append(k), hs.append(step_rows[i_row])
            offset += n
        if not rows:
            return result
        index = host_index(rows, inputs_embeds.device)
        tokens = self.input_ids.gpu[index]
        gens = [self._predict_generator(rid) for rid in rids]
        codes, add = predict(torch.stack(hs), model.embed_input_ids(tokens), gens)
        # (`add` is float32: the token's embedding plus it rounds once, as the reference's sum of
        # the frame's embeddings does; the step rows of StepEmbedsAdder come after, as its do.)
        inputs_embeds[index] = (inputs_embeds[index].float() + add).to(inputs_embeds.dtype)
        # Copied behind the queued work (into pinned memory, on CUDA) rather than waiting for it
        # here: the frames are read when this step's output is, which comes later in the stream.
        frames = torch.cat([tokens[:, None].to(codes.dtype), codes], dim=1).to("cpu", non_blocking=True)
        now = self.__dict__.setdefault("_frames_now", {})
        for j, (rid, k) in enumerate(zip(rids, ks)):
            st["added"][rid].append(add[j])
            now[rid] = (k, frames[j])
        return result

    def _predict_generator(self, rid: str):
        st = self._predict_state()["gen"]
        if rid not in st:
            # As the request asked, also when our sampler draws its tokens (vLLM then sees greedy).
            temperature, seed = requested(self.requests[rid].sampling_params)
            if temperature == 0:
                st[rid] = None
            else:
                g = torch.Generator(device=self.device)
                # Unseeded requests draw a fresh seed without touching the global RNG.
                g.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(7), "little"))
                st[rid] = g
        return st[rid]


class UpstreamPositions:
    """Mixin over a vLLM V1 model runner of an M-RoPE model fed by an upstream stage: a request that
    brings its prompt positions (SamplingParams.extra_args[MROPE_POSITIONS], [3, prompt_len]) uses
    them; later positions continue 1-D after their maximum, as for text. Others get the model's own."""

    def _init_mrope_positions(self, req_state):
        params = req_state.sampling_params
        given = params.extra_args.get(MROPE_POSITIONS) if params is not None and params.extra_args else None
        if given is None:
            return super()._init_mrope_positions(req_state)
        positions = torch.as_tensor(given, dtype=torch.int64)
        req_state.mrope_positions = positions
        req_state.mrope_position_delta = int(positions.max()) + 1 - positions.shape[1]


class StepEmbedsAdder:
    """Mixin over a vLLM V1 model runner: adds each request's per-step embeddings (sent with the
    request as SamplingParams.extra_args[STEP_EMBEDS], [rows, hidden]) to the input embedding of
    its output tokens: output token k gets row min(k, rows - 1). The add happens on vLLM's input
    embedding buffer before the forward, outside any CUDA graph. Rows of a streamed input arrive
    later, attached to a scheduler output (`omni_step_embeds`; the stage's scheduler holds a request
    back until the row its next step needs is here)."""

    def _update_states(self, scheduler_output):
        result = super()._update_states(scheduler_output)
        cache = self.__dict__.setdefault("_step_embeds", {})
        more = self.__dict__.setdefault("_step_embeds_more", {})
        for rid in scheduler_output.finished_req_ids:
            cache.pop(rid, None)
            more.pop(rid, None)
        for new in scheduler_output.scheduled_new_reqs:
            extra = new.sampling_params.extra_args if new.sampling_params is not None else None
            host = extra.get(STEP_EMBEDS) if extra else None
            if host is not None:
                # (Later rows may be on the device already, received below.)
                cache[new.req_id] = torch.cat([to_device(r, self.device, self.dtype)
                                               for r in (host, *more.pop(new.req_id, []))])
        for rid, chunks in (getattr(scheduler_output, "omni_step_embeds", None) or {}).items():
            for rows, ready in chunks:
                rows = receive(rows, ready)  # device rows: the model's stream waits for them on the GPU
                if rid in cache:
                    old = cache[rid]
                    cache[rid] = torch.cat([old, to_device(rows, old.device, old.dtype)])
                else:  # its request is not scheduled yet: joined to its first rows then
                    more.setdefault(rid, []).append(rows)
        return result

    def _preprocess(self, scheduler_output, num_input_tokens, intermediate_tensors=None):
        result = super()._preprocess(scheduler_output, num_input_tokens, intermediate_tensors)
        inputs_embeds = result[1]
        cache = self.__dict__.get("_step_embeds")
        if not cache or inputs_embeds is None:  # stages without per-step inputs pay nothing here
            return result
        num_sched = scheduler_output.num_scheduled_tokens
        batch = self.input_batch
        offset = 0
        # Decode steps (one output position each) are added in one kernel for the whole batch.
        dst_rows, src_rows = [], []
        for i, rid in enumerate(batch.req_ids):
            n = num_sched.get(rid, 0)
            rows = cache.get(rid)
            if n and rows is not None and len(rows):
                start = int(batch.num_computed_tokens_cpu[i])
                prompt_len = int(batch.num_prompt_tokens[i])
                first = max(start, prompt_len)
                if first < start + n:
                    k = first - prompt_len
                    if start + n - first == 1:
                        dst_rows.append(offset + first - start)
                        src_rows.append(rows[min(k, len(rows) - 1)])
                    else:
                        dst = inputs_embeds[offset + first - start: offset + n]
                        ks = torch.arange(k, k + len(dst), device=rows.device).clamp_(max=len(rows) - 1)
                        dst += rows[ks]
            offset += n
        if len(dst_rows) == 1:  # (one request: one add, no index to send to the device)
            inputs_embeds[dst_rows[0]].add_(src_rows[0])
        elif dst_rows:
            inputs_embeds.index_add_(0, host_index(dst_rows, inputs_embeds.device), torch.stack(src_rows))
        return result


class GPUOmniModelRunner(UpstreamPositions, StepEmbedsAdder, StepPredictor, HiddenStatesEmitter, GPUModelRunner):
    capture_s = 0.0  # how long vLLM's CUDA graph capture took (the worker logs its warm-up phases)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # vLLM takes any custom logits processor to read output token values, and with async
        # scheduling then waits before each step's sampling for the last step's tokens to reach
        # the host (a talker on an H200 at c=16: 36% of its loop's time). Ours reads none; with
        # only ours, the batch hands out no token values (re-created batches copy the flag).
        if not reads_output_tokens(self.model_config.logits_processors):
            self.input_batch.logitsprocs_need_output_token_ids = False

    def capture_model(self) -> int:
        t0 = time.monotonic()
        try:
            return super().capture_model()
        finally:
            self.capture_s = time.monotonic() - t0
