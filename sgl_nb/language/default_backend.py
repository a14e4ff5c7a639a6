"""The backend programs run on unless told otherwise (`sgl.set_default_backend`,
`sgl.global_config.default_backend`)."""

from __future__ import annotations

import threading

from sgl_nb.backends.backend import is_backend

_default_backend = None
_backend_lock = threading.Lock()


def set_default_backend(backend) -> None:
    """The backend programs run on: an `sgl.Runtime`, an `sgl.RuntimeEndpoint`, or None
    (a default Runtime is made again on first use)."""
    global _default_backend
    if backend is not None and not is_backend(backend):
        hint = " (for a server: sgl.RuntimeEndpoint(url))" if isinstance(backend, str) else ""
        raise TypeError(f"set_default_backend takes sgl.Runtime or sgl.RuntimeEndpoint, got "
                        f"{type(backend).__name__}{hint}")
    _default_backend = backend


def current_backend():
    """The default backend if one is set, else None (nothing is created)."""
    return _default_backend


def get_default_backend():
    """The backend programs run on; a default Runtime is created on first use."""
    global _default_backend
    with _backend_lock:
        if _default_backend is None:
            from sgl_nb.backends.local_runtime import Runtime

            _default_backend = Runtime()
        return _default_backend


def flush_cache(backend=None):
    """Drop the backend's cached prefixes (the default backend's if none is given)."""
    return (backend or get_default_backend()).flush_cache()


def get_server_info(backend=None) -> dict:
    """What the backend runs: model, context, precision, pool, scheduler figures."""
    return (backend or get_default_backend()).get_server_info()
