"""Loading the program to debug: `FILE.py[:FUNCTION]` and `--arg key=value` pairs."""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

from sgl_nb.language.function import SglFunction
from sgl_nb.notebook.cell_program import parse_args

_module_ids = itertools.count(1)


@dataclass
class ProgramFile:
    path: Path
    function: SglFunction
    args: dict

    @property
    def name(self) -> str:
        return self.function.func.__name__


def split_target(target: str) -> tuple[Path, str | None]:
    """`prog.py:story` -> (prog.py, "story"); `prog.py` -> (prog.py, None)."""
    file, sep, func = target.rpartition(":")
    # A Windows drive (C:\x.py) or a plain file name has no function part.
    if not sep or not file or not func.isidentifier():
        return Path(target), None
    return Path(file), func


def load_program(target: str, pairs: list[str] = ()) -> ProgramFile:
    """Import FILE.py (under a private module name, so its `__main__` block does not run)
    and pick the @sgl.function to debug; check the arguments against its signature."""
    path, func_name = split_target(target)
    if not path.is_file():
        raise ValueError(f"no such program file: {path}")
    module = _import_file(path)
    funcs = {k: v for k, v in vars(module).items() if isinstance(v, SglFunction)}
    if func_name is None:
        if len(funcs) != 1:
            found = ", ".join(sorted(funcs)) or "none"
            raise ValueError(f"{path} has {len(funcs)} @sgl.function programs ({found}); "
                             f"name one as {path}:FUNCTION")
        func_name = next(iter(funcs))
    if func_name not in funcs:
        found = ", ".join(sorted(funcs)) or "none"
        raise ValueError(f"{path} has no @sgl.function named {func_name!r} (it has: {found})")
    func = funcs[func_name]
    args = parse_args(list(pairs))
    _check_args(func, args)
    return ProgramFile(path.resolve(), func, args)


def _import_file(path: Path):
    name = f"_sgl_nb_debugged_{next(_module_ids)}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot import {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    spec.loader.exec_module(module)
    return module


def _check_args(func: SglFunction, args: dict) -> None:
    params = list(inspect.signature(func.func).parameters.values())[1:]  # after `s`
    names = {p.name for p in params}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    unknown = sorted(set(args) - names)
    if unknown and not takes_any:
        raise ValueError(f"{func.func.__name__}() has no argument(s) {unknown}; "
                         f"it takes {sorted(names) or 'none'}")
    missing = [p.name for p in params if p.default is p.empty and p.name not in args
               and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    if missing:
        raise ValueError(f"{func.func.__name__}() needs --arg for {missing}")
