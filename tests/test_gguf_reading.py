"""runtime/model/gguf_reading.py: gguf-py's reader over a plain array (the same fields and
tensors as GGUFReader's own), and one parse per file while a GGUF converts."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGUFReader

from sgl_nb.runtime.model.gguf_reading import FastGGUFReader, converting_gguf, open_gguf
from sgl_nb.runtime.model.model_loader import default_gguf_path


@pytest.fixture(scope="module")
def path():
    return default_gguf_path()


def test_the_fast_reader_gives_gguf_pys_fields_and_tensors(path):
    want, got = GGUFReader(path), FastGGUFReader(path)
    assert type(got.data) is np.ndarray and not got.data.flags.writeable
    assert list(got.fields) == list(want.fields)
    for key, field in want.fields.items():
        assert got.fields[key].types == field.types, key
        assert got.fields[key].contents() == field.contents(), key
    assert len(got.tensors) == len(want.tensors) == 272
    for a, b in zip(got.tensors, want.tensors):
        assert (a.name, a.tensor_type, list(a.shape), a.data_offset) == \
               (b.name, b.tensor_type, list(b.shape), b.data_offset)
        assert np.array_equal(a.data, b.data), a.name


def test_within_a_conversion_each_file_is_parsed_once(path, tmp_path):
    original, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    other = tmp_path / "copy.gguf"
    other.write_bytes(path.read_bytes())
    with converting_gguf():
        first = gguf.GGUFReader(path)  # as transformers' loader opens it
        assert isinstance(first, FastGGUFReader)
        assert gguf.GGUFReader(str(path)) is first and open_gguf(path) is first
        assert open_gguf(other) is not first and open_gguf(other) is open_gguf(other)
        assert first.fields["general.architecture"].contents() == "llama"
        # transformers builds the tensor name map at each of the model's submodules.
        llama = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30) is llama
        assert llama.get_name("model.layers.3.self_attn.q_proj") == "blk.3.attn_q"
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is not llama
    assert gguf.GGUFReader is original and gguf.get_tensor_name_map is name_map
    # Outside, each opening is a parse of its own.
    assert open_gguf(path) is not open_gguf(path)
    assert type(open_gguf(path)) is FastGGUFReader


def test_a_failed_conversion_puts_gguf_pys_reader_back(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    original = gguf.GGUFReader
    with pytest.raises(ValueError, match="GGUF magic invalid"), converting_gguf():
        with pytest.raises(ValueError, match="GGUF magic invalid"):
            gguf.GGUFReader(bad)
        gguf.GGUFReader(bad)  # not kept half-parsed: it fails again
    assert gguf.GGUFReader is original
