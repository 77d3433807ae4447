"""omni_server/stage/transfer.py: request-side transfers and device work that never wait for the
model's queued GPU steps (CUDA), and are plain copies elsewhere."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from omni_server.models.checkpoint import read_config
from omni_server.stage import processors
from omni_server.stage.transfer import aside, handoff, host_index, receive, to_device
from omni_server.wire.messages import StagePayload

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")


def test_host_side_copies_on_cpu():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    out = to_device(t, torch.device("cpu"), torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out.float(), t)
    assert torch.equal(host_index([3, 1, 2], torch.device("cpu")), torch.tensor([3, 1, 2]))
    with aside(torch.device("cpu")):  # nothing to do off a GPU
        assert torch.equal((t * 2).cpu(), t + t)
    assert handoff(t) == (t, None) and receive(t, None) is t


def _busy_stream() -> None:
    """Queue ~1 s of GPU time on the current stream (the model's, in a stage process). The calls
    under test run once before it: a first use may grow the caching allocators (cudaMalloc,
    cudaHostAlloc), which synchronise the device; a serving process pays that once."""
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)
    assert not torch.cuda.current_stream().query()


@cuda
def test_copies_in_do_not_wait_for_queued_work():
    dev = torch.device("cuda")
    rows = torch.randn(5, 7)

    def copies():
        return to_device(rows, dev, torch.bfloat16), host_index([4, 0, 2], dev)

    copies()
    _busy_stream()
    on_dev, index = copies()
    assert not torch.cuda.current_stream().query()  # returned while the stream was still busy
    torch.cuda.synchronize()
    assert torch.equal(on_dev.cpu(), rows.to(torch.bfloat16)) and index.tolist() == [4, 0, 2]


@cuda
def test_aside_work_and_its_syncs_do_not_wait_for_queued_work():
    dev = torch.device("cuda")
    table = torch.randn(100, 8, device=dev)

    def work():
        with aside(dev):
            ids = torch.tensor([3, 7, 9], device=dev)  # a pageable copy: syncs its stream
            rows = table[ids] * 2
            return bool((rows.abs() > 1e9).any()), rows.cpu()  # host syncs

    work()
    _busy_stream()
    big, host = work()
    assert not torch.cuda.current_stream().query()
    assert not big and torch.equal(host, (table[[3, 7, 9]] * 2).cpu())


@cuda
def test_talker_input_processor_does_not_wait_for_the_talkers_steps(tiny_models):
    model_dir = str(tiny_models["tiny-qwen2_5-omni"])
    thinker = read_config(model_dir).thinker_config
    hidden = thinker.text_config.hidden_size if hasattr(thinker, "text_config") else thinker.hidden_size
    payload = StagePayload(request_id="r", source_stage=0, prompt_token_ids=[11, 12, 13, 14, 15],
                           output_token_ids=[21, 22, 23], tensors={"hidden": torch.randn(7, hidden)})
    ctx = SimpleNamespace(stage=SimpleNamespace(model=model_dir), dtype=torch.float32)
    _check_built_without_waiting(lambda: processors.get("qwen2_5_omni.thinker_to_talker")(
        {0: payload}, ctx, {"voice": "Ethan"}))


def _check_built_without_waiting(build) -> None:
    """`build()` (a talker processor's first call) behind ~1 s of queued GPU work: it returns
    without waiting for it, its prompt comes to the host in pinned memory behind an event (the
    stage waits for it after building all of a loop's inputs, StageInput.wait, still not for the
    model's steps), and the result equals one built on an idle GPU."""
    expected = build()  # (also builds the tables)
    expected.wait()
    _busy_stream()
    out = build()
    assert not torch.cuda.current_stream().query()
    assert out.host_ready is not None and out.prompt["prompt_embeds"].is_pinned()
    out.wait()
    assert not torch.cuda.current_stream().query()
    assert torch.equal(out.prompt["prompt_embeds"], expected.prompt["prompt_embeds"])
    assert torch.equal(out.step_embeds, expected.step_embeds)


@cuda
def test_qwen3_talker_prompt_is_built_without_waiting(tiny_models):
    """The Qwen3 processor's first call (user turns with an audio placeholder, whose rows come from
    the thinker's hidden states): the media rows are found on the host and the prompt is copied to
    pinned memory behind an event, so nothing waits for the model's queued steps."""
    from transformers import AutoTokenizer

    model_dir = str(tiny_models["tiny-qwen3-omni-moe"])
    cfg = read_config(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = list(tok.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True,
                                       return_dict=True)["input_ids"])
    ids[2] = cfg.thinker_config.audio_token_id  # a media row in the user turn
    hidden = torch.randn(len(ids) + 2, cfg.thinker_config.text_config.hidden_size)
    payload = StagePayload(request_id="r", source_stage=0, prompt_token_ids=ids, output_token_ids=[100, 101, 102],
                           tensors={"hidden": hidden})
    ctx = SimpleNamespace(stage=SimpleNamespace(model=model_dir), dtype=torch.float32)
    _check_built_without_waiting(lambda: processors.get("qwen3_omni_moe.thinker_to_talker")({0: payload}, ctx, {}))


@cuda
def test_handed_off_work_is_ordered_before_the_readers_work_without_a_host_wait():
    src = torch.randn(64, 64, device="cuda")
    torch.cuda.synchronize()
    with aside(torch.device("cuda")):  # (the tables' device; `made` says cuda:0: the same stream)
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s of side-stream work before the result is written
        made = src * 3
    t, ready = handoff(made)
    assert to_device(t, torch.device("cuda")) is t  # a device tensor is not copied again
    reader = torch.cuda.Stream()  # the reader's stream (the model's), not the caller's
    with torch.cuda.stream(reader):
        read = receive(t, ready) + 0  # must wait, on the GPU, for the side stream
    assert not reader.query()  # queued behind it; the host did not wait
    torch.cuda.synchronize()
    assert torch.equal(read, src * 3)


@cuda
def test_talker_step_rows_stay_on_the_device_and_do_not_wait(tiny_models):
    """An incremental call (`since`, every thinker chunk) returns the new step rows on the device,
    with the event their reader waits for, without waiting for the model's queued steps; the rows
    equal those of the first call."""
    model_dir = str(tiny_models["tiny-qwen2_5-omni"])
    thinker = read_config(model_dir).thinker_config
    hidden = thinker.text_config.hidden_size if hasattr(thinker, "text_config") else thinker.hidden_size
    payload = StagePayload(request_id="r", source_stage=0, prompt_token_ids=[11, 12, 13, 14, 15],
                           output_token_ids=[21, 22, 23, 24], tensors={"hidden": torch.randn(8, hidden)})
    ctx = SimpleNamespace(stage=SimpleNamespace(model=model_dir), dtype=torch.float32)
    proc = processors.get("qwen2_5_omni.thinker_to_talker")
    whole = proc({0: payload}, ctx, {"voice": "Ethan"})
    proc({0: payload}, ctx, {"voice": "Ethan"}, since=1)
    _busy_stream()
    later = proc({0: payload}, ctx, {"voice": "Ethan"}, since=1)
    assert not torch.cuda.current_stream().query()
    assert later.step_embeds.is_cuda and later.step_offset == 1 and later.step_ready is not None
    torch.cuda.synchronize()
    # (The same rows through a GEMM of another height: equal up to its rounding.)
    assert torch.allclose(later.step_embeds.cpu(), whole.step_embeds[1:], rtol=1e-5, atol=1e-5)
