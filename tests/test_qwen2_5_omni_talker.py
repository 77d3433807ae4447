"""The talker samples only what token2wav can decode (codec codes and the two ends of speech)."""

from __future__ import annotations

import json
import sys

import torch
from transformers import Qwen2_5OmniConfig

from omni_server.models.qwen2_5_omni.codec import banned_ids
from tests.conftest import REPO


def test_talker_bans_every_id_token2wav_cannot_decode(tmp_path):
    # The real 7B layout: an 8448-id talker table, DiT codes 0..8193, specials 8292..8296.
    sys.path.insert(0, str(REPO / "benchmarks"))
    from qwen2_5_omni_shape import config_dicts

    (tmp_path / "config.json").write_text(json.dumps(Qwen2_5OmniConfig(**config_dicts("7b")).to_dict()))
    talker = Qwen2_5OmniConfig(**config_dicts("7b")).talker_config
    banned = banned_ids(str(tmp_path), talker)
    allowed = torch.nonzero(~banned).flatten().tolist()
    assert banned.shape == (8448,)
    assert allowed == list(range(8194)) + [8292, 8294]  # codes, pad (ends speech), end
    assert banned[8293] and banned[8296]  # start and mask are never sampled


def test_talker_without_a_token2wav_config_still_bans_the_specials(tmp_path):
    # A checkpoint dir without token2wav_config (or a hub id not cached): only ids below the specials.
    sys.path.insert(0, str(REPO / "benchmarks"))
    from qwen2_5_omni_shape import config_dicts

    talker = Qwen2_5OmniConfig(**config_dicts("7b")).talker_config
    allowed = torch.nonzero(~banned_ids(str(tmp_path / "missing"), talker)).flatten().tolist()
    assert allowed == list(range(8293)) + [8294]  # everything below the specials, pad, end


def test_the_bench_reference_talker_bans_the_same_ids():
    # transformers' talker in `omni-server bench --reference` masks what ours masks: on a GPU an
    # undecodable id is a device assert in token2wav (seen with dummy 7B weights on the H200).
    from omni_server.models.qwen2_5_omni.reference import _Ban

    sys.path.insert(0, str(REPO / "benchmarks"))
    from qwen2_5_omni_shape import config_dicts

    talker = Qwen2_5OmniConfig(**config_dicts("7b")).talker_config
    banned = banned_ids("missing-dir", talker)
    scores = torch.randn(3, talker.vocab_size)
    out = _Ban(banned)(torch.zeros(3, 5, dtype=torch.long), scores.clone())
    assert torch.isneginf(out[:, banned]).all()
    assert torch.equal(out[:, ~banned], scores[:, ~banned])
