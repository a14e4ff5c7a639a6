"""The notebook debugger's widgets (ipywidgets): the stream view, the stepper, the cache
tree, and the ProgramWidget a `%%sgl` cell shows, which holds all three."""

from sgl_nb.widgets.cache_tree import CacheTreeView
from sgl_nb.widgets.program import LiveCacheTree, ProgramWidget
from sgl_nb.widgets.stepper import StepperView
from sgl_nb.widgets.stream import StreamView
from sgl_nb.widgets.throttle import EventPump, Throttle

__all__ = ["CacheTreeView", "EventPump", "LiveCacheTree", "ProgramWidget", "StepperView",
           "StreamView", "Throttle"]
