"""A damaged embedding cache (issue 39 item 10, the dense side): a matrix or shard whose header was
overwritten or that was cut short, a matrix with one bit flipped in its numbers (its SHA-256 no
longer the one meta.json recorded), and a meta or progress file of random bytes, are named in a
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
    elif how == "bit":  # one bit of one number in the body: still a valid .npy file
        data[-5] ^= 0x10
    else:  # "random": the whole file
        data = bytearray(random.Random(39).randbytes(len(data)))
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("name", "how"), [("embeddings.npy", "header"), ("embeddings.npy", "cut"),
                                           ("embeddings.npy", "bit"), ("meta.json", "random")])
def test_a_damaged_matrix_is_encoded_again(tmp_path, caplog, name, how):
    spec = get_encoder_spec("minilm")
    first = encode_corpus(HashEncoder(spec), DOCS, root=tmp_path, shard_size=4)
    expected = np.array(first)
    (folder,) = list(tmp_path.iterdir())
    _spoil(folder / name, how)
    if how == "bit":  # a silent change: numpy reads it as another number
        assert not np.array_equal(np.load(folder / name), expected)
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


def test_a_matrix_without_a_checksum_still_loads_and_a_good_one_is_read_once(tmp_path, monkeypatch):
    """A folder written by an earlier version (no ``sha256`` in meta.json) is used as it is; a
    matching matrix is hashed once per process, not at every load."""
    import json

    from r2med_agent.retrieval.dense import cache as cache_mod

    spec = get_encoder_spec("minilm")
    expected = np.array(encode_corpus(HashEncoder(spec), DOCS, root=tmp_path, shard_size=4))
    (folder,) = list(tmp_path.iterdir())
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["sha256"] == cache_mod.file_sha256(folder / "embeddings.npy")
    real, hashed = cache_mod.file_sha256, []
    monkeypatch.setattr(cache_mod, "file_sha256", lambda p: hashed.append(p) or real(p))
    cache_mod._CHECKED.clear()  # a new process
    for _ in range(2):
        again = HashEncoder(spec)
        np.testing.assert_array_equal(encode_corpus(again, DOCS, root=tmp_path, shard_size=4), expected)
        assert again.texts_encoded == 0
    assert hashed == [folder / "embeddings.npy"]  # checked once
    cache_mod._CHECKED.clear()
    del meta["sha256"]
    (folder / "meta.json").write_text(json.dumps(meta))
    again = HashEncoder(spec)
    np.testing.assert_array_equal(encode_corpus(again, DOCS, root=tmp_path, shard_size=4), expected)
    assert again.texts_encoded == 0 and len(hashed) == 1  # nothing to check against
