"""The 7B-shaped bench checkpoint's tokenizer decodes every id a dummy-weight thinker can sample."""

from __future__ import annotations

import shutil
import sys

from tokenizers import Tokenizer

from tests.conftest import MODELS, REPO


def test_fill_vocab_gives_every_id_text_and_leaves_encoding_alone(tiny_models, tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    from qwen2_5_omni_shape import fill_vocab

    src = MODELS / "tiny-qwen2_5-omni" / "tokenizer.json"
    dst = tmp_path / "tokenizer.json"
    shutil.copy(src, dst)
    before = Tokenizer.from_file(str(src))
    size = before.get_vocab_size(with_added_tokens=True)
    assert fill_vocab(dst, size + 700) == 700
    after = Tokenizer.from_file(str(dst))
    assert after.get_vocab_size(with_added_tokens=True) == size + 700
    for i in (size, size + 1, size + 699):
        assert after.decode([i]) == f" w{i}"
    text = "Hello, who are you? The sea is wide."
    assert after.encode(text).ids == before.encode(text).ids
    assert after.decode(before.encode(text).ids) == before.decode(before.encode(text).ids)
    for token in ("<|im_start|>", "<|endoftext|>"):  # specials keep their ids
        assert after.token_to_id(token) == before.token_to_id(token) is not None
    assert fill_vocab(dst, size + 700) == 0  # idempotent
