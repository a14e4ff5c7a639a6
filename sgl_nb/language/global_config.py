"""`sgl.global_config`, as SGLang's frontend has it: the default backend."""

from __future__ import annotations

from sgl_nb.language.function import current_backend, set_default_backend


class GlobalConfig:
    @property
    def default_backend(self):
        """The backend programs run on, once set (None until then; `sgl.Runtime()` is made
        on the first program's run, as `get_default_backend()` does)."""
        return current_backend()

    @default_backend.setter
    def default_backend(self, backend) -> None:
        set_default_backend(backend)


global_config = GlobalConfig()
