"""The notebook debugger's widgets (ipywidgets): the stream view, the stepper, the cache
tree, and the ProgramWidget a `%%sgl` cell shows, which holds all three."""

from sgl_nb.notebook.widgets.cache_tree import CacheTreeView
from sgl_nb.notebook.widgets.program import LiveCacheTree, ProgramWidget
from sgl_nb.notebook.widgets.stepper import StepperView
from sgl_nb.notebook.widgets.stream import StreamView
from sgl_nb.notebook.widgets.throttle import EventPump, Throttle

__all__ = ["CacheTreeView", "EventPump", "LiveCacheTree", "ProgramWidget", "StepperView",
           "StreamView", "Throttle"]
