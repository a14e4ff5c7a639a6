"""The static copy of a ProgramWidget: plain HTML for viewers that run no widgets (GitHub,
nbviewer, `jupyter nbconvert --to html`), in the same output as the widget (its
`text/html`). It shows the program's text coloured by origin, its Node list with each
Node's status and timing, and its variables; `ProgramWidget.show()` replaces it with the
final one when the program ends.
"""

from __future__ import annotations

import html

from sgl_nb.notebook.widgets.stream_model import StreamModel


def stream_html(widget) -> str:
    """The program's text coloured by origin: the stream view's own static copy when it
    has one, else built from the widget's Timeline."""
    own = getattr(widget.stream, "static_html", None)
    if callable(own):
        return own()
    pid = widget.program_id
    if pid is None or pid not in widget.timeline.programs:
        return "<i>the program has not started</i>"
    return StreamModel(widget.timeline, pid, widget._prefix_chars, widget.forks).html()


def static_html(widget) -> str:
    """The whole static copy (call with the widget's lock held)."""
    title = html.escape(widget.title_text)
    status = html.escape(widget.status)
    error = (f'<div style="color:#b91c1c">{html.escape(widget.error)}</div>'
             if widget.error else "")
    nodes = widget.stepper.graph.html() if widget.stepper.graph.items else "<i>no Nodes yet</i>"
    return (f'<div class="sgl-static" data-program="{widget.program_id}">'
            f"<div><b>%%sgl {title}</b> · <span class=\"sgl-static-status\">{status}</span>"
            f"</div>{error}{stream_html(widget)}"
            f"<details open><summary><b>Nodes</b></summary>{nodes}</details>"
            f"<details open><summary><b>Variables</b></summary>{widget.variables.html()}"
            "</details></div>")


def stop_after_cell(callback) -> None:
    """Unregister a post_execute callback that show() registered; nothing if it was not
    (a widget driven from code, or already unregistered)."""
    from IPython import get_ipython

    ip = get_ipython()
    if ip is not None and callback in ip.events.callbacks.get("post_execute", ()):
        ip.events.unregister("post_execute", callback)
