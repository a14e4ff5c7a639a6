"""The Backend interface: what programs, the magics, the widgets and the debugger use of a
backend. The in-kernel `sgl.Runtime` (sgl_nb/backends/local_runtime.py) and `sgl.RuntimeEndpoint`
(a vLLM or SGLang server, sgl_nb/backends/runtime_endpoint.py) both implement it."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Protocol

from sgl_nb.backends.chat_roles import ChatRoles
from sgl_nb.runtime.events import EventBus
from sgl_nb.runtime.radix_cache import RadixCache
from sgl_nb.runtime.request import GenerateOutput
from sgl_nb.runtime.token_usage import TokenUsage


class Backend(Protocol):
    instruction_stepping: bool  # one token at a time under the step controller
    api_speculation: bool  # @sgl.function(num_api_spec_tokens=N) saves requests here
    events: EventBus
    token_usage: TokenUsage

    @property
    def tokenizer(self) -> Any: ...

    @property
    def chat_roles(self) -> ChatRoles: ...

    @property
    def model_path(self) -> Path | None: ...

    @property
    def model_name(self) -> str | None: ...

    @property
    def cache(self) -> RadixCache | None:
        """The radix tree the views draw (None: it lives in a server)."""
        ...

    def submit(self, prompt: str | list[int], stream: bool = False, gate=None,
               priority: str | int | None = None, program: int | None = None,
               node: int | None = None, instruction=None, on_chunk=None, on_done=None,
               **params) -> Any: ...

    def submit_scores(self, prefix: str | list[int], continuations: list,
                      priority: str | int | None = None, program: int | None = None,
                      node: int | None = None, instructions: list | None = None,
                      on_done: list | None = None) -> list: ...

    def prefill(self, prompt: str | list[int], priority: str | int | None = None,
                program: int | None = None, node: int | None = None, instruction=None,
                on_done=None) -> Any:
        """Compute the prompt's KV (into the prefix cache) and nothing else: what a shared
        Extend runs. A handle, as `submit`'s."""
        ...

    def score(self, prefix: str | list[int], continuations: list,
              priority: str | int | None = None, program: int | None = None,
              node: int | None = None) -> list[list[float]]: ...

    def generate(self, prompt, **params) -> GenerateOutput | Any: ...

    def check_grammar(self, regex: str | None, json_schema: str | dict | None) -> None: ...

    def cancel_program(self, program: int) -> None: ...

    def wake(self) -> None: ...

    def flush_cache(self) -> Any: ...

    def get_server_info(self) -> dict: ...

    def shutdown(self) -> None: ...


def is_backend(obj: object) -> bool:
    """Whether `obj` has every member of Backend, looked up without running properties:
    `isinstance` on a runtime_checkable Protocol calls each property on Python 3.11, and a
    RuntimeEndpoint's tokenizer comes over the network."""
    names = set(Backend.__annotations__) | {
        name for name in vars(Backend) if not name.startswith("_")}
    missing = object()
    return all(inspect.getattr_static(obj, name, missing) is not missing for name in names)
