"""`sgl.global_config`, as SGLang's frontend has it: the default backend, verbosity, and
SGLang's switches (each honoured, or refused where the engine cannot, or documented in
docs/sglang_compat.md as having nothing to switch here)."""

from __future__ import annotations

from sgl_nb.language.default_backend import current_backend, set_default_backend


class GlobalConfig:
    def __init__(self):
        # 2: print each program's text after its run() (SGLang's level; 0 and 1: nothing).
        self.verbosity = 0
        # False: run_batch does not compute its items' common start once (the
        # shared_prefix pass), as SGLang's flag skips its pre-caching.
        self.enable_precache_with_tracing = True
        # SGLang concatenates the branches' KV for join(mode="concate_and_append") when
        # True; here the text is appended and its KV computed, on or off (exact).
        self.enable_parallel_encoding = True
        # No special token is ever in an output's text, so none has spaces between.
        self.spaces_between_special_tokens_in_out = True

    @property
    def default_backend(self):
        """The backend programs run on, once set (None until then; `sgl.Runtime()` is made
        on the first program's run, as `get_default_backend()` does)."""
        return current_backend()

    @default_backend.setter
    def default_backend(self, backend) -> None:
        set_default_backend(backend)

    @property
    def skip_special_tokens_in_output(self) -> bool:
        """Always True: the engine decodes outputs without special tokens."""
        return True

    @skip_special_tokens_in_output.setter
    def skip_special_tokens_in_output(self, value: bool) -> None:
        if value is not True:
            raise ValueError("skip_special_tokens_in_output: sgl-nb's engine always leaves "
                             "special tokens out of generated text; it cannot be turned off")


global_config = GlobalConfig()
