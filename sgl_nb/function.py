"""`@sgl.function`: a program, run once (`run`), many times (`run_batch`), or in the
background (`run_async`), on the default backend (the in-kernel Runtime)."""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from collections.abc import Callable, Iterator

from sgl_nb.state import ProgramState

_default_backend = None
_backend_lock = threading.Lock()


def set_default_backend(backend) -> None:
    global _default_backend
    _default_backend = backend


def get_default_backend():
    """The backend programs run on; a default Runtime is created on first use."""
    global _default_backend
    with _backend_lock:
        if _default_backend is None:
            from sgl_nb.local_runtime import Runtime

            _default_backend = Runtime()
        return _default_backend


_RUN_DEFAULTS = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p")


class ProgramFuture:
    """A program running in the background: .result(), .done(), .stream(), `await fut`."""

    def __init__(self, state: ProgramState, thread: threading.Thread):
        self.state, self._thread = state, thread

    def result(self, timeout: float | None = None) -> ProgramState:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"program still running after {timeout} s")
        return self.state

    def done(self) -> bool:
        return not self._thread.is_alive()

    def stream(self, var_name: str | None = None) -> Iterator[str]:
        return self.state.text_iter(var_name)

    def __await__(self):
        return asyncio.to_thread(self.result).__await__()


class SglFunction:
    def __init__(self, func: Callable):
        self.func = func
        params = list(inspect.signature(func).parameters)
        if not params:
            raise TypeError(f"@sgl.function {func.__name__} must take the state `s` first")
        self.arg_names = params[1:]
        functools.update_wrapper(self, func)

    def _start(self, args: dict, backend=None, **defaults) -> ProgramFuture:
        unknown = set(args) - set(self.arg_names)
        if unknown and not _takes_kwargs(self.func):
            raise TypeError(f"{self.func.__name__}() got unexpected arguments {sorted(unknown)}")
        run_defaults = {k: v for k, v in defaults.items() if k in _RUN_DEFAULTS}
        if "max_new_tokens" in run_defaults:
            run_defaults["max_tokens"] = run_defaults.pop("max_new_tokens")
        state = ProgramState(backend or get_default_backend(), run_defaults)
        file = self.func.__code__.co_filename

        def body() -> None:
            try:
                self.func(state, **args)
            except BaseException as e:  # noqa: BLE001 - kept on the state, with its line
                state._finish(e, file)
                return
            state._finish()

        thread = threading.Thread(target=body, name=f"sgl-{self.func.__name__}", daemon=True)
        thread.start()
        return ProgramFuture(state, thread)

    def run(self, *args, stream: bool = False, backend=None, **kwargs) -> ProgramState:
        """Run the program; returns its state (at once with stream=True: use text_iter)."""
        call, defaults = self._split(args, kwargs)
        fut = self._start(call, backend, **defaults)
        return fut.state if stream else fut.result()

    def __call__(self, *args, **kwargs) -> ProgramState:
        return self.run(*args, **kwargs)

    def run_async(self, *args, backend=None, **kwargs) -> ProgramFuture:
        call, defaults = self._split(args, kwargs)
        return self._start(call, backend, **defaults)

    def run_batch(self, batch_kwargs: list[dict], progress_bar: bool = False, backend=None,
                  **defaults) -> list[ProgramState]:
        """Run the program once per dict of arguments, all at once; a prefix they share is
        computed once by the radix cache."""
        futures = [self._start(dict(kw), backend, **defaults) for kw in batch_kwargs]
        if progress_bar:
            from tqdm import tqdm

            return [f.result() for f in tqdm(futures, desc=self.func.__name__)]
        return [f.result() for f in futures]

    def _split(self, args: tuple, kwargs: dict) -> tuple[dict, dict]:
        if len(args) > len(self.arg_names):
            raise TypeError(f"{self.func.__name__}() takes {len(self.arg_names)} arguments")
        call = dict(zip(self.arg_names, args))
        defaults = {k: kwargs.pop(k) for k in list(kwargs) if k in _RUN_DEFAULTS
                    and k not in self.arg_names}
        call.update(kwargs)
        return call, defaults


def _takes_kwargs(func: Callable) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(func).parameters.values())


def function(func: Callable | None = None, **_options):
    """Decorator: `@sgl.function def prog(s, question): ...`."""
    if func is None:
        return lambda f: SglFunction(f)
    return SglFunction(func)
