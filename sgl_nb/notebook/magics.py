"""IPython magics: `%%sgl` runs a cell as a program, `%sgl_model`, `%sgl_cache`,
`%sgl_trace`, `%sgl_widget`, `%sgl_diff` (compare two runs). Load them with
`%load_ext sgl_nb`. `SglMagics.widget` (a `%config` trait) says what cells show; a cell's
run_batch shows one summary widget.

A `%%sgl` cell returns at once: the program's body runs on a pool thread, its Instructions
on the executor's and the engine's, and its widget follows it from the event stream. Nothing
here waits for the program, so the kernel stays free to deliver the widget's button clicks
(docs/architecture.md, "Threads")."""

from __future__ import annotations

import os
import shlex
import shutil
import tempfile
import threading
from typing import TYPE_CHECKING

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display
from traitlets import TraitError, Unicode, validate

from sgl_nb.backends.backend import is_backend
from sgl_nb.language.function import get_default_backend, set_batch_view, set_default_backend
from sgl_nb.language.state import ProgramState
from sgl_nb.notebook.cell_program import compile_cell, parse_args

if TYPE_CHECKING:
    from sgl_nb.backends.local_runtime import Runtime

PRIORITIES = ("interactive", "normal", "batch")
# What a %%sgl cell (and a cell's run_batch) shows: the full widget, one line, or nothing.
WIDGET_LEVELS = ("full", "compact", "none")


def _parse(func, line: str):
    """The magic's arguments; an unknown or bad option raises UsageError with the usage."""
    try:
        return parse_argstring(func, line)
    except UsageError as e:
        raise UsageError(f"{e}\n{usage(func)}") from None


def usage(func) -> str:
    # IPython's help formatter opens the usage with an rst "::" block marker.
    text = func.parser.format_usage().strip().removeprefix("::").strip()
    return "usage: " + " ".join(text.split())


@magics_class
class SglMagics(Magics):
    widget = Unicode("full", help="what every %%sgl cell shows: full (the ProgramWidget), "
                     "compact (one line: status, tokens, tok/s, cache hit) or none; a cell's "
                     "run_batch shows one summary unless none. A cell's --widget LEVEL or "
                     "--no-widget overrides it.").tag(config=True)

    def __init__(self, shell=None, **kwargs):
        super().__init__(shell, **kwargs)
        self.trace_file: str | None = None  # where `%sgl_trace start` records
        self.tracing = False
        self._owned_runtime = None  # a Runtime `%sgl_model PATH` loaded (shut down on switch)
        self._cell_thread: threading.Thread | None = None  # the thread running a cell, if any

    @property
    def owned_runtime(self) -> Runtime | None:
        """The Runtime `%sgl_model PATH` loaded (None: none); the next switch shuts it down."""
        return self._owned_runtime

    def release_owned_runtime(self) -> None:
        """Shut down the Runtime `%sgl_model PATH` loaded, if any, and forget it. Whoever
        calls this sets the default backend to another one first."""
        old, self._owned_runtime = self._owned_runtime, None
        if old is not None:
            old.shutdown()

    @validate("widget")
    def _check_widget(self, proposal):
        value = proposal["value"]
        if value not in WIDGET_LEVELS:
            raise TraitError(f"SglMagics.widget must be one of {', '.join(WIDGET_LEVELS)}; "
                             f"got {value!r}")
        return value

    def widget_level(self, args=None) -> str:
        """The level a cell shows: --no-widget, else --widget LEVEL, else SglMagics.widget."""
        if args is not None and args.no_widget:
            if args.widget not in (None, "none"):
                raise UsageError(f"--no-widget and --widget {args.widget}: give one of them")
            return "none"
        if args is not None and args.widget is not None:
            return args.widget
        return self.widget

    @magic_arguments()
    @argument("level", nargs="?", default=None, help="full | compact | none")
    @line_magic
    def sgl_widget(self, line: str):
        """%sgl_widget shows what %%sgl cells show; %sgl_widget full | compact | none sets it
        (as `%config SglMagics.widget = "compact"` does)."""
        level = line.strip().strip("'\"")
        if not level:
            print(f"SglMagics.widget = {self.widget!r}")
            return None
        if level not in WIDGET_LEVELS:
            raise UsageError(f"%sgl_widget {level}: the level is one of "
                             f"{', '.join(WIDGET_LEVELS)}")
        self.widget = level
        return None

    @magic_arguments("%sgl")  # shown as %%sgl: a cell magic
    @argument("name", nargs="?", default=None,
              help="bind the program's state to NAME (and the reusable function to NAME.fn)")
    @argument("--arg", action="append", default=[], metavar="KEY=VALUE",
              help="a program argument, visible in the cell as KEY (repeatable); VALUE is a "
                   "Python literal when it parses as one, else a string")
    @argument("--step", action="store_true", help="start paused in the stepper")
    @argument("--trace", metavar="FILE", help="write this program's trace to FILE")
    @argument("--priority", choices=PRIORITIES, default="interactive",
              help="the scheduler's level for this program (default: interactive)")
    @argument("--temperature", type=float, help="default temperature of every gen")
    @argument("--max-tokens", type=int, help="default max_tokens of every gen")
    @argument("--seed", type=int, help="default sampling seed of every gen")
    @argument("--define", action="store_true", help="define the function, do not run it")
    @argument("--no-widget", action="store_true", help="run without showing the widget")
    @argument("--widget", choices=WIDGET_LEVELS, default=None,
              help="what this cell shows: full, compact (one line) or none (default: "
              "SglMagics.widget, set with %%config or %%sgl_widget)")
    @argument("--backend", metavar="NAME_OR_URL",
              help="run on this backend: a notebook variable holding a Runtime or "
              "RuntimeEndpoint, or a server URL (OpenAI-compatible API, e.g. vLLM)")
    @cell_magic
    def sgl(self, line: str, cell: str):
        """Run the cell as an SGL program: `s` and gen, select, system, user, assistant,
        gen_int, gen_string are in scope, the notebook's variables are visible, and
        `{var}` in this line is replaced by the variable's value. The cell returns at once;
        read results with NAME["var"], NAME.text(), or rerun with NAME.fn.run(...)."""
        __tracebackhide__ = True  # noqa: F841 - IPython hides this frame in tracebacks
        args = _parse(self.sgl, line)
        try:
            program_args = parse_args(args.arg)
        except ValueError as e:
            raise UsageError(f"{e}\n{usage(self.sgl)}") from None
        count = self.shell.execution_count if self.shell is not None else None
        fn_name = args.name or f"sgl_cell_{count if count is not None else 0}"
        fn = compile_cell(cell, fn_name, line, self.shell.user_ns, program_args, count,
                          seed=args.seed)
        if args.define:
            self.shell.user_ns[args.name or "_sgl"] = fn
            return None
        if args.name:
            self._cancel_previous(args.name)
        state, widget = self._run(fn, args)
        self.shell.user_ns[args.name or "_sgl"] = state
        if hasattr(widget, "show"):  # a ProgramWidget: its static text/html kept up to date
            widget.show()
        elif widget is not None:
            display(widget)
        return None

    def _cancel_previous(self, name: str) -> None:
        """Re-running `%%sgl NAME` while the previous NAME still runs cancels that run (its
        output so far stays on its state and in its widget)."""
        previous = self.shell.user_ns.get(name)
        if isinstance(previous, ProgramState) and previous.cancel():
            print(f"%%sgl {name}: cancelled the previous run (program {previous.id}), which "
                  "was still running")

    def _backend(self, spec: str | None):
        """The backend a cell runs on: the default, a variable, or a server URL."""
        if spec is None:
            return get_default_backend()
        if spec.startswith(("http://", "https://")):
            from sgl_nb.backends.runtime_endpoint import RuntimeEndpoint

            endpoints = self.__dict__.setdefault("_endpoints", {})
            if spec not in endpoints:
                endpoints[spec] = RuntimeEndpoint(spec)
            return endpoints[spec]
        backend = self.shell.user_ns.get(spec)
        if not is_backend(backend):
            raise UsageError(f"--backend {spec}: not a Runtime or RuntimeEndpoint in the "
                             "notebook, nor an http(s):// URL")
        return backend

    def _run(self, fn, args):
        backend = self._backend(args.backend)
        widget = _view(self.widget_level(args), backend, args.name or fn.__name__)
        if args.trace:
            _start_tracing(args.trace)
        defaults = {k: v for k, v in (("temperature", args.temperature),
                                      ("max_new_tokens", args.max_tokens)) if v is not None}
        state = fn.run(stream=True, step=args.step, debug=True, priority=args.priority,
                       backend=backend, **defaults)
        if widget is not None:
            state.add_view(widget)
        if args.trace:
            # The file is written once the program has ended; NAME.wait() waits for it.
            state.on_end(_stop_tracing)
        return state, widget

    @line_magic
    def sgl_model(self, line: str):
        """%sgl_model shows the model programs run on; %sgl_model PATH switches to a
        checkpoint folder, a .gguf file or a folder holding one (loaded now; quote a PATH
        with spaces)."""
        words = shlex.split(line)
        if len(words) > 1:
            raise UsageError(f"%sgl_model takes one PATH, got {len(words)} words: quote a "
                             "path with spaces")
        path = words[0] if words else ""
        if not path:
            rt = get_default_backend()
            print(_describe(rt))
            return None
        from sgl_nb.backends.local_runtime import Runtime

        new = Runtime(path)
        set_default_backend(new)
        old, self._owned_runtime = self._owned_runtime, new
        if old is not None:
            old.shutdown()
        print(_describe(new))
        return None

    @magic_arguments()
    @argument("--text", action="store_true", help="print the tree as text, not a widget")
    @argument("--max-nodes", type=int, default=300, help="nodes shown before the rest fold")
    @line_magic
    def sgl_cache(self, line: str):
        """Show the radix cache tree of the default runtime, live (a widget) or as text."""
        args = _parse(self.sgl_cache, line)
        rt = get_default_backend()
        if rt.cache is None:
            print("this backend has no local radix cache")
            return None
        if args.text:
            from sgl_nb.tracing.cache_tree import tree_now

            print(tree_now(rt.cache).format_tree(rt.tokenizer.decode))
            return None
        from sgl_nb.notebook.widgets import LiveCacheTree

        display(LiveCacheTree(rt, max_nodes=args.max_nodes))
        return None

    @magic_arguments()
    @argument("action", choices=["start", "stop", "export"])
    @argument("file", nargs="?", default=None, help="export: the trace file to write")
    @line_magic
    def sgl_trace(self, line: str):
        """%sgl_trace start | stop | export FILE: record every program's trace (into a
        temporary file), stop recording, and copy what was recorded to FILE (OTLP/JSON, one
        export per line; replay it with sgl_nb.tracing.load). One tracing session runs at a
        time: a `%%sgl --trace FILE` cell replaces this one."""
        args = _parse(self.sgl_trace, line)
        if args.action == "start":
            fd, path = tempfile.mkstemp(prefix="sgl-trace-", suffix=".jsonl")
            os.close(fd)
            _start_tracing(path)
            self.trace_file, self.tracing = path, True
            print("tracing on")
        elif args.action == "stop":
            if not self.tracing:
                raise UsageError("tracing is not on; %sgl_trace start first")
            _stop_tracing()
            self.tracing = False
            print("tracing off")
        else:
            if not args.file:
                raise UsageError(f"export needs a FILE\n{usage(self.sgl_trace)}")
            if self.trace_file is None:
                raise UsageError("nothing recorded; %sgl_trace start first")
            if self.tracing:
                _flush_tracing()
            shutil.copyfile(self.trace_file, args.file)
            from sgl_nb.tracing.otlp_json import read_spans

            print(f"wrote {len(read_spans(args.file))} spans to {args.file}")
        return None

    @magic_arguments()
    @argument("a", help="a notebook variable (a state, a record, a Timeline, (path, program "
              "id)) or a trace file")
    @argument("b", nargs="?", default=None, help="the same; omitted: A is a re-run, compared "
              "with its original")
    @argument("--text", action="store_true", help="print the plain-text report")
    @line_magic
    def sgl_diff(self, line: str):
        """%sgl_diff A B: compare two runs (sgl_nb.diff): the first Node and token where they
        part, the arguments that differ, and time and tokens per Node, side by side."""
        from sgl_nb.language.diff import diff

        args = _parse(self.sgl_diff, line)
        names = [n for n in (args.a, args.b) if n is not None]
        runs = [self._run_named(n) for n in names]
        try:
            d = diff(*runs, names=tuple(names) if len(names) == 2 else ("original", names[0]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UsageError(f"%sgl_diff: {e}") from None
        if args.text:
            print(d)
        else:
            display(d)  # its HTML report in a notebook
        return None

    def _run_named(self, name: str):
        ns = self.shell.user_ns if self.shell is not None else {}
        if name in ns:
            return ns[name]
        if os.path.isfile(name):
            return name
        raise UsageError(f"%sgl_diff: {name!r} is neither a notebook variable nor a trace file")

    # ---- run_batch in a cell: one summary widget (the hook sgl_nb/language/function.py calls)

    def _cell_started(self, *_) -> None:
        self._cell_thread = threading.current_thread()

    def _cell_ended(self, *_) -> None:
        self._cell_thread = None

    def batch_view(self, name: str, backend, batch_kwargs: list[dict]):
        """The summary a cell's `f.run_batch(items)` shows (displayed now, before the items
        start), or None: outside a cell's own thread (a program body, a script), with no
        event stream, or at level none."""
        if (self.widget == "none" or self._cell_thread is not threading.current_thread()
                or getattr(backend, "events", None) is None):
            return None
        from sgl_nb.notebook.widgets.batch import BatchSummary

        view = BatchSummary(backend, name, batch_kwargs)  # subscribes now
        view.show()  # with a static copy of its line, updated once the batch has ended
        return view


def _view(level: str, backend, title: str):
    """What a cell shows at `level`; made (and subscribed) before the program starts, so
    it sees every event."""
    if level == "full":
        from sgl_nb.notebook.widgets import ProgramWidget

        return ProgramWidget(backend, title=title)
    if level == "compact":
        from sgl_nb.notebook.widgets.compact import CompactView

        return CompactView(backend, title=title)
    return None


def _describe(rt) -> str:
    path = rt.model_path or rt.model_name
    extra = ""
    engine = getattr(rt, "engine", None)  # a local Runtime's; a remote server has none
    if engine is not None:
        model = engine.model
        how = ("sgl-nb's own model code" if model.path == "native"
               else "transformers' modeling code with sgl-nb's paged attention")
        extra = f"\npath: {model.path} ({model.config.architecture}, {how})"
    if rt.cache is not None:
        s = rt.cache_stats()
        extra += f"\nradix cache: {s.get('nodes', '?')} nodes, {s.get('cached_tokens', '?')} tokens"
    return f"model: {path}{extra}"


# ---- tracing: sgl.enable_tracing, imported when first used --------------------------------

def _start_tracing(file: str) -> None:
    from sgl_nb.tracing_api import enable_tracing

    enable_tracing(file=file)


def _stop_tracing() -> None:
    from sgl_nb.tracing_api import disable_tracing

    disable_tracing()  # closes the open spans and exports everything recorded


def _flush_tracing() -> None:
    from sgl_nb.tracing.session import current

    session = current()
    if session is not None:
        session.flush()


def load_ipython_extension(ipython) -> None:
    unload_ipython_extension(ipython)
    for old in [c for c in ipython.configurables if isinstance(c, SglMagics)]:
        ipython.configurables.remove(old)  # a second load replaces the first
    # Magics joins the shell's configurables (so `%config SglMagics.widget = ...` reaches
    # it) and reads c.SglMagics.* from the shell's config, its parent.
    magics = SglMagics(shell=ipython)
    ipython.register_magics(magics)
    ipython.events.register("pre_run_cell", magics._cell_started)
    ipython.events.register("post_run_cell", magics._cell_ended)
    set_batch_view(magics.batch_view)


def unload_ipython_extension(ipython) -> None:
    """A cell's run_batch shows no summary any more (IPython keeps the magics)."""
    for magics in [c for c in ipython.configurables if isinstance(c, SglMagics)]:
        for event, callback in (("pre_run_cell", magics._cell_started),
                                ("post_run_cell", magics._cell_ended)):
            if callback in ipython.events.callbacks[event]:
                ipython.events.unregister(event, callback)
        magics._cell_thread = None
    set_batch_view(None)
