"""Wire codec: round trips (in-process and over real pyzmq sockets), zero-copy, and rejection of
malformed input with WireError only (never another exception, never unpickling anything)."""

from __future__ import annotations

import gc
import logging
import os
import pickle
import random
import threading
import time
import typing

import msgspec
import numpy as np
import pytest
import torch
import zmq

from omni_server.wire import codec
from omni_server.wire.codec import DTYPES, MAX_FRAMES, MAX_NDIM, Decoder, Encoder, WireError
from omni_server.wire.messages import (
    WIRE_VERSION,
    AbortRequest,
    AddRequest,
    ExpectRequest,
    FinishRequest,
    Message,
    RequestDelta,
    RequestOutputs,
    SamplingSpec,
    Shutdown,
    StagePayload,
    StageReady,
    StageStats,
    StatsQuery,
    StreamCredit,
)
from omni_server.wire.transport import input_socket

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover - hypothesis is in requirements/test.txt
    given = None

PREFIX = b"OMNI" + bytes([WIRE_VERSION])
EXT = codec._TENSOR_EXT
MESSAGE_TYPES = typing.get_args(Message)
RECV_TIMEOUT_MS = 5000


# ---- helpers -----------------------------------------------------------------------------------


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().resolve_neg().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_tensor_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert isinstance(got, torch.Tensor)
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert got.device.type == "cpu"
    assert tensor_bytes(got) == tensor_bytes(want)  # byte-exact: NaN payloads, -0.0, bf16 bits


def assert_msg_equal(got: object, want: object) -> None:
    assert type(got) is type(want)
    for field in want.__struct_fields__:
        g, w = getattr(got, field), getattr(want, field)
        if field == "tensors":
            assert list(g) == list(w)  # same keys, same order
            for key in w:
                assert_tensor_equal(g[key], w[key])
        elif field == "deltas":
            assert len(g) == len(w)
            for gd, wd in zip(g, w):
                assert_msg_equal(gd, wd)
        else:
            assert type(g) is type(w), field
            assert g == w, field


def address(buf) -> int:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


def frame_view(frame) -> memoryview:
    return frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame).cast("B")


def ext(name, shape, index, code=EXT) -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(code, msgspec.msgpack.encode((name, shape, index)))


def header(obj) -> bytes:
    return PREFIX + msgspec.msgpack.encode(obj)


def payload_dict(tensors=None, **fields) -> dict:
    d = {"type": "StagePayload", "request_id": "r", "source_stage": 0, "prompt_token_ids": [1, 2], "output_token_ids": [3]}
    if tensors is not None:
        d["tensors"] = tensors
    d.update(fields)
    return d


def payload_frames(tensors, *data) -> list:
    return [header(payload_dict(tensors)), *data]


F32x6 = np.arange(6, dtype=np.float32).tobytes()  # 24 bytes: a valid [2, 3] float32 frame


# ---- realistic messages ------------------------------------------------------------------------


def make_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    out: dict[str, torch.Tensor] = {}
    for name, dtype in DTYPES.items():
        if dtype.is_floating_point:
            base = torch.randn(4, 6, 5, generator=g).to(dtype)
            base.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0]).to(dtype)
        elif dtype == torch.bool:
            base = torch.rand(4, 6, 5, generator=g) > 0.5
        else:
            info = torch.iinfo(dtype)
            base = torch.randint(info.min, info.max, (4, 6, 5), generator=g, dtype=dtype)
            base.view(-1)[:2] = torch.tensor([info.min, info.max], dtype=dtype)
        out[f"{name}/3d"] = base
        out[f"{name}/2d"] = base[0]
        out[f"{name}/0d"] = base[1, 2, 3].clone()
        out[f"{name}/empty"] = base[:0]
        out[f"{name}/empty_mid"] = base[:, :0, :]
        out[f"{name}/transposed"] = base[2].t()  # non-contiguous
        out[f"{name}/strided"] = base[:, ::2, 1::2]  # non-contiguous, storage offset
        out[f"{name}/expanded"] = base[3, 0, :1].expand(3, 7)  # stride 0
        out[f"{name}/permuted"] = base.permute(2, 0, 1)
    out["hidden"] = torch.randn(17, 64, generator=g).to(torch.bfloat16)  # the real use: [tokens, hidden]
    out["max_ndim"] = torch.arange(2**MAX_NDIM, dtype=torch.int32).reshape([2] * MAX_NDIM)
    out["requires_grad"] = torch.randn(3, 3, generator=g, requires_grad=True)
    out["neg_view"] = torch._neg_view(torch.arange(5.0))
    out["offset_view"] = torch.arange(10, dtype=torch.int64)[3:7]
    assert any(not t.is_contiguous() for t in out.values())
    return out


def make_messages() -> list:
    sampling = SamplingSpec(
        max_tokens=2048, temperature=0.7, top_p=0.95, top_k=50, min_tokens=2, seed=2**63 - 1,
        repetition_penalty=1.05, stop_token_ids=[151645, 151643], ignore_eos=True,
    )
    return [
        AddRequest("chatcmpl-1f2e", [151644, 872, 198, 9707, 0], sampling, forward_to=[1, 2]),
        AddRequest("minimal", [1], SamplingSpec()),
        ExpectRequest("chatcmpl-1f2e", SamplingSpec(max_tokens=4096, seed=None), sources=[0], forward_to=[2]),
        AbortRequest(["a", "b", "ünïcødé-✓"]),
        AbortRequest([]),
        StatsQuery(nonce=0xFFFF_FFFF_FFFF),
        Shutdown(),
        StagePayload("chatcmpl-1f2e", 0, list(range(40)), [11, 12, 13], tensors=make_tensors()),
        StagePayload("no-tensors", 1, [], []),
        AddRequest("with-audio", [1, 2, 3], SamplingSpec(suppress_token_ids=[8293]), options={"voice": "Ethan"},
                   tensors={"audio.0": torch.linspace(-1, 1, 1600), "audio.1": torch.zeros(0)}),
        ExpectRequest("opts", SamplingSpec(), sources=[0, 1], options={"voice": "Chelsie", "reply_from": "12"}),
        FinishRequest("chatcmpl-1f2e"),
        StreamCredit("chatcmpl-1f2e", stage_id=1, consumed=40),
        StreamCredit("chatcmpl-1f2e", stage_id=2, consumed=-1),
        StreamCredit("chatcmpl-1f2e", stage_id=1, consumed=6, waiting=True),
        StageReady(stage_id=1, pid=4242, startup_s=12.375, info={"model": "Qwen/Qwen2.5-Omni-7B", "device": "cuda:1"}),
        RequestOutputs(
            stage_id=0,
            deltas=[
                RequestDelta("a", new_token_ids=[5, 6], num_prompt_tokens=40),
                RequestDelta("b", finished=True, finish_reason="error", error="CUDA out of memory"),
                RequestDelta("c"),
                RequestDelta("d", finished=True, finish_reason="stop", tensors={"audio": torch.rand(2400)},
                             sample_rate=24000),
            ],
        ),
        StageStats(stage_id=2, nonce=7, num_running=3, num_waiting=1, request_ids=["a", "b"], steps=99),
        StageStats(stage_id=2, nonce=0, num_running=0, num_waiting=0, request_ids=[],
                   info={"voices": "Chelsie,Ethan", "sample_rate": "24000"}),
    ]


MESSAGES = make_messages()
BIG_PAYLOAD = next(m for m in MESSAGES if getattr(m, "tensors", None))  # every dtype and layout case
SMALL_MESSAGES = [m for m in MESSAGES if m is not BIG_PAYLOAD]


def test_messages_cover_the_union():
    assert {type(m) for m in MESSAGES} == set(MESSAGE_TYPES)
    assert len(MESSAGE_TYPES) == 11


# ---- zmq fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def _pair(ctx, path):
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    pull.bind(f"ipc://{path}")
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.setsockopt(zmq.SNDTIMEO, RECV_TIMEOUT_MS)
    push.connect(f"ipc://{path}")
    return push, pull


@pytest.fixture
def pipe(zctx, tmp_path):
    """A fresh PUSH/PULL pair per test, so a failing test cannot leave messages for the next one."""
    push, pull = _pair(zctx, tmp_path / "pipe.sock")
    yield push, pull
    push.close(0)
    pull.close(0)


def transmit(frames, mode, pipe):
    """Deliver `frames` the way `mode` says; returns what the receiver hands to Decoder.decode."""
    if mode == "direct":
        return frames
    if mode == "bytes":
        return [bytes(f) for f in frames]
    push, pull = pipe
    if mode == "zmq-frames":
        push.send_multipart(frames, copy=False)
        got = pull.recv_multipart(copy=False)
        assert all(isinstance(f, zmq.Frame) for f in got)
        return got
    assert mode == "zmq-bytes"
    push.send_multipart([bytes(f) for f in frames])
    got = pull.recv_multipart()
    assert all(type(f) is bytes for f in got)
    return got


MODES = ["direct", "bytes", "zmq-frames", "zmq-bytes"]


# ---- 1. round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: f"{type(m).__name__}-{getattr(m, 'request_id', '')}")
def test_round_trip(msg, mode, pipe):
    originals = {k: (v.clone(), v.stride()) for k, v in getattr(msg, "tensors", {}).items()}
    frames = Encoder().encode(msg)
    assert isinstance(frames[0], bytes) and frames[0].startswith(PREFIX)
    assert len(frames) == 1 + len(getattr(msg, "tensors", {})) + sum(
        len(d.tensors) for d in getattr(msg, "deltas", []))
    got = Decoder().decode(transmit(frames, mode, pipe))
    assert_msg_equal(got, msg)
    for k, (clone, stride) in originals.items():  # encoding leaves the input tensors untouched
        assert msg.tensors[k].stride() == stride
        assert_tensor_equal(msg.tensors[k], clone)


def test_round_trip_all_messages_back_to_back_over_zmq(pipe):
    enc, dec = Encoder(), Decoder()
    push, pull = pipe
    for msg in MESSAGES:
        push.send_multipart(enc.encode(msg), copy=False)
    for msg in MESSAGES:
        assert_msg_equal(dec.decode(pull.recv_multipart(copy=False)), msg)


def test_tensor_frames_are_raw_bytes_in_dict_order():
    msg = StagePayload("r", 0, [], [], {"b": torch.arange(3, dtype=torch.int16), "a": torch.tensor([1.5], dtype=torch.float64)})
    frames = Encoder().encode(msg)
    assert bytes(frames[1]) == np.arange(3, dtype=np.int16).tobytes()
    assert bytes(frames[2]) == np.array([1.5]).tobytes()
    assert b"torch" not in frames[0]  # dtype names, not pickled torch objects


def test_decoded_tensors_outlive_the_frames(pipe):
    msg = StagePayload("r", 0, [], [], {"x": torch.arange(1000, dtype=torch.float32), "y": torch.ones(3, dtype=torch.bool)})
    push, pull = pipe
    push.send_multipart(Encoder().encode(msg), copy=False)
    frames = pull.recv_multipart(copy=False)
    got = Decoder().decode(frames)
    del frames
    gc.collect()
    junk = [bytearray(4000) for _ in range(100)]  # reuse freed memory, if it was freed
    assert_msg_equal(got, msg)
    del junk


# ---- 2. zero copy ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["direct", "bytes", "zmq-frames", "zmq-bytes"])
def test_decode_is_zero_copy(mode, pipe):
    msg = BIG_PAYLOAD
    frames = transmit(Encoder().encode(msg), mode, pipe)
    got = Decoder().decode(frames)
    spans = [(address(frame_view(f)), len(frame_view(f))) for f in frames[1:]]
    hits = set()
    for key, t in got.tensors.items():
        if t.numel() == 0:
            continue  # empty tensors are fresh allocations: nothing to share
        nbytes = t.numel() * t.element_size()
        assert t.is_contiguous()
        start = [i for i, (addr, size) in enumerate(spans) if addr == t.data_ptr() and size == nbytes]
        assert len(start) == 1, f"{key} does not alias exactly one received frame"
        hits.add(start[0])
    assert len(hits) == sum(1 for t in msg.tensors.values() if t.numel())
    if mode == "zmq-frames":
        # Received zmq frames are writable: a write to the frame shows in the tensor (same memory).
        key = "uint8/3d"
        t = got.tensors[key]
        i = [j for j, (addr, _) in enumerate(spans) if addr == t.data_ptr()][0]
        buf = frames[1 + i].buffer
        assert not buf.readonly
        before = int(t.reshape(-1)[0])
        buf[0] = (before + 1) % 256
        assert int(t.reshape(-1)[0]) == (before + 1) % 256


def test_encode_is_zero_copy_for_contiguous_cpu_tensors():
    contiguous = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    strided = contiguous.t()
    frames = Encoder().encode(StagePayload("r", 0, [], [], {"c": contiguous, "s": strided}))
    assert address(frames[1]) == contiguous.data_ptr()  # shares the tensor's storage
    assert address(frames[2]) != strided.data_ptr()  # non-contiguous: one contiguous copy
    assert bytes(frames[2]) == tensor_bytes(strided)


def test_zero_copy_even_when_frame_is_misaligned_for_dtype():
    # zmq hands out small frames at arbitrary offsets of its receive buffer, so a frame address is
    # not guaranteed to be a multiple of the dtype size. The decoder does not copy to align; check
    # that such tensors still compute correctly.
    for name, dtype in DTYPES.items():
        ref = make_tensors()[f"{name}/3d"].contiguous()
        raw = bytearray(1 + ref.numel() * ref.element_size())
        raw[1:] = tensor_bytes(ref)
        frame = memoryview(raw)[1:]
        got = Decoder().decode(payload_frames({"t": ext(name, list(ref.shape), 1)}, frame)).tensors["t"]
        assert got.data_ptr() == address(frame)
        if ref.element_size() > 1:
            assert got.data_ptr() % ref.element_size() != 0
        assert_tensor_equal(got, ref)
        assert_tensor_equal(got.clone(), ref)
        if dtype.is_floating_point:
            f = torch.nan_to_num(got.float())
            fr = torch.nan_to_num(ref.float())
            assert torch.equal(f.sum(), fr.sum()) and torch.equal(torch.nan_to_num(got.to(torch.float32)), fr)
            assert torch.allclose(got[0].float() @ got[0].float().t(), ref[0].float() @ ref[0].float().t(), equal_nan=True)


# ---- 3. rejection ------------------------------------------------------------------------------


def _valid_payload_frames():
    return [bytes(f) for f in Encoder().encode(StagePayload("r", 0, [1], [2], {"a": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([True, False])}))]


def _shutdown():
    return [bytes(f) for f in Encoder().encode(Shutdown())]


def _deep_header(n):
    head = msgspec.msgpack.encode(payload_dict({"a": 0}))
    assert head.endswith(b"\x00")
    return head[:-1] + b"\x91" * n + b"\xc0"  # tensors["a"] = [[[[...None...]]]]


BAD_FRAMES = {
    # prefix / version
    "no-prefix": lambda: [msgspec.msgpack.encode({"type": "Shutdown"})],
    "wrong-magic": lambda: [b"OMNX" + bytes([WIRE_VERSION]) + msgspec.msgpack.encode({"type": "Shutdown"})],
    "next-version": lambda: [b"OMNI" + bytes([WIRE_VERSION + 1]) + msgspec.msgpack.encode({"type": "Shutdown"})],
    "version-0": lambda: [b"OMNI\x00" + msgspec.msgpack.encode({"type": "Shutdown"})],
    "prefix-only": lambda: [PREFIX],
    "short-prefix": lambda: [PREFIX[:3]],
    "empty-frame0": lambda: [b""],
    "empty-list": lambda: [],
    "empty-tuple": lambda: (),
    "too-many-frames": lambda: _shutdown() + [b""] * MAX_FRAMES,
    "frame-not-a-buffer": lambda: [PREFIX.decode() + "x"],
    # frame 0 content
    "trailing-bytes": lambda: [_shutdown()[0] + b"\x00"],
    "not-a-map": lambda: [header([1, 2, 3])],
    "nil": lambda: [header(None)],
    "unknown-tag": lambda: [header({"type": "DropTables"})],
    "no-tag": lambda: [header({"request_ids": ["a"]})],
    "tag-of-non-message-struct": lambda: [header({"type": "SamplingSpec"})],
    "tag-of-base-class": lambda: [header({"type": "_Msg"})],
    "tag-wrong-type": lambda: [header({"type": 5})],
    "unknown-field": lambda: [header({"type": "AbortRequest", "request_ids": ["a"], "evil": 1})],
    "unknown-nested-field": lambda: [header({"type": "AddRequest", "request_id": "r", "prompt_token_ids": [1], "sampling": {"beam": 4}})],
    "missing-field": lambda: [header({"type": "StatsQuery"})],
    "wrong-type-str": lambda: [header({"type": "AbortRequest", "request_ids": [1]})],
    "wrong-type-int": lambda: [header({"type": "StatsQuery", "nonce": "1"})],
    "wrong-type-bool-as-int": lambda: [header({"type": "StatsQuery", "nonce": True})],
    "wrong-type-float": lambda: [header({"type": "AddRequest", "request_id": "r", "prompt_token_ids": [1], "sampling": {"temperature": "hot"}})],
    "wrong-type-list": lambda: [header({"type": "RequestOutputs", "stage_id": 0, "deltas": {"a": 1}})],
    "invalid-utf8": lambda: [PREFIX + msgspec.msgpack.encode({"type": "AbortRequest", "request_ids": ["ab"]}).replace(b"ab", b"\xff\xfe")],
    "huge-array-count": lambda: [header({"type": "AbortRequest", "request_ids": []})[:-1] + b"\xdd\xff\xff\xff\xff"],
    "huge-str-length": lambda: [header({"type": "AbortRequest", "request_ids": []})[:-1] + b"\x91\xdb\xff\xff\xff\xff"],
    "deep-nesting": lambda: [PREFIX + _deep_header(100_000)],
    "tensor-in-typed-field": lambda: [header({"type": "AbortRequest", "request_ids": [ext("float32", [2, 3], 1)]}), F32x6],
    # frame count
    "extra-frame": lambda: _valid_payload_frames() + [b"extra"],
    "extra-empty-frame": lambda: _valid_payload_frames() + [b""],
    "extra-frame-no-tensors": lambda: _shutdown() + [F32x6],
    "missing-frame": lambda: _valid_payload_frames()[:-1],
    "missing-all-tensor-frames": lambda: _valid_payload_frames()[:1],
    "frames-swapped": lambda: [(f := _valid_payload_frames())[0], f[2], f[1]],
    # tensor references
    "ref-frame-0": lambda: payload_frames({"a": ext("float32", [2, 3], 0)}, F32x6),
    "ref-out-of-range": lambda: payload_frames({"a": ext("float32", [2, 3], 2)}, F32x6),
    "ref-negative": lambda: payload_frames({"a": ext("float32", [2, 3], -1)}, F32x6),
    "ref-huge": lambda: payload_frames({"a": ext("float32", [2, 3], 2**64 - 1)}, F32x6),
    "ref-twice": lambda: payload_frames({"a": ext("float32", [2, 3], 1), "b": ext("float32", [2, 3], 1)}, F32x6),
    "ref-twice-with-spare-frame": lambda: payload_frames({"a": ext("float32", [2, 3], 1), "b": ext("float32", [2, 3], 1)}, F32x6, F32x6),
    "bytes-too-few": lambda: payload_frames({"a": ext("float32", [2, 3], 1)}, F32x6[:-1]),
    "bytes-too-many": lambda: payload_frames({"a": ext("float32", [2, 3], 1)}, F32x6 + b"\x00"),
    "bytes-for-empty-shape": lambda: payload_frames({"a": ext("float32", [0, 3], 1)}, F32x6),
    "no-bytes-for-0d": lambda: payload_frames({"a": ext("float32", [], 1)}, b""),
    "shape-product-overflow": lambda: payload_frames({"a": ext("uint8", [2**32, 2**32], 1)}, b"\x00"),
    "huge-dims-empty": lambda: payload_frames({"a": ext("float32", [0, 2**64 - 1], 1)}, b""),
    "huge-stride-empty": lambda: payload_frames({"a": ext("float32", [0, 2**62, 2**62], 1)}, b""),
    "negative-dim": lambda: payload_frames({"a": ext("float32", [-2, -3], 1)}, F32x6),
    "negative-dim-empty": lambda: payload_frames({"a": ext("float32", [0, -1], 1)}, b""),
    "too-many-dims": lambda: payload_frames({"a": ext("uint8", [1] * (MAX_NDIM + 1), 1)}, b"\x00"),
    "bool-byte-not-0-1": lambda: payload_frames({"a": ext("bool", [3], 1)}, b"\x01\x00\x02"),
    **{
        f"dtype-{name or 'empty'}": (lambda name=name: payload_frames({"a": ext(name, [2, 3], 1)}, F32x6))
        for name in ["object", "complex64", "complex128", "float8_e4m3fn", "qint8", "uint16", "uint32", "torch.float32", "FLOAT32", "<f4", "O", ""]
    },
    "dtype-not-str": lambda: payload_frames({"a": ext(1, [2, 3], 1)}, F32x6),
    "shape-not-list": lambda: payload_frames({"a": ext("float32", "23", 1)}, F32x6),
    "shape-floats": lambda: payload_frames({"a": ext("float32", [2.0, 3.0], 1)}, F32x6),
    "index-not-int": lambda: payload_frames({"a": ext("float32", [2, 3], "1")}, F32x6),
    "ref-short-tuple": lambda: payload_frames({"a": msgspec.msgpack.Ext(EXT, msgspec.msgpack.encode(("float32", [2, 3])))}, F32x6),
    "ref-long-tuple": lambda: payload_frames({"a": msgspec.msgpack.Ext(EXT, msgspec.msgpack.encode(("float32", [2, 3], 1, 0)))}, F32x6),
    "ref-not-msgpack": lambda: payload_frames({"a": msgspec.msgpack.Ext(EXT, b"\xc1\xc1")}, F32x6),
    "ref-empty": lambda: payload_frames({"a": msgspec.msgpack.Ext(EXT, b"")}, F32x6),
    "ext-code-2": lambda: payload_frames({"a": ext("float32", [2, 3], 1, code=2)}, F32x6),
    "ext-code-0": lambda: payload_frames({"a": ext("float32", [2, 3], 1, code=0)}, F32x6),
    "ext-code-neg": lambda: payload_frames({"a": ext("float32", [2, 3], 1, code=-1)}, F32x6),
    "ext-code-127": lambda: payload_frames({"a": ext("float32", [2, 3], 1, code=127)}, F32x6),
    "ext-timestamp": lambda: [header(payload_dict({"a": __import__("datetime").datetime(2020, 1, 1, tzinfo=__import__("datetime").timezone.utc)}))],
    # non-tensors where tensors belong
    "tensors-int": lambda: [header(payload_dict({"a": 1}))],
    "tensors-str": lambda: [header(payload_dict({"a": "x"}))],
    "tensors-none": lambda: [header(payload_dict({"a": None}))],
    "tensors-bin": lambda: [header(payload_dict({"a": b"\x00\x01"}))],
    "tensors-list-of-tensor": lambda: payload_frames({"a": [ext("float32", [2, 3], 1)]}, F32x6),
    "tensors-nested-dict": lambda: payload_frames({"a": {"b": ext("float32", [2, 3], 1)}}, F32x6),
    "tensors-int-key": lambda: payload_frames({1: ext("float32", [2, 3], 1)}, F32x6),
    "tensors-not-a-map": lambda: payload_frames([ext("float32", [2, 3], 1)], F32x6),
}


@pytest.mark.parametrize("make", BAD_FRAMES.values(), ids=BAD_FRAMES.keys())
def test_rejects_malformed(make):
    frames = make()
    with pytest.raises(WireError):
        Decoder().decode(frames)


def test_hand_built_frames_are_valid_control():
    """The helpers used for the bad cases above build valid frames when nothing is wrong."""
    got = Decoder().decode(payload_frames({"a": ext("float32", [2, 3], 1), "e": ext("bool", [0, 5], 2)}, F32x6, b""))
    assert_tensor_equal(got.tensors["a"], torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert got.tensors["e"].shape == (0, 5)
    assert type(Decoder().decode([header({"type": "Shutdown"})])) is Shutdown
    with pytest.raises(WireError, match="not a tensor"):  # shallow nesting: rejected for the right reason
        Decoder().decode([PREFIX + _deep_header(10)])
    # an empty tensor with very large (but representable) dims is fine
    assert Decoder().decode(payload_frames({"a": ext("uint8", [0, 2**40], 1)}, b"")).tensors["a"].shape == (0, 2**40)


def test_truncated_frame0_every_length():
    frames = _valid_payload_frames()
    dec = Decoder()
    for n in range(len(frames[0])):
        with pytest.raises(WireError):
            dec.decode([frames[0][:n], *frames[1:]])
    dec.decode(frames)  # the decoder is still usable afterwards


def test_max_bytes():
    frames = _valid_payload_frames()
    total = sum(len(f) for f in frames)
    Decoder(max_bytes=total).decode(frames)
    with pytest.raises(WireError, match="exceeds"):
        Decoder(max_bytes=total - 1).decode(frames)
    with pytest.raises(WireError, match="exceeds"):
        Decoder(max_bytes=100).decode(payload_frames({"a": ext("uint8", [1000], 1)}, bytes(1000)))


def test_random_frames_seeded():
    rng = random.Random(20240601)
    dec = Decoder(max_bytes=1 << 16)
    for i in range(3000):
        frames = [rng.randbytes(rng.randrange(0, 80)) for _ in range(rng.randint(1, 5))]
        if i % 2:
            frames[0] = PREFIX + frames[0]
        with pytest.raises(WireError):
            dec.decode(frames)


def test_mutated_valid_frames_seeded():
    """Bit flips, truncations, insertions, extra / missing frames on valid encodings: a Message or WireError."""
    rng = random.Random(7)
    dec = Decoder(max_bytes=1 << 16)
    bases = [[bytes(f) for f in Encoder().encode(m)] for m in SMALL_MESSAGES] + [_valid_payload_frames()]
    outcomes = {"ok": 0, "rejected": 0}
    for _ in range(4000):
        frames = [bytearray(f) for f in rng.choice(bases)]
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(frames))
            f, op = frames[i], rng.random()
            if op < 0.5 and f:
                f[rng.randrange(len(f))] = rng.randrange(256)
            elif op < 0.65 and f:
                del f[rng.randrange(len(f)) :]
            elif op < 0.8:
                f.insert(rng.randrange(len(f) + 1), rng.randrange(256))
            elif op < 0.9:
                frames.append(bytearray(rng.randbytes(rng.randrange(16))))
            elif len(frames) > 1:
                del frames[rng.randrange(1, len(frames))]
        try:
            msg = dec.decode([bytes(f) for f in frames])
        except WireError:
            outcomes["rejected"] += 1
        else:
            assert isinstance(msg, MESSAGE_TYPES)
            for t in getattr(msg, "tensors", {}).values():
                assert isinstance(t, torch.Tensor) and t.dtype in DTYPES.values()
            outcomes["ok"] += 1
    assert outcomes["ok"] > 0 and outcomes["rejected"] > 0


if given is not None:
    # Small budgets keep the file fast; the seeded loops above do the bulk of the random testing.
    def _HYP(n):
        return settings(max_examples=n, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))

    @_HYP(100)
    @given(prefixed=st.booleans(), frames=st.lists(st.binary(max_size=100), min_size=1, max_size=6))
    def test_hypothesis_random_bytes(prefixed, frames):
        if prefixed:
            frames[0] = PREFIX + frames[0]
        with pytest.raises(WireError):
            Decoder().decode(frames)

    _FIELDS = sorted({f for t in (*MESSAGE_TYPES, SamplingSpec, RequestDelta) for f in t.__struct_fields__})
    _tensor_ref = st.builds(
        ext,
        st.sampled_from([*DTYPES, "object", "complex64"]),
        st.lists(st.integers(-1, 4) | st.integers(0, 2**64 - 1), max_size=MAX_NDIM + 1),
        st.integers(-1, 4),
        st.sampled_from([EXT, EXT, EXT, 0, 2]),
    )
    _leaf = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8) | st.binary(max_size=8) | _tensor_ref
    _value = st.recursive(_leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(_FIELDS) | st.text(max_size=3), c, max_size=3), max_leaves=6)

    @_HYP(50)
    @given(
        tag=st.sampled_from([t.__name__ for t in MESSAGE_TYPES] + ["SamplingSpec", "Nope"]),
        fields=st.dictionaries(st.sampled_from(_FIELDS), _value, max_size=6),
        tensors=st.dictionaries(st.text(max_size=3), _tensor_ref | _leaf, max_size=4),
        data=st.lists(st.binary(max_size=48), max_size=4),
    )
    def test_hypothesis_structured_garbage(tag, fields, tensors, data):
        obj = {"type": tag, **fields}
        if tag == "StagePayload" and tensors:
            obj["tensors"] = tensors
        try:
            msg = Decoder().decode([header(obj), *data])
        except WireError:
            return
        assert isinstance(msg, MESSAGE_TYPES)

    @_HYP(100)
    @given(msg=st.sampled_from(SMALL_MESSAGES), cut=st.integers(0, 10_000), byte=st.integers(0, 255))
    def test_hypothesis_single_byte_corruption(msg, cut, byte):
        frame0 = bytearray(Encoder().encode(msg)[0])
        frame0[cut % len(frame0)] = byte
        try:
            got = Decoder().decode([bytes(frame0)])
        except WireError:
            return
        assert isinstance(got, MESSAGE_TYPES)

else:  # pragma: no cover

    @pytest.mark.skip(reason="hypothesis not installed")
    def test_hypothesis_random_bytes():
        pass


# -- pickle: nothing is ever unpickled -------------------------------------------------------------


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_pickle_payloads_are_never_executed(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    calls = []
    for mod, name in [(pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (torch, "load"), (np, "load")]:
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _n=name, **k: (calls.append(_n), _real(*a, **k))[1])
    dec = Decoder()
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        evil = pickle.dumps(_Evil(marker), protocol=proto)
        assert b"system" in evil
        for frames in (
            [evil],  # as frame 0
            [PREFIX + evil],  # as frame 0 behind a valid prefix
            [PREFIX + evil, evil],
            payload_frames({"a": ext("float32", [len(evil)], 1)}, evil),  # wrong length for the dtype
            [header(payload_dict({"a": evil}))],  # as msgpack bin where a tensor belongs
            [header({"type": "AbortRequest", "request_ids": [evil]})],  # bin where str belongs
            [header(payload_dict({"a": msgspec.msgpack.Ext(EXT, evil)}))],  # as the tensor reference
        ):
            with pytest.raises(WireError):
                dec.decode(frames)
        # As a tensor frame with a matching uint8 shape it decodes, as plain bytes and nothing more.
        got = dec.decode(payload_frames({"a": ext("uint8", [len(evil)], 1)}, evil))
        assert got.tensors["a"].dtype == torch.uint8 and tensor_bytes(got.tensors["a"]) == evil
        got = dec.decode([header({"type": "AbortRequest", "request_ids": [evil.decode("latin-1")]})])
        assert got.request_ids == [evil.decode("latin-1")]
    assert calls == []
    assert not marker.exists()
    pickle.loads(pickle.dumps(_Evil(marker)))  # control: the payload does work when unpickled
    assert marker.exists()


# ---- 4. encoding refuses unsupported values ------------------------------------------------------


_UNSENDABLE = {
    "complex64": (torch.zeros(2, dtype=torch.complex64), "complex64"),
    "complex128": (torch.zeros(2, dtype=torch.complex128), "complex128"),
    "float8": (torch.zeros(2, dtype=torch.float8_e4m3fn), "float8"),
    "uint16": (torch.zeros(2, dtype=torch.uint16), "uint16"),
    "qint8": (torch.quantize_per_tensor(torch.zeros(2), 0.1, 0, torch.qint8), "qint8"),
    "sparse": (torch.eye(3).to_sparse(), "layout"),
    "object": (object(), "object"),
    "ndarray": (np.zeros(3, dtype=np.float32), "ndarray"),
    "int": (3, "int"),
    "bytes": (b"raw", "bytes"),
    "list-of-tensors": ([torch.zeros(2)], "list"),
    "dict-of-tensors": ({"nested": torch.zeros(2)}, "dict"),
    "None": (None, "NoneType"),
}


@pytest.mark.parametrize("value, match", _UNSENDABLE.values(), ids=_UNSENDABLE.keys())
def test_encode_refuses(value, match):
    enc = Encoder()
    with pytest.raises(TypeError, match=match):
        enc.encode(StagePayload("r", 0, [], [], {"ok": torch.zeros(1), "bad": value}))
    frames = enc.encode(StagePayload("r", 0, [], [], {"ok": torch.ones(2)}))  # the encoder recovers
    assert len(frames) == 2
    assert_msg_equal(Decoder().decode([bytes(f) for f in frames]), StagePayload("r", 0, [], [], {"ok": torch.ones(2)}))


def test_encode_refuses_non_str_key():
    with pytest.raises(TypeError):
        Encoder().encode(StagePayload("r", 0, [], [], {1: torch.zeros(1)}))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_encode_moves_cuda_tensors_to_cpu(pipe):
    t = torch.randn(4, 8, device="cuda").to(torch.bfloat16)
    msg = StagePayload("r", 0, [], [], {"hidden": t, "strided": t.t()})
    frames = Encoder().encode(msg)
    assert t.device.type == "cuda"  # the message is not modified
    got = Decoder().decode(transmit(frames, "zmq-frames", pipe))
    assert got.tensors["hidden"].device.type == "cpu"
    assert_tensor_equal(got.tensors["hidden"], t.cpu())
    assert_tensor_equal(got.tensors["strided"], t.t().cpu())


# ---- 5. a receiver loop survives garbage --------------------------------------------------------


class Receiver(threading.Thread):
    """What a stage does: decode, log and drop WireErrors, handle the rest."""

    def __init__(self, sock):
        super().__init__(daemon=True)
        self.sock, self.dec = sock, Decoder(max_bytes=1 << 20)
        self.good: list = []
        self.dropped = 0
        self.crash: BaseException | None = None
        self.log = logging.getLogger("omni_server.test.receiver")

    def run(self):
        try:
            while True:
                frames = self.sock.recv_multipart(copy=False)
                try:
                    msg = self.dec.decode(frames)
                except WireError as e:
                    self.dropped += 1
                    self.log.warning("dropping malformed message: %s", e)
                    continue
                if isinstance(msg, Shutdown):
                    return
                self.good.append(msg)
        except BaseException as e:  # recorded so the test can say what killed the loop
            self.crash = e
            raise


def test_receiver_loop_survives_garbage(zctx, tmp_path, caplog):
    push, pull = _pair(zctx, tmp_path / "rx.sock")
    pull.setsockopt(zmq.RCVTIMEO, -1)
    rx = Receiver(pull)
    rx.start()
    enc = Encoder()
    rng = random.Random(3)
    evil = pickle.dumps(_Evil(tmp_path / "pwned"))
    sendable = lambda frames: frames and all(isinstance(f, (bytes, memoryview)) for f in frames)  # noqa: E731
    garbage = [frames for frames in (bad() for bad in BAD_FRAMES.values()) if sendable(frames)] + [
        [evil],
        [PREFIX + evil],
        [rng.randbytes(50)],
        [PREFIX + rng.randbytes(50), rng.randbytes(8)],
        [b""],
        [bytes(1 << 20) + b"x"],  # over max_bytes
    ]
    sent = []
    try:
        with caplog.at_level(logging.WARNING, logger="omni_server.test.receiver"):
            for i, junk in enumerate(garbage):
                if i % 3 == 0:
                    msg = StatsQuery(nonce=i)
                elif i % 3 == 1:
                    msg = StagePayload(f"req-{i}", 0, [i], [], {"h": torch.full((2, 3), i, dtype=torch.bfloat16), "ids": torch.arange(i)})
                else:
                    msg = AbortRequest([f"req-{i}"])
                sent.append(msg)
                push.send_multipart(enc.encode(msg), copy=False)
                push.send_multipart(junk, copy=False)
            deadline = time.monotonic() + 5
            while (len(rx.good) < len(sent) or rx.dropped < len(garbage)) and time.monotonic() < deadline and rx.is_alive():
                time.sleep(0.005)
            assert rx.crash is None, f"receiver died: {rx.crash!r}"
            assert rx.is_alive()
            assert rx.dropped == len(garbage)
            assert len(rx.good) == len(sent)
            for got, want in zip(rx.good, sent):
                assert_msg_equal(got, want)
            assert len([r for r in caplog.records if "dropping malformed message" in r.getMessage()]) == len(garbage)
        push.send_multipart(enc.encode(Shutdown()))
        rx.join(5)
        assert not rx.is_alive() and rx.crash is None
        assert not (tmp_path / "pwned").exists()
    finally:
        push.close(0)
        if not rx.is_alive():
            pull.close(0)


def test_input_socket_drops_a_frame_over_its_limit_before_buffering_it(zctx, tmp_path):
    # zmq itself refuses the frame (MAXMSGSIZE) and disconnects its sender; the sender reconnects
    # and what it sends next arrives.
    address = f"ipc://{tmp_path / 'in.sock'}"
    pull = input_socket(zctx, None, address, max_bytes=1024)
    pull.setsockopt(zmq.LINGER, 0)
    push = zctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(address)
    try:
        push.send(b"x" * 4096)
        got = None
        deadline = time.monotonic() + 10
        while got is None and time.monotonic() < deadline:
            push.send(b"small")
            if pull.poll(200):
                got = pull.recv()
        assert got == b"small"
    finally:
        push.close(0)
        pull.close(0)
    default = input_socket(zctx, None, f"ipc://{tmp_path / 'default.sock'}")
    assert default.getsockopt(zmq.MAXMSGSIZE) == Decoder().max_bytes  # (the decoder's own limit)
    default.close(0)
