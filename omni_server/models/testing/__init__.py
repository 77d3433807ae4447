"""Test-only pipeline pieces (named `testing.*` in YAML); never used by the shipped configs."""

from __future__ import annotations

import os
from pathlib import Path

from safetensors.torch import save_file

from omni_server.stage import processors
from omni_server.stage.processors import StageInput, hidden_to_embeds

# Directory where `testing.record_hidden_to_embeds` writes what the stage received.
RECORD_DIR_ENV = "OMNI_TEST_RECORD_DIR"


@processors.register("testing.record_hidden_to_embeds")
def record_hidden_to_embeds(payloads, ctx, options) -> StageInput:
    """`hidden_to_embeds`, after saving each received payload so a test can inspect it."""
    out_dir = os.environ.get(RECORD_DIR_ENV)
    if out_dir:
        for src, p in payloads.items():
            tensors = {k: v.clone() for k, v in p.tensors.items()}
            meta = {"prompt_token_ids": ",".join(map(str, p.prompt_token_ids)),
                    "output_token_ids": ",".join(map(str, p.output_token_ids))}
            save_file(tensors, str(Path(out_dir) / f"{p.request_id}.from{src}.safetensors"), metadata=meta)
    return hidden_to_embeds(payloads, ctx, options)
