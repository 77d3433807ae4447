"""Socket addresses and send/receive helpers shared by the api process and the stages.

Topology: every stage process (each replica of a stage) binds one PULL input socket; the api binds
one PULL output socket. The api PUSHes requests to each stage, stages PUSH deltas to the api,
payloads to the downstream stages and credits to the upstream ones (the replica serving the request).
Defaults are ipc sockets in a private runtime dir; TCP addresses come from the YAML.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from pathlib import Path
from typing import Iterator

import zmq

from omni_server.config.schema import PipelineConfig
from omni_server.wire.codec import DEFAULT_MAX_BYTES, Decoder, Encoder, WireError
from omni_server.wire.messages import Message
from omni_server.wire.security import Curve, curve_for

log = logging.getLogger(__name__)

# Messages queued per peer before sends block (a PUSH to a stopped stage must not eat memory forever).
SEND_HWM = 100_000


_locks: list = []  # (open files holding runtime_dir locks: held for the process's life)


def not_private(path: Path) -> str | None:
    """Why a socket directory is not safe to serve from (None: it is): another user could replace
    its sockets (ZMQ binds over an existing ipc path)."""
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        return f"must be owned by this user and writable by no one else (owner uid {st.st_uid}, mode {oct(st.st_mode & 0o777)})"
    return None


def make_runtime_dir(cfg: PipelineConfig) -> Path:
    """`serve`'s socket directory: the configured one, locked against a second `serve` (ZMQ lets a
    second process bind an ipc path another listens on: it would take over the first one's
    sockets without a word), or a private temporary one."""
    if cfg.runtime_dir:
        path = Path(cfg.runtime_dir)
        try:
            path.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as e:
            raise SystemExit(f"runtime_dir {path}: cannot create it: {e.strerror or e}") from None
        why = not_private(path)  # (checked before anything is written there)
        if why:
            raise SystemExit(f"runtime_dir {path} {why}: e.g. chmod 700 {path}")
        try:
            lock = open(path / "serve.lock", "a")
        except OSError as e:
            raise SystemExit(f"runtime_dir {path}: cannot write in it: {e.strerror or e}") from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise SystemExit(f"runtime_dir {path} is in use by another `omni-server serve`") from None
        _locks.append(lock)
        return path
    return Path(tempfile.mkdtemp(prefix="omni-server-"))  # mode 0700: sockets stay private


def input_socket(ctx: zmq.Context, curve: Curve | None, address: str, max_bytes: int = DEFAULT_MAX_BYTES) -> zmq.Socket:
    """A bound PULL socket. A frame over `max_bytes` (what the decoder refuses anyway) is dropped by
    zmq before it is buffered, and its sender disconnected: a peer cannot make us allocate it."""
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    if curve:
        curve.server(sock)
    sock.bind(address)
    return sock


def stage_address(cfg: PipelineConfig, stage_id: int, runtime_dir: Path | str, replica: int = 0) -> str:
    name = f"stage{stage_id}.in" if replica == 0 else f"stage{stage_id}.{replica}.in"
    return cfg.stage(stage_id).address_of(replica) or f"ipc://{Path(runtime_dir) / name}"


def api_address(cfg: PipelineConfig, runtime_dir: Path | str) -> str:
    return cfg.server.output_address or f"ipc://{Path(runtime_dir) / 'api.out'}"


def decode_or_none(decoder: Decoder, frames, where: str) -> Message | None:
    try:
        return decoder.decode(frames)
    except WireError as e:
        log.warning("%s: dropped malformed message: %s", where, e)
        return None


class StageSockets:
    """A stage's sockets (blocking pyzmq: the stage loop is single-threaded)."""

    def __init__(self, cfg: PipelineConfig, stage_id: int, runtime_dir: Path | str, replica: int = 0):
        self.ctx = zmq.Context()
        self.replica = replica
        self.name = f"stage {stage_id}" + (f" replica {replica}" if replica else "")
        self.curve = curve_for(cfg.server.curve_keys_dir)
        if self.curve:
            self.curve.start_authenticator(self.ctx)
        self.input = input_socket(self.ctx, self.curve, stage_address(cfg, stage_id, runtime_dir, replica))
        self.api = self._push(api_address(cfg, runtime_dir))
        # Consumers get payloads; sources get stream credits back.
        peers = set(cfg.consumers(stage_id)) | set(cfg.stage(stage_id).inputs)
        self.stages = {(c, r): self._push(stage_address(cfg, c, runtime_dir, r))
                       for c in sorted(peers) for r in range(cfg.stage(c).replicas)}
        self.encoder = Encoder()
        self.decoder = Decoder()
        self.poller = zmq.Poller()
        self.poller.register(self.input, zmq.POLLIN)

    def _push(self, address: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.setsockopt(zmq.LINGER, 2000)
        if self.curve:
            self.curve.client(sock)
        sock.connect(address)
        return sock

    def recv_inputs(self, timeout_ms: int) -> Iterator[Message]:
        """Yield every message already queued (waiting up to timeout_ms for the first)."""
        if not self.poller.poll(timeout_ms):
            return
        while True:
            try:
                frames = self.input.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            msg = decode_or_none(self.decoder, frames, self.name)
            if msg is not None:
                yield msg

    def send_api(self, msg: Message) -> None:
        self.api.send_multipart(self.encoder.encode(msg), copy=False)

    def send_stage(self, stage_id: int, msg: Message, replica: int = 0) -> None:
        self.stages[(stage_id, replica)].send_multipart(self.encoder.encode(msg), copy=False)

    def close(self) -> None:
        if self.curve:
            self.curve.stop()
        self.ctx.destroy(linger=1000)
