"""Stages started by hand (as docker-compose or another host would), over TCP on loopback, in any
order; `serve --external-stages` finds them and leaves them running when it stops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai

from tests.conftest import MODELS, REPO, Server, free_port

# The tiny thinker as a stage on loopback TCP port {p0} (a str.format template, as the pipelines below).
THINKER_STAGE = """  - id: 0
    name: thinker
    model: {thinker}
    address: tcp://127.0.0.1:{p0}
    engine_args: {{dtype: float32, max_model_len: 1024, max_num_seqs: 4, enforce_eager: true,
                  kv_cache_memory_bytes: 67108864, limit_mm_per_prompt: {{image: 1, audio: 1, video: 0}}}}
    env: {{TORCHDYNAMO_DISABLE: "1"}}
    output: text
"""

PIPELINE = """
model: external
stages:
""" + THINKER_STAGE + """  - id: 1
    name: follower
    model: {lm}
    address: tcp://127.0.0.1:{p1}
    inputs: [0]
    input_processor: hidden_to_embeds
    engine_args: {{dtype: float32, max_model_len: 1024, max_num_seqs: 4, enforce_eager: true,
                  kv_cache_memory_bytes: 67108864}}
    env: {{TORCHDYNAMO_DISABLE: "1"}}
    output: tokens
    default_sampling: {{temperature: 0, max_tokens: 3}}
server:
  output_address: tcp://127.0.0.1:{p2}
  stage_timeout_s: 3
"""


def _stage(config, stage_id, log):
    return subprocess.Popen([sys.executable, "-m", "omni_server.cli", "stage", "--config", str(config),
                             "--stage", str(stage_id)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait_health(api, predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate(httpx.get(f"{api.base_url}/health", timeout=5).json()):
            return True
        time.sleep(0.25)
    return False


def test_external_stages_any_order(tiny_models, tmp_path):
    config = tmp_path / "pipeline.yaml"
    config.write_text(PIPELINE.format(thinker=MODELS / "tiny-qwen2_5-omni", lm=MODELS / "tiny-embeds-lm",
                                      p0=free_port(), p1=free_port(), p2=free_port()))
    logs = [open(tmp_path / f"stage{i}.log", "wb") for i in range(2)]
    stages = {1: _stage(config, 1, logs[1])}  # the consumer first, then the api, then the producer
    api = Server(config, tmp_path / "api.log", args=["--external-stages"])
    time.sleep(2)
    stages[0] = _stage(config, 0, logs[0])
    try:
        api.wait_ready(time.monotonic() + 420)
        client = openai.OpenAI(base_url=f"{api.base_url}/v1", api_key="x", max_retries=0)
        resp = client.chat.completions.create(model="external", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, temperature=0)
        assert resp.usage.completion_tokens >= 1
        assert len(resp.model_extra["omni_outputs"]["follower"]["token_ids"]) >= 1
        assert set(httpx.get(f"{api.base_url}/health").json()["pids"].values()) == {p.pid for p in stages.values()}

        # A stage that stops answering (hung; here: stopped) is marked down, and back once it answers.
        os.kill(stages[0].pid, signal.SIGSTOP)
        try:
            assert _wait_health(api, lambda h: h["stages"]["thinker"] == "down", 20), "hung stage not marked down"
            r = httpx.post(f"{api.base_url}/v1/chat/completions", timeout=10,
                           json={"model": "external", "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 503
        finally:
            os.kill(stages[0].pid, signal.SIGCONT)
        assert _wait_health(api, lambda h: h["status"] == "ok", 30), "stage did not come back"
        resp = client.chat.completions.create(model="external", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2, temperature=0)
        assert resp.usage.completion_tokens >= 1

        assert api.stop() == 0
        assert all(p.poll() is None for p in stages.values()), "stopping the api must not stop external stages"
    finally:
        api.stop()
        for p in stages.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = []
        for p in stages.values():
            try:
                codes.append(p.wait(60))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                codes.append(p.wait())
        for f in logs:
            f.close()
    assert codes == [0, 0], [(tmp_path / f"stage{i}.log").read_text()[-3000:] for i in range(2)]


CURVE_PIPELINE = """
model: curve
stages:
""" + THINKER_STAGE + """server:
  output_address: tcp://127.0.0.1:{p1}
  curve_keys_dir: keys
"""


def test_curve_keys_encrypt_and_authenticate_tcp(tiny_models, tmp_path):
    """With server.curve_keys_dir, the processes talk CURVE; a peer without the deployment's key
    (plain TCP, or CURVE with its own key) gets nothing accepted: its Shutdown does not stop the stage."""
    import zmq
    import zmq.auth

    from omni_server.wire.codec import Encoder
    from omni_server.wire.messages import Shutdown
    from omni_server.wire.security import Curve

    assert subprocess.run([sys.executable, "-m", "omni_server.cli", "keys", str(tmp_path / "keys")],
                          cwd=REPO, capture_output=True).returncode == 0
    p0 = free_port()
    config = tmp_path / "pipeline.yaml"
    config.write_text(CURVE_PIPELINE.format(thinker=MODELS / "tiny-qwen2_5-omni", p0=p0, p1=free_port()))
    log = open(tmp_path / "stage0.log", "wb")
    stage = _stage(config, 0, log)
    api = Server(config, tmp_path / "api.log", args=["--external-stages"])
    ctx = zmq.Context()
    try:
        api.wait_ready(time.monotonic() + 420)
        client = openai.OpenAI(base_url=f"{api.base_url}/v1", api_key="x", max_retries=0)
        ask = lambda: client.chat.completions.create(  # noqa: E731
            model="curve", messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0)
        assert ask().usage.completion_tokens >= 1

        stranger_public, stranger_secret = zmq.auth.create_certificates(str(tmp_path), "stranger")
        server_public, _ = zmq.auth.load_certificate(str(tmp_path / "keys" / "omni.key"))
        plain = ctx.socket(zmq.PUSH)
        foreign = ctx.socket(zmq.PUSH)
        foreign.curve_serverkey = server_public  # knows the public key, not the deployment's secret
        foreign.curve_publickey, foreign.curve_secretkey = zmq.auth.load_certificate(stranger_secret)
        for sock in (plain, foreign):
            sock.setsockopt(zmq.LINGER, 0)
            # libzmq drops a connection whose handshake failed; once that happens a PUSH has no pipe
            # and a blocking send waits forever. Not being able to queue is also "nothing accepted".
            sock.setsockopt(zmq.SNDTIMEO, 2000)
            sock.connect(f"tcp://127.0.0.1:{p0}")
            try:
                sock.send_multipart(Encoder().encode(Shutdown()))
            except zmq.Again:
                pass
        time.sleep(3)
        assert stage.poll() is None, "a peer without the key stopped the stage"
        assert ask().usage.completion_tokens >= 1

        # The same message from a holder of the key is accepted: the stage shuts down cleanly.
        member = ctx.socket(zmq.PUSH)
        member.setsockopt(zmq.LINGER, 2000)
        Curve(tmp_path / "keys").client(member)
        member.connect(f"tcp://127.0.0.1:{p0}")
        member.send_multipart(Encoder().encode(Shutdown()))
        assert stage.wait(60) == 0
    finally:
        ctx.destroy(linger=0)
        api.stop()
        if stage.poll() is None:
            stage.send_signal(signal.SIGTERM)
        try:
            code = stage.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(stage.pid, signal.SIGKILL)
            code = stage.wait()
        log.close()
    assert code == 0, (tmp_path / "stage0.log").read_text()[-3000:]
