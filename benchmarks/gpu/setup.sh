# Source on the device after the chunks are in /tmp/stage.
set -e
if [ ! -d /tmp/site/vllm ]; then
  mkdir -p /tmp/site && cat /tmp/stage/part.* | xz -d -T8 | tar -x -C /tmp/site
fi
python3 -m zipfile -e .gpu/extra/soundfile-*.whl /tmp/site
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_V2_MODEL_RUNNER=0 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
python3 -m omni_server.models.tiny_checkpoints >/dev/null
set +e
