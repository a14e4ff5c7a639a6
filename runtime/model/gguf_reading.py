"""Reading a GGUF file's header with gguf-py's GGUFReader, fast, and once per conversion.

GGUFReader slices its np.memmap for every value it parses, and each slice of a memmap runs
numpy's Python-level memmap.__getitem__ and __array_finalize__: a tokenizer's vocabulary and
merges (~100k strings in the default model) took 6.5 s a parse. Over a plain array view of
the same mapping the parse takes 2.5 s, and gives the same fields and tensors.

Converting a GGUF parsed it five times: transformers' loader parses the whole file for the
config, again for the weights and again for the tokenizer, and we read the keys it skips and
the quantized blocks. And transformers maps the file's tensor names onto the model's by
walking every submodule, building gguf-py's name map (25 ms) at each: 10 s for the default
model's ~400 modules. Within `converting_gguf`, every GGUFReader(path) of one file is one
parse and each name map is built once: the default model converts in 15-18 s instead of 59.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import gguf
import numpy as np
from gguf import GGUFReader


class FastGGUFReader(GGUFReader):
    """GGUFReader over a plain ndarray view of its memory map (the same bytes, never read
    whole): GGUFReader.__init__ assigns the memmap to `data` and then parses through it."""

    @property
    def data(self) -> np.ndarray:
        return self.__dict__["_array"]

    @data.setter
    def data(self, mapped: np.ndarray) -> None:
        # The view keeps the memmap (and its file mapping) alive as its base.
        self.__dict__["_array"] = mapped.view(np.ndarray)


def open_gguf(path: str | os.PathLike[str]) -> GGUFReader:
    """A reader of the GGUF at `path`: the one already parsed within converting_gguf, else a
    fresh FastGGUFReader."""
    reader = gguf.GGUFReader
    if not (isinstance(reader, type) and issubclass(reader, FastGGUFReader)):
        reader = FastGGUFReader
    return reader(path)


# One swap of gguf's names at a time (two threads converting would otherwise restore
# each other's); reentrant, so a conversion may call another function that opens one.
_swap_lock = threading.RLock()


def _key(path: str | os.PathLike[str], mode: str) -> tuple[str, str]:
    return os.path.realpath(path), mode


@contextmanager
def converting_gguf() -> Iterator[None]:
    """Within the block, gguf.GGUFReader(path) (transformers' loader looks it up at each call)
    gives one FastGGUFReader per file and mode, parsed at its first opening, and
    gguf.get_tensor_name_map one map per architecture and layer count; all are dropped at
    the end. Both only read once built: transformers and we take fields, tensor views and
    names off them and copy what we keep."""
    parsed: dict[tuple[str, str], FastGGUFReader] = {}

    class OncePerFile(FastGGUFReader):
        def __new__(cls, path: str | os.PathLike[str], mode: str = "r"):
            done = parsed.get(_key(path, mode))
            return done if done is not None else super().__new__(cls)

        def __init__(self, path: str | os.PathLike[str], mode: str = "r"):
            if parsed.get(_key(path, mode)) is self:  # Python calls __init__ on it again
                return
            super().__init__(path, mode)
            parsed[_key(path, mode)] = self  # only once parsed: a bad file raises each time

    with _swap_lock:
        reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        gguf.GGUFReader = OncePerFile
        gguf.get_tensor_name_map = functools.cache(name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
            parsed.clear()
