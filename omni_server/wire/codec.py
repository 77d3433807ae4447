"""Frame encoding: frame 0 = version prefix + msgpack of a Message; tensors as extra raw frames.

Tensors are replaced in frame 0 by a msgpack extension (dtype, shape, frame index) and their bytes
travel as separate frames, so neither side copies them (zmq `copy=False` on both ends). Decoding
never unpickles anything: only whitelisted dtypes, bounded shapes and sizes; anything else raises
`WireError`, which receivers log and drop.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Sequence

import msgspec
import torch

from omni_server.wire.messages import WIRE_VERSION, Message, RequestOutputs

_PREFIX = b"OMNI" + bytes([WIRE_VERSION])
_TENSOR_EXT = 1

# Byte-exact dtypes allowed on the wire (no object / complex / quantised types).
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

MAX_FRAMES = 4096
MAX_NDIM = 8
DEFAULT_MAX_BYTES = 4 << 30


class WireError(ValueError):
    """A frame set that is not a valid message of this protocol version."""


class Encoder:
    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder(enc_hook=self._hook)
        self._frames: list[Any] = []

    def encode(self, msg: Message) -> list[Any]:
        """Return the frames for `msg`: bytes for frame 0, then buffers (no copies) for tensors."""
        for tensors in _tensor_fields(msg):
            for key, value in tensors.items():
                if not isinstance(key, str) or not isinstance(value, torch.Tensor):
                    raise TypeError(f"tensors needs str keys and torch.Tensor values, got {key!r}: {type(value).__name__}")
        self._frames = [b""]
        try:
            header = self._enc.encode(msg)
            frames, self._frames = self._frames, []
        finally:
            self._frames = []
        frames[0] = _PREFIX + header
        return frames

    def _hook(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            name = _DTYPE_NAMES.get(obj.dtype)
            if name is None:
                raise TypeError(f"dtype {obj.dtype} is not allowed on the wire")
            if obj.layout != torch.strided:
                raise TypeError(f"layout {obj.layout} is not allowed on the wire (dense tensors only)")
            t = obj.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            t = t.resolve_neg().contiguous()
            index = len(self._frames)
            # uint8 view keeps bf16 (no numpy equivalent) byte-exact; numpy() shares the storage.
            self._frames.append(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")
            return msgspec.msgpack.Ext(_TENSOR_EXT, msgspec.msgpack.encode((name, list(t.shape), index)))
        raise TypeError(f"cannot send {type(obj).__name__} on the wire")


class Decoder:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._dec = msgspec.msgpack.Decoder(Message, ext_hook=self._ext)
        self._frames: Sequence[Any] = ()
        self._used: set[int] = set()

    def decode(self, frames: Sequence[Any]) -> Message:
        """Decode frames (bytes or zmq.Frame) into a Message; raise WireError if malformed."""
        if not frames or len(frames) > MAX_FRAMES:
            raise WireError(f"bad frame count {len(frames)}")
        total = sum(len(_buf(f)) for f in frames)
        if total > self.max_bytes:
            raise WireError(f"message of {total} bytes exceeds the limit of {self.max_bytes}")
        head = bytes(_buf(frames[0])[: len(_PREFIX)])
        if head != _PREFIX:
            raise WireError("not an omni-server frame of this protocol version")
        self._frames, self._used = frames, set()
        try:
            msg = self._dec.decode(_buf(frames[0])[len(_PREFIX) :])
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise WireError(f"undecodable message: {e}") from None
        except RecursionError:
            raise WireError("message nested too deeply") from None
        finally:
            self._frames = ()
        if len(self._used) != len(frames) - 1:
            raise WireError("frame count does not match the tensors in the message")
        _check_tensor_fields(msg)
        return msg

    def _ext(self, code: int, data: memoryview) -> Any:
        if code != _TENSOR_EXT:
            raise WireError(f"unknown extension type {code}")
        try:
            name, shape, index = msgspec.msgpack.decode(data, type=tuple[str, list[int], int])
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise WireError(f"bad tensor reference: {e}") from None
        dtype = DTYPES.get(name)
        if dtype is None:
            raise WireError(f"dtype {name!r} is not allowed")
        if len(shape) > MAX_NDIM or any(d < 0 for d in shape):
            raise WireError(f"bad tensor shape {shape}")
        if not 1 <= index < len(self._frames) or index in self._used:
            raise WireError(f"bad tensor frame index {index}")
        self._used.add(index)
        buf = _buf(self._frames[index])
        itemsize = torch.empty((), dtype=dtype).element_size()
        if len(buf) != math.prod(shape) * itemsize:
            raise WireError(f"tensor frame has {len(buf)} bytes, shape {shape} {name} needs {math.prod(shape) * itemsize}")
        try:
            if len(buf) == 0:
                # Zero elements, but the other dims may still be absurd (torch overflows on them).
                return torch.empty(shape, dtype=dtype)
            with warnings.catch_warnings():
                # Frames may be read-only (bytes); the tensor shares them and must be treated as read-only.
                warnings.simplefilter("ignore", UserWarning)
                t = torch.frombuffer(buf, dtype=dtype).reshape(shape)
        except (RuntimeError, TypeError, ValueError, OverflowError) as e:
            raise WireError(f"bad tensor shape {shape}: {str(e).splitlines()[0]}") from None
        if dtype is torch.bool and bool((t.view(torch.uint8) > 1).any()):
            raise WireError("bool tensor holds bytes other than 0 and 1")
        return t


def _buf(frame: Any) -> memoryview:
    """Flat byte view of a frame: bytes-like, zmq.Frame, or any buffer (e.g. the encoder's numpy frames)."""
    obj = getattr(frame, "buffer", frame)  # zmq.Frame -> its memoryview
    try:
        view = memoryview(obj)
        return view if view.format == "B" and view.ndim == 1 else view.cast("B")
    except TypeError as e:
        raise WireError(f"frame of type {type(frame).__name__} is not a contiguous buffer: {e}") from None


def _tensor_fields(msg: Message) -> list[dict]:
    """The `tensors` dicts of a message: its own, or its deltas'."""
    if isinstance(msg, RequestOutputs):
        return [d.tensors for d in msg.deltas if d.tensors]
    tensors = getattr(msg, "tensors", None)
    return [tensors] if tensors else []


def _check_tensor_fields(msg: Message) -> None:
    for tensors in _tensor_fields(msg):
        for key, value in tensors.items():
            if not isinstance(value, torch.Tensor):
                raise WireError(f"payload value {key!r} is not a tensor")
