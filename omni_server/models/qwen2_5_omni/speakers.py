"""The voices a Qwen2.5-Omni checkpoint ships in `spk_dict.pt`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

SPEAKERS_FILE = "spk_dict.pt"


@dataclass
class Speaker:
    bos_token: int  # the talker's text-stream start token for this voice
    cond: torch.Tensor  # speaker embedding fed to the DiT, [1, enc_emb_dim]
    ref_mel: torch.Tensor  # reference mel spectrogram, [1, frames, mel_dim]


def load_speakers(model_dir: str) -> dict[str, Speaker]:
    """Voice name -> Speaker, read on CPU from `<model_dir>/spk_dict.pt`."""
    path = Path(model_dir) / SPEAKERS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {SPEAKERS_FILE} in {model_dir}: a Qwen2.5-Omni checkpoint ships its voices there")
    # A local checkpoint file; weights_only keeps the unpickler to plain tensors and containers.
    raw = torch.load(path, weights_only=True, map_location="cpu")
    return {name: Speaker(bos_token=int(v["bos_token"]), cond=v["cond"], ref_mel=v["ref_mel"])
            for name, v in raw.items()}
