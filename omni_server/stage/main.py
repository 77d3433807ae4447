"""Entry point of one stage process: `omni-server stage --config F --stage N`."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

from omni_server.config.schema import PipelineConfig

log = logging.getLogger(__name__)


def _watch_parent(parent_pid: int) -> None:
    # Started by `serve`: if it dies without stopping us (kill -9), do not linger as an orphan.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            log.error("parent process %d is gone; stage exiting", parent_pid)
            os._exit(1)


def visible_devices(devices: str, inherited: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for a stage whose config says `devices`: indices into the GPUs `serve`
    itself sees (`inherited`, its CUDA_VISIBLE_DEVICES, if set), as for any CUDA program."""
    if not inherited or not inherited.strip():
        return devices
    seen = [d.strip() for d in inherited.split(",") if d.strip()]
    picked = []
    for d in (d.strip() for d in devices.split(",")):
        if not d.isdigit():  # a UUID or MIG name: as given
            picked.append(d)
        elif int(d) < len(seen):
            picked.append(seen[int(d)])
        else:
            raise SystemExit(f"devices {devices!r}: GPU {d} is not among the {len(seen)} visible "
                             f"(CUDA_VISIBLE_DEVICES={inherited})")
    return ",".join(picked)


def run_stage(cfg: PipelineConfig, stage_id: int, runtime_dir: str, parent_pid: int | None = None,
              replica: int = 0, hold: bool = False) -> None:
    stage = cfg.stage(stage_id)
    if not 0 <= replica < stage.replicas:
        raise SystemExit(f"stage {stage_id} ({stage.name}) has {stage.replicas} replica(s); no replica {replica}")
    # Our runner extends vLLM's V1 runner; the V2 runner would silently bypass it.
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    # The stage process is the engine core; with one worker, that worker runs in it too (as vLLM
    # does on GPUs). On CPU hosts vLLM would otherwise start a worker process per engine: an extra
    # hop per step, and a distributed-init port picked by one process and bound seconds later by
    # another, which engines starting together can both pick (EADDRINUSE at start).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    for key, value in stage.env.items():  # (the config's, or --stage-arg's, over the serve process's own)
        os.environ[key] = value
    if stage.devices_of(replica) is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices(stage.devices_of(replica),
                                                             os.environ.get("CUDA_VISIBLE_DEVICES"))
    if parent_pid:
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()

    import torch
    from vllm.platforms import current_platform

    on_cpu = current_platform.device_type == "cpu"
    if not on_cpu and "OMP_NUM_THREADS" not in os.environ:
        # The step loop's own tensor work is small: the GPU does the math. More host threads only
        # add contention (OpenMP threads spin-waiting on a busy machine turn millisecond ops into
        # seconds). On CPU hosts the model runs in this process: OMP_NUM_THREADS decides.
        torch.set_num_threads(1)

    from omni_server.wire.transport import StageSockets

    sockets = StageSockets(cfg, stage_id, runtime_dir, replica)
    if stage.kind == "ar":
        from omni_server.models import register_vllm_models
        from omni_server.stage.ar import ARStage as Stage, preload

        register_vllm_models()
    else:
        from omni_server.stage.generation import GenerationStage as Stage, preload
    if hold:
        preload(cfg, stage_id)
        name = cfg.unit_name((stage_id, replica))
        log.info("stage %d (%s) imported; waiting for the earlier stages on its GPUs", stage_id, name)
        if sys.stdin.readline().strip() != "go":
            log.info("stage %d (%s): no go from the server; exiting", stage_id, name)
            sockets.close()
            return
    engine = Stage(cfg, stage_id, sockets)

    def _stop(signum, frame):
        engine.running = False

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    log.info("stage %d (%s) ready in %.1f s", stage_id, cfg.unit_name((stage_id, replica)), engine.startup_s)
    try:
        engine.run()
    finally:
        sockets.close()
