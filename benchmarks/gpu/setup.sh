# Source on the device after the chunks are in /tmp/stage; returns non-zero (and says why) on failure.
if [ ! -d /tmp/site/vllm ]; then
  mkdir -p /tmp/site && cat /tmp/stage/part.* | xz -d -T8 | tar -x -C /tmp/site || { echo "unpack failed"; return 1; }
fi
# soundfile comes as a wheel in .gpu/extra (carried with the last chunk); later calls need not carry it.
if [ ! -f /tmp/site/soundfile.py ]; then
  python3 -m zipfile -e .gpu/extra/soundfile-*.whl /tmp/site || { echo "soundfile wheel missing"; return 1; }
fi
# PyAV (a video's audio track), when a call left its wheel in /tmp/stage (.gpu/av: too big to ride
# with the last chunk and .gpu/extra).
if [ ! -d /tmp/site/av ] && ls /tmp/stage/av-*.whl >/dev/null 2>&1; then
  python3 -m zipfile -e /tmp/stage/av-*.whl /tmp/site || { echo "av wheel failed"; return 1; }
fi
# py-spy (a static binary; step `spy`), when .gpu/extra has it.
[ -x .gpu/extra/py-spy ] && cp .gpu/extra/py-spy /tmp/py-spy
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_V2_MODEL_RUNNER=0 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
python3 -m omni_server.models.tiny_checkpoints >/dev/null || { echo "tiny checkpoints failed"; return 1; }
