"""A damaged embedding cache (issue 39 item 10, the dense side): a matrix or shard whose header was
overwritten or that was cut short, and a meta or progress file of random bytes, are named in a
warning and encoded again, never a numpy traceback and never used as they are."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import pytest

from r2med_agent.retrieval.dense.cache import encode_corpus
from r2med_agent.retrieval.dense.spec import get_encoder_spec
from tests.unit.retrieval.test_dense import DOCS, HashEncoder


def _spoil(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "header":
        data[:64] = random.Random(39).randbytes(64)
    elif how == "cut":
        data = data[: len(data) // 2]
    else:  # "random": the whole file
        data = bytearray(random.Random(39).randbytes(len(data)))
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("name", "how"), [("embeddings.npy", "header"), ("embeddings.npy", "cut"),
                                           ("meta.json", "random")])
def test_a_damaged_matrix_is_encoded_again(tmp_path, caplog, name, how):
    spec = get_encoder_spec("minilm")
    first = encode_corpus(HashEncoder(spec), DOCS, root=tmp_path, shard_size=4)
    expected = np.array(first)
    (folder,) = list(tmp_path.iterdir())
    _spoil(folder / name, how)
    again = HashEncoder(spec)
    with caplog.at_level(logging.WARNING):
        got = encode_corpus(again, DOCS, root=tmp_path, shard_size=4)
    assert again.texts_encoded == len(DOCS)
    np.testing.assert_array_equal(got, expected)
    if name.endswith(".npy"):
        assert f"{folder / name} is damaged" in caplog.text


def test_a_damaged_shard_is_encoded_again(tmp_path, caplog):
    spec = get_encoder_spec("minilm")
    with pytest.raises(KeyboardInterrupt):
        encode_corpus(HashEncoder(spec, fail_on_call=3), DOCS, root=tmp_path, shard_size=4)
    (folder,) = list(tmp_path.iterdir())
    _spoil(folder / "shards" / "00001.npy", "header")
    resumed = HashEncoder(spec)
    with caplog.at_level(logging.WARNING):
        got = encode_corpus(resumed, DOCS, root=tmp_path, shard_size=4)
    assert resumed.texts_encoded == 6  # the damaged shard of 4 and the missing one of 2
    assert "00001.npy is damaged" in caplog.text
    np.testing.assert_allclose(got, encode_corpus(HashEncoder(spec), DOCS, use_cache=False), atol=1e-7)
