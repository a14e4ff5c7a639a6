"""`@sgl.function`: a program, run once (`run`), many times (`run_batch`), or in the
background (`run_async`), on the default backend (the in-kernel Runtime)."""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from sgl_nb.language.body_pool import BodyPool
from sgl_nb.language.default_backend import (  # noqa: F401 - sgl's names, from here too
    current_backend,
    flush_cache,
    get_default_backend,
    get_server_info,
    set_default_backend,
)
from sgl_nb.language.expressions import (
    LOGPROB_ARGS,
    SAMPLING_ARGS,
    UNSUPPORTED_ARGS,
    refuse_unsupported,
    sampling_args,
)
from sgl_nb.language.global_config import global_config
from sgl_nb.language.rerun import rerun_timeline
from sgl_nb.language.rerun_strategy import LIVE
from sgl_nb.language.state import ProgramState
from sgl_nb.language.static_graph import ProgramGraph, static_prefix, trace_program
from sgl_nb.runtime.compiler.passes import PassReport, check_passes, leading_text, shared_prefix
from sgl_nb.runtime.compiler.step_controller import StepController
from sgl_nb.runtime.events import Paused, Resumed
from sgl_nb.runtime.priority import parse_priority, priority_name
from sgl_nb.tracing.timeline import Timeline

# run()'s sampling options, SGLang's names: defaults for every gen of the program.
_RUN_DEFAULTS = (*SAMPLING_ARGS, *LOGPROB_ARGS)
# SGLang's threading options: run_batch honours num_threads (its bodies' pool); use_thread
# is accepted (every body runs on a pool thread anyway).
_THREAD_OPTIONS = ("use_thread", "num_threads")
# Start of a program whose text is cached by `f.cache()`: SGLang's threshold (shorter is
# not worth a request).
CACHE_MIN_CHARS = 64
# Threads for the bodies of run() / run_async() programs, and run_batch's default.
DEFAULT_BODY_THREADS = 64
_bodies = BodyPool(DEFAULT_BODY_THREADS)


class ProgramFuture:
    """A program running in the background: .result(), .done(), .stream(), `await fut`."""

    def __init__(self, state: ProgramState):
        self.state = state

    def result(self, timeout: float | None = None) -> ProgramState:
        """The state once the program has ended; an interrupt while waiting cancels it."""
        return self.state.wait(timeout)

    def done(self) -> bool:
        return self.state.ended

    def cancel(self) -> bool:
        """Cancel the program (see ProgramState.cancel); False if it had already ended."""
        return self.state.cancel()

    def cancelled(self) -> bool:
        return self.state.cancelled

    def stream(self, var_name: str | None = None) -> Iterator[str]:
        return self.state.text_iter(var_name)

    def __await__(self):
        return asyncio.to_thread(self.result).__await__()


@dataclass
class ProgramCall:
    """What a program was started with: what `state.rerun` starts again."""

    function: SglFunction
    args: dict  # the program's own arguments
    defaults: dict  # run options that are sampling defaults (temperature, ...)
    options: dict  # passes, priority

    def attrs(self) -> dict:
        """For program_started (and so a trace): where the function is, its arguments as
        JSON (None when they are not JSON: such a trace cannot be re-run)."""
        f = self.function.func
        out = {"module": f.__module__, "qualname": f.__qualname__,
               "options": json.dumps(self.defaults, default=repr, sort_keys=True)}
        try:
            out["args"] = json.dumps(self.args, sort_keys=True)
        except (TypeError, ValueError):
            out["args"] = None
        return out


class SglFunction:
    def __init__(self, func: Callable, num_api_spec_tokens: int | None = None,
                 bind_arguments: dict | None = None):
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})  # set by bind(); every run gets them
        params = list(inspect.signature(func).parameters.values())
        if not params:
            raise TypeError(f"@sgl.function {func.__name__} must take the state `s` first")
        self.arg_names = [p.name for p in params[1:]]
        self.arg_defaults = [p.default for p in params[1:] if p.default is not p.empty]
        functools.update_wrapper(self, func)

    @property
    def fn(self) -> SglFunction:
        """The function itself: `NAME.fn` works whether a `%%sgl NAME` cell bound NAME to
        its state or (with --define) to its function."""
        return self

    def bind(self, **kwargs) -> SglFunction:
        """The same program with some arguments fixed (SGLang's bind); binding again adds
        to them. Passing a bound argument to a run with another value is a TypeError."""
        unknown = sorted(set(kwargs) - set(self.arg_names))
        if unknown:
            raise TypeError(f"{self.func.__name__}() has no arguments {unknown} to bind; it "
                            f"takes {self.arg_names}")
        return SglFunction(self.func, self.num_api_spec_tokens,
                           {**self.bind_arguments, **kwargs})

    def _with_bound(self, args: dict) -> dict:
        # The same value again is what a re-run passes (its record holds every argument).
        twice = sorted(k for k in set(args) & set(self.bind_arguments)
                       if args[k] is not self.bind_arguments[k]
                       and args[k] != self.bind_arguments[k])
        if twice:
            raise TypeError(f"{self.func.__name__}(): {twice} are bound by .bind(); a run "
                            "cannot pass other values for them")
        return {**args, **self.bind_arguments}

    def start(self, args: dict, backend=None, debug: bool = False, step: bool = False,
              passes=None, priority: str = "normal", pool: BodyPool | None = None,
              shared_prefix: str = "", after=None, strategy=LIVE, **defaults) -> ProgramFuture:
        """Start the program on its arguments by name (run, run_batch and a re-run start
        it here); returns at once. `strategy`: LIVE, or a re-run's Rerun."""
        args = self._with_bound(args)
        unknown = set(args) - set(self.arg_names)
        if unknown and not _takes_kwargs(self.func):
            raise TypeError(f"{self.func.__name__}() got unexpected arguments {sorted(unknown)}")
        run_defaults = _run_defaults(defaults)
        priority = priority_name(parse_priority(priority))  # a bad name fails here, at once
        controller = StepController(paused=step) if debug or step else None
        state = ProgramState(backend or get_default_backend(), run_defaults, stepper=controller,
                             passes=check_passes(passes), priority=priority, strategy=strategy)
        if self.num_api_spec_tokens and state.backend.api_speculation:
            state.spec_tokens = self.num_api_spec_tokens
        file = self.func.__code__.co_filename
        if controller is not None:
            controller.on_hold = lambda at, node: state.emit(
                Paused if at else Resumed, node=getattr(node, "id", None), at=at,
                reason="step controller")

        def body() -> None:
            state.body_started()
            state.call_stack.append({"function": self.func.__name__, "args": dict(args)})
            try:
                state.ret_value = self.func(state, **args)
            except BaseException as e:  # noqa: BLE001 - kept on the state, with its line
                state.body_ended(e, file)
            else:
                state.body_ended()

        call = ProgramCall(self, dict(args), dict(defaults),
                           {"passes": passes, "priority": priority})
        state.begin(self.func.__name__, shared_prefix, after, call=call)
        (pool or _bodies).submit(body)
        return ProgramFuture(state)

    def run(self, *args, stream: bool = False, backend=None, debug: bool = False,
            step: bool = False, passes=None, priority: str = "normal",
            **kwargs) -> ProgramState:
        """Run the program; returns its state. Returns at once with stream=True (use
        text_iter) or step=True (starts paused: drive it with state.stepper). `passes`: the
        compiler passes to apply (default all; () for none). `priority`: "interactive",
        "normal" or "batch" (the scheduler serves higher levels first).

        Inside a running program, `f(s, ...)` with the program's own state first runs f on
        that state as a nested call (recursion included) and returns what f returns, as a
        Python call does (`state.ret_value` stays the outer program's)."""
        if args and isinstance(args[0], ProgramState):
            return self._call_nested(args[0], args[1:], kwargs)
        call, defaults = self._split(args, kwargs)
        fut = self.start(call, backend, debug=debug, step=step, passes=passes,
                          priority=priority, **defaults)
        if stream or step:
            return fut.state
        state = fut.result()
        if global_config.verbosity >= 2:  # SGLang's global_config.verbosity
            print(state.text())
        return state

    def _call_nested(self, state: ProgramState, args: tuple, kwargs: dict):
        call, _ = self._split(args, kwargs)  # run options (temperature, ...) are the caller's
        call = self._with_bound(call)
        state.call_stack.append({"function": self.func.__name__, "args": call})
        try:
            return self.func(state, **call)
        finally:
            state.call_stack.pop()

    def __call__(self, *args, **kwargs) -> ProgramState:
        return self.run(*args, **kwargs)

    def run_async(self, *args, backend=None, debug: bool = False, step: bool = False,
                  passes=None, priority: str = "normal", **kwargs) -> ProgramFuture:
        call, defaults = self._split(args, kwargs)
        return self.start(call, backend, debug=debug, step=step, passes=passes,
                           priority=priority, **defaults)

    def trace(self, *args, backend=None, **kwargs) -> ProgramGraph:
        """The static part of the program's graph for these arguments (no model runs;
        `backend`'s chat template, else the default backend's if one is set, shows the
        text of role markers)."""
        call, defaults = self._split(args, kwargs)
        backend = backend or current_backend()
        roles = backend.chat_roles if backend is not None else None
        return trace_program(self.func, self._with_bound(call), _run_defaults(defaults), roles)

    def cache(self, backend=None) -> str:
        """Compute the text every run of this program starts with (its static start, up to
        the first argument or gen) into the backend's prefix cache, as SGLang's
        `f.cache()` does; returns that text ("" when it is under 64 characters, SGLang's
        threshold: nothing is sent)."""
        backend = backend or get_default_backend()
        prefix = static_prefix(self.func, self.bind_arguments, backend.chat_roles)
        if len(prefix) < CACHE_MIN_CHARS:
            return ""
        backend.prefill(prefix).result()
        return prefix

    def run_batch(self, batch_kwargs: list, progress_bar: bool = False, backend=None,
                  passes=None, priority: str = "batch", generator_style: bool = False,
                  **defaults):
        """Run the program once per item, all at once (`num_threads` bodies at a time;
        "auto": one per item, up to 64). An item is a dict of arguments, or (SGLang) a list
        or tuple of them in order. generator_style=True: a generator giving each state in
        order as it ends. The shared_prefix pass finds the text every item starts with
        (from each item's static graph): the first item computes it, as a shared Extend
        after its Init, and the others start when it is in the cache."""
        unknown = set(defaults) - {*_RUN_DEFAULTS, *_THREAD_OPTIONS, *UNSUPPORTED_ARGS}
        if unknown:
            raise TypeError(f"run_batch() got unexpected options {sorted(unknown)}")
        refuse_unsupported({k: defaults.pop(k, None) for k in UNSUPPORTED_ARGS})
        batch_kwargs = [self._batch_item(item) for item in batch_kwargs]
        threads = defaults.pop("num_threads", "auto")
        defaults.pop("use_thread", None)
        if threads == "auto":  # SGLang's default
            threads = max(1, min(len(batch_kwargs), DEFAULT_BODY_THREADS))
        backend = backend or get_default_backend()
        parse_priority(priority)
        chosen = check_passes(passes)
        if not global_config.enable_precache_with_tracing:  # SGLang: no pre-caching
            chosen = chosen - {"shared_prefix"}
        self.last_batch_report, common = None, ""
        if "shared_prefix" in chosen and len(batch_kwargs) > 1:
            common, self.last_batch_report = self._batch_prefix(batch_kwargs, backend)
        pool = BodyPool(threads, name=f"sgl-batch-{self.func.__name__}")
        futures, shared = [], None
        view = self.last_batch_view = _batch_view_for(self.func.__name__, backend, batch_kwargs)
        try:
            for kw in batch_kwargs:
                fut = self.start(dict(kw), backend, passes=chosen, priority=priority,
                                  pool=pool, shared_prefix=common if shared is None else "",
                                  after=shared, **defaults)
                if common and shared is None:
                    shared = fut.state.nodes[0].instructions[1]  # Init, then the shared Extend
                    fut.state.pass_counts["shared_prefix"] = self.last_batch_report.changed
                futures.append(fut)
        finally:
            if view is not None:
                view.attach(futures)  # the items queued (all of them unless one failed)
        pool.close()  # its threads end when the last body has run
        results = _results(futures, self.func.__name__ if progress_bar else None)
        return results if generator_style else list(results)

    def _batch_item(self, item) -> dict:
        """A run_batch item as its arguments: a dict, or SGLang's list / tuple in order."""
        if isinstance(item, dict):
            return dict(item)
        if isinstance(item, list | tuple):
            least = len(self.arg_names) - len(self.arg_defaults)
            if not least <= len(item) <= len(self.arg_names):
                raise TypeError(f"{self.func.__name__}() takes {least} to "
                                f"{len(self.arg_names)} arguments {self.arg_names}; a "
                                f"run_batch item has {len(item)}: {item!r}")
            return dict(zip(self.arg_names, item))
        raise TypeError(f"run_batch items are dicts of arguments (or lists in order), got "
                        f"{type(item).__name__}")

    def _batch_prefix(self, batch_kwargs: list[dict], backend) -> tuple[str, PassReport]:
        roles = backend.chat_roles
        graphs = [trace_program(self.func, self._with_bound(kw), {}, roles)
                  for kw in batch_kwargs]
        return shared_prefix([leading_text(g.nodes) for g in graphs])

    def _split(self, args: tuple, kwargs: dict) -> tuple[dict, dict]:
        if len(args) > len(self.arg_names):
            raise TypeError(f"{self.func.__name__}() takes {len(self.arg_names)} arguments")
        call = dict(zip(self.arg_names, args))
        refuse_unsupported({k: kwargs.pop(k) for k in UNSUPPORTED_ARGS
                            if k in kwargs and k not in self.arg_names})
        defaults = {k: kwargs.pop(k) for k in list(kwargs) if k in _RUN_DEFAULTS
                    and k not in self.arg_names}
        for k in _THREAD_OPTIONS:
            if k not in self.arg_names:
                kwargs.pop(k, None)
        call.update(kwargs)
        return call, defaults


def _results(futures: list[ProgramFuture], progress: str | None) -> Iterator[ProgramState]:
    """Each item's state in order, as it ends (`progress`: a tqdm bar by that name). An
    interrupt while waiting stops the whole batch, not only the item waited on."""
    try:
        if progress is not None:
            from tqdm import tqdm

            for f in tqdm(futures, desc=progress):
                yield f.result()
        else:
            for f in futures:
                yield f.result()
    except KeyboardInterrupt:
        for f in futures:
            f.cancel()
        raise


# ---- the run_batch view: a hook the notebook layer sets (this layer imports nothing above) --

_batch_view = None


def set_batch_view(factory) -> None:
    """`factory(name, backend, batch_kwargs)` is called by every run_batch before its items
    start and returns a view (with `attach(futures)`, called once they are queued) or None.
    `%load_ext sgl_nb` sets it: a notebook cell's run_batch shows one summary widget. None
    removes it."""
    global _batch_view
    _batch_view = factory


def batch_view_factory() -> Callable | None:
    """The run_batch view factory set_batch_view set (None: none)."""
    return _batch_view


def _batch_view_for(name: str, backend, batch_kwargs: list[dict]):
    factory = _batch_view
    return factory(name, backend, batch_kwargs) if factory is not None else None


def _run_defaults(options: dict) -> dict:
    """run()'s options as the state's defaults: SamplingParams fields and logprob options."""
    out = sampling_args({k: v for k, v in options.items() if k in SAMPLING_ARGS})
    out.update({k: options[k] for k in LOGPROB_ARGS if options.get(k) is not None})
    return out


def _takes_kwargs(func: Callable) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(func).parameters.values())


def function(func: Callable | None = None, num_api_spec_tokens: int | None = None):
    """Decorator: `@sgl.function def prog(s, question): ...`.

    num_api_spec_tokens=N (SGLang's API speculative execution): on a server
    (`sgl.RuntimeEndpoint`), a gen asks for N tokens at once and the gens and text after it
    are read from that answer while it matches, saving a request each. A no-op on the
    in-kernel engine, whose radix cache already serves the prefix."""
    if num_api_spec_tokens is not None and (not isinstance(num_api_spec_tokens, int)
                                            or num_api_spec_tokens <= 0):
        raise ValueError(f"num_api_spec_tokens must be a positive integer, got "
                         f"{num_api_spec_tokens!r}")
    if func is None:
        return lambda f: SglFunction(f, num_api_spec_tokens)
    return SglFunction(func, num_api_spec_tokens)


# The trace layer imports nothing above it: it is told how to re-run a traced program (its
# function found where the trace says, wrapped as an SglFunction when it is a plain one).
Timeline.rerunner = functools.partial(rerun_timeline, function_type=SglFunction)
