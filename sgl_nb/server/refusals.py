"""The two ways a request is refused before it runs. Request models and routes raise them;
sgl_nb/server/errors.py turns them into OpenAI-shaped responses (400 and 404). They live
apart from errors.py so that the request models, which errors.py reads, need not import it."""

from __future__ import annotations


class BadRequest(ValueError):
    """The request is malformed or asks for something this server does not offer."""


class ModelNotFound(LookupError):
    """The request names a model this server does not serve."""
