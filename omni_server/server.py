"""`omni-server serve`: stage processes + HTTP server in one supervised unit."""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import signal
import socket
import sys
import time

import uvicorn

from omni_server.api.app import ServerState, create_app
from omni_server.config.schema import PipelineConfig
from omni_server.orchestrator.launcher import Launcher
from omni_server.orchestrator.mps import MPSError
from omni_server.orchestrator.orchestrator import Orchestrator
from omni_server.orchestrator.supervisor import Supervisor
from omni_server.wire.transport import make_runtime_dir

log = logging.getLogger(__name__)


class _Stopped(BaseException):
    """SIGINT / SIGTERM before the api serves (a BaseException, as KeyboardInterrupt: library code
    that catches Exception while the api sets up must not swallow it)."""


def open_without_key(host: str, key: str | None) -> bool:
    """Whether the api would listen beyond this machine (not a loopback address or `localhost`)
    with no API key."""
    if key:
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:  # (a host name)
        return host != "localhost"


def listen(host: str, port: int) -> list[socket.socket]:
    """The api's listening sockets, bound before any stage starts: a port in use or a host that does
    not resolve is a one-line error at once, not one from uvicorn after every stage launched. One per
    address the host resolves to (as asyncio's create_server binds them)."""
    where = f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise SystemExit(f"cannot listen on {where}: {e.strerror}") from None
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((addr[0], port, *addr[2:]))
            port = sock.getsockname()[1]  # (port 0: the others on the one the first got)
    except OSError as e:
        for sock in socks:
            sock.close()
        raise SystemExit(f"cannot listen on {where}: {e.strerror or e}") from None
    return socks


def check_api_sockets(cfg: PipelineConfig, runtime_dir) -> None:
    """The api's own ZMQ set-up, tried before any stage starts: CURVE keys that do not load, or an
    output address it cannot bind (a port in use, a host that does not resolve, a missing ipc
    directory), are a one-line error at once, not uvicorn's traceback after every stage launched."""
    import zmq

    from omni_server.wire.security import curve_for
    from omni_server.wire.transport import api_address

    try:
        curve_for(cfg.server.curve_keys_dir)
    except (OSError, ValueError) as e:
        raise SystemExit(f"server.curve_keys_dir: {cfg.server.curve_keys_dir}: {e}") from None
    address = api_address(cfg, runtime_dir)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.bind(address)
    except zmq.ZMQError as e:
        raise SystemExit(f"cannot listen on {address} (the api's output address): {e.strerror}") from None
    finally:
        sock.close()
        ctx.term()  # (waits for the close: the address is free again for the orchestrator)


async def serve(cfg: PipelineConfig, external_stages: bool = False, started: float | None = None) -> int:
    """Run the api; start and supervise the stage processes unless they are external (started
    separately, e.g. by docker-compose or on other hosts, and found at their configured addresses).
    `started`: the command's time.monotonic(), which the ready time counts from (default: now)."""
    t0 = time.monotonic() if started is None else started
    if external_stages:
        missing = [s.name for s in cfg.stages if not s.address] + (
            [] if cfg.server.output_address else ["server.output_address"])
        if missing and not cfg.runtime_dir:
            raise SystemExit(f"--external-stages needs `address` on every stage and server.output_address "
                             f"(or a shared runtime_dir); missing: {', '.join(missing)}")
    if open_without_key(cfg.server.host, cfg.server.api_key or os.environ.get("OMNI_SERVER_API_KEY")):
        log.warning("serving on %s without an API key: anyone who reaches this port can use the pipeline "
                    "(--api-key, server.api_key or OMNI_SERVER_API_KEY sets one)", cfg.server.host)
    listening = listen(cfg.server.host, cfg.server.port)
    try:
        runtime_dir = make_runtime_dir(cfg)
        try:
            check_api_sockets(cfg, runtime_dir)
        except SystemExit:
            if cfg.runtime_dir is None:
                shutil.rmtree(runtime_dir, ignore_errors=True)
            raise
    except SystemExit:
        for sock in listening:
            sock.close()
        raise
    launcher = Launcher(cfg, runtime_dir)
    try:
        mps = None if external_stages else launcher.start_mps()
    except MPSError as e:
        if cfg.runtime_dir is None:
            shutil.rmtree(runtime_dir, ignore_errors=True)
        raise SystemExit(f"cuda_mps: true, but no MPS daemon: {e}") from None
    # Until uvicorn takes the signals over (it stops gracefully on them): Ctrl-C or SIGTERM while the
    # stages start and the api sets up stops everything cleanly, exit 0, as later.
    signals: list[str] = []  # (received so far: also seen where a raise was swallowed or not possible)

    def stop_starting(signum, frame) -> None:
        signals.append(signal.Signals(signum).name)
        raise _Stopped(signals[-1])

    def noted(signum, frame) -> None:
        signals.append(signal.Signals(signum).name)

    # A stop raised where Python cannot raise (a callback, such as an import lock's) is printed as
    # "Exception ignored ... Traceback": not an error here, `signals` has it and stops serve below.
    default_unraisable = sys.unraisablehook

    def unraisable(info) -> None:
        if not isinstance(info.exc_value, _Stopped):
            default_unraisable(info)

    sys.unraisablehook = unraisable

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop_starting)
    # The terminal closing (SIGHUP) stops serve as SIGTERM does, whoever handles that one by then
    # (uvicorn while serving); by default it killed serve without its clean-up.
    signal.signal(signal.SIGHUP, lambda signum, frame: os.kill(os.getpid(), signal.SIGTERM))
    failed: list[str] = []
    try:
        # Every stage process starts now, before the api's own set-up (tokenizer, media processors,
        # sockets: ~9 s on the H200 host): their imports (~15 s each there) overlap it. Each
        # connects to the api's sockets when they exist (ZMQ connects in the background).
        # One that shares a GPU with earlier engines builds its own only when they are ready (vLLM
        # sizes its KV cache from the GPU memory it finds free): held until then (supervise).
        after = {} if external_stages else {unit: launcher.start_after(unit) for unit in cfg.units()}
        for unit, before in after.items():
            launcher.start(unit, hold=bool(before))
        launched = time.monotonic()  # (startup_timeout_s counts from here)
        try:
            state = ServerState(cfg, lambda: Orchestrator(cfg, runtime_dir), on_startup=None)
        except Exception as e:  # (its tokenizer: a hub id offline or gated, files it cannot read)
            stage0 = cfg.stage(0)
            why = " ".join(str(e).split())
            failed.append(f"stage 0 ({stage0.name}): the api cannot load its tokenizer from "
                          f"{stage0.tokenizer or stage0.model!r}: {type(e).__name__}: {why[:400]}")
            raise _Stopped("the api's set-up failed") from None
        uv = uvicorn.Server(uvicorn.Config(create_app(state), host=cfg.server.host, port=cfg.server.port,
                                           log_level="info",
                                           timeout_graceful_shutdown=cfg.server.shutdown_timeout_s,
                                           # (a Realtime event up to twice the request limit is read and
                                           # refused with an error event; larger ones close the socket)
                                           ws_max_size=2 * cfg.server.max_request_bytes,
                                           ws_max_queue=4))  # (frames read ahead of the session: 4 at most)

        state.on_startup = Supervisor(cfg, launcher, uv, after=after, launched=launched, started=t0,
                                      runtime_dir=runtime_dir, external=external_stages, mps=mps,
                                      signals=signals, failed=failed).run
        # uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown, restoring the handlers it found;
        # with these in place that re-raise is harmless and the stages below still get stopped.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, noted)
        if signals:
            raise _Stopped(signals[0])
        await uv.serve(sockets=listening)
    except _Stopped as e:
        log.info("%s while starting: stopping the stages", e)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # (a second one must not cut the clean-up short)
            signal.signal(sig, lambda signum, frame: None)
        sys.unraisablehook = default_unraisable
        launcher.stop_all()
        for sock in listening:
            sock.close()
        if mps is not None:
            mps.stop()
        if cfg.runtime_dir is None:
            shutil.rmtree(runtime_dir, ignore_errors=True)
    for f in failed:
        log.error("%s", f)
    return 1 if failed else 0
