"""The deployment files agree with the code: every stage of docker/pipeline.yaml has a compose service
running it with a GPU reservation, the api finds stages over TCP, and the pipeline validates."""

from __future__ import annotations

import re

import pytest
import yaml

from omni_server.config import load_config
from tests.conftest import REPO

DOCKER = REPO / "docker"


def test_compose_runs_every_stage_and_the_api():
    compose = yaml.safe_load((DOCKER / "docker-compose.yml").read_text())
    cfg = load_config(DOCKER / "pipeline.yaml")
    services = compose["services"]
    for stage in cfg.stages:
        host = re.match(r"tcp://([^:]+):\d+$", stage.address).group(1)
        svc = services[host]  # the stage's address names its service
        assert svc["command"][:5] == ["stage", "--config", "/etc/omni/pipeline.yaml", "--stage", str(stage.id)]
        gpus = svc["deploy"]["resources"]["reservations"]["devices"][0]
        assert gpus["driver"] == "nvidia" and gpus["capabilities"] == ["gpu"]
        assert "healthcheck" in svc and svc["restart"] == "unless-stopped"
        # ZMQ binds the address the service name resolves to (not 127.0.0.1): the check dials that name.
        port = int(stage.address.rsplit(":", 1)[1])
        assert f"socket.create_connection(('{host}', {port}), 2)" in svc["healthcheck"]["test"][-1]
    api = services["api"]
    assert "--external-stages" in api["command"] and api["command"][:2] == ["serve", "/etc/omni/pipeline.yaml"]
    assert re.match(r"tcp://api:\d+$", cfg.server.output_address)
    assert api["ports"] == ["${BIND:-127.0.0.1}:${PORT:-8000}:8000"]  # (not every interface unless told)
    for svc in services.values():
        assert "./pipeline.yaml:/etc/omni/pipeline.yaml:ro" in svc["volumes"]
        # The checkpoint: read-only, and a missing MODEL_DIR an error (not an empty directory made for it).
        (model,) = [v for v in svc["volumes"] if isinstance(v, dict) and v["target"] == "/model"]
        assert model["read_only"] and model["bind"] == {"create_host_path": False}
        assert model["source"].startswith("${MODEL_DIR:?")
    assert all(s.model == "/model" for s in cfg.stages)
    assert {s.name for s in cfg.stages} == {"thinker", "talker", "token2wav"}


def test_compose_pipeline_serves_what_the_one_gpu_config_serves():
    """docker/pipeline.yaml is configs/qwen2_5_omni.yaml split into containers: every stage setting
    but where it runs (model path, address, devices) is the same, so docker users get the tuned
    windows, streaming and token2wav speed settings (it ran token2wav's defaults until 2026-12-01)."""
    where = {"model", "address", "devices"}
    docker = load_config(DOCKER / "pipeline.yaml").stages
    one_gpu = load_config(REPO / "configs/qwen2_5_omni.yaml").stages
    assert [s.name for s in docker] == [s.name for s in one_gpu]
    for d, c in zip(docker, one_gpu):
        assert d.model_dump(exclude=where) == c.model_dump(exclude=where), d.name


def test_dockerfile_runs_as_non_root_with_the_cli_entrypoint():
    text = (DOCKER / "Dockerfile").read_text()
    assert re.search(r"^USER omni$", text, re.M)
    # ~/.cache (HF_HOME, vLLM's and Inductor's caches; the compose volume) belongs to that user.
    assert "chown -R omni:omni var /home/omni" in text and "TORCHINDUCTOR_CACHE_DIR=/home/omni/.cache" in text
    assert 'ENTRYPOINT ["omni-server"]' in text
    assert "vllm==0.26.0" in text and "torch==2.11.0" in text
    # (python:*-slim has no C compiler; Triton needs one to launch any kernel it compiles.)
    assert re.search(r"apt-get install .*\bgcc\b.*\blibc6-dev\b", text)


def _compose_cli() -> list[str] | None:
    import shutil
    import subprocess

    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def test_the_mps_override_makes_every_stage_and_only_stages_clients_of_the_host_daemon():
    compose = yaml.safe_load((DOCKER / "docker-compose.yml").read_text())
    mps = yaml.safe_load((DOCKER / "compose.mps.yml").read_text())["services"]
    stages = {name for name, svc in compose["services"].items() if svc["command"][0] == "stage"}
    assert set(mps) == stages == {"thinker", "talker", "token2wav"}
    for svc in mps.values():
        (volume,) = svc["volumes"]
        assert volume.rsplit(":", 1)[1] == svc["environment"]["CUDA_MPS_PIPE_DIRECTORY"]
        assert svc["ipc"] == "host"
    # (the README's docker section names the override)
    assert "compose.mps.yml" in (REPO / "README.md").read_text()


@pytest.mark.skipif(_compose_cli() is None, reason="needs `docker compose` or `docker-compose` (e.g. Debian's docker-compose)")
def test_compose_config_validates():
    """What `docker compose config` makes of the file with the example variables: valid, every stage
    service reserves its GPUs, the api is published on PORT."""
    import subprocess

    proc = subprocess.run([*_compose_cli(), "-f", str(DOCKER / "docker-compose.yml"), "--env-file",
                           str(DOCKER / "example.env"), "config"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    services = yaml.safe_load(proc.stdout)["services"]
    with_mps = subprocess.run([*_compose_cli(), "-f", str(DOCKER / "docker-compose.yml"), "-f",
                               str(DOCKER / "compose.mps.yml"), "--env-file", str(DOCKER / "example.env"), "config"],
                              capture_output=True, text=True, timeout=120)
    assert with_mps.returncode == 0, with_mps.stderr
    merged = yaml.safe_load(with_mps.stdout)["services"]
    assert len(str(merged["thinker"]["volumes"]).split("/tmp/nvidia-mps")) > 1  # added to the model mounts
    assert "/model" in str(merged["thinker"]["volumes"])
    for name in ("thinker", "talker", "token2wav"):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["device_ids"] == ["0"]
    assert any(str(p.get("published", p) if isinstance(p, dict) else p).startswith("8000")
               for p in services["api"]["ports"])


def test_the_build_context_leaves_out_the_venv_and_keeps_what_the_image_copies():
    """(Without .dockerignore the context carried the multi-GB .venv and the built models.)"""
    ignored = [line.strip().rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    assert {".venv", "var", ".git"} <= set(ignored)
    copied = [p.rstrip("/") for line in (DOCKER / "Dockerfile").read_text().splitlines() if line.startswith("COPY ")
              for p in line.split()[1:-1]]
    assert copied and all((REPO / p).exists() and p not in ignored for p in copied), copied
