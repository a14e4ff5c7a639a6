"""sgl-nb: a Jupyter-first runtime and tracing debugger for structured LLM programs.

Programs written for SGLang's frontend run with `import sgl_nb as sgl`.
"""

from __future__ import annotations

import importlib

# Each public name is imported from its module on first use (PEP 562), so that what needs
# none of them (`sgl-nb serve` refusing an unsafe bind, `sgl-nb --help`) does not wait for
# torch. `import sgl_nb as sgl; sgl.gen(...)` and `from sgl_nb import Runtime` work as before.
_EXPORTS = {
    "sgl_nb.backends.local_runtime": ("Runtime",),
    "sgl_nb.backends.runtime_endpoint": ("RuntimeEndpoint",),
    "sgl_nb.backends.unsupported": ("Anthropic", "Crusoe", "Engine", "LiteLLM", "OpenAI",
                                    "ServerArgs", "VertexAI"),
    "sgl_nb.language.diff": ("RunDiff", "diff"),
    "sgl_nb.language.expressions": (
        "REGEX_BOOL", "REGEX_FLOAT", "REGEX_INT", "REGEX_STR", "assistant", "assistant_begin",
        "assistant_end", "gen", "gen_int", "gen_string", "greedy_token_selection", "image",
        "select", "separate_reasoning", "system", "system_begin", "system_end",
        "token_length_normalized", "unconditional_likelihood_normalized", "user", "user_begin",
        "user_end", "video"),
    "sgl_nb.language.function": ("flush_cache", "function", "get_default_backend",
                                 "get_server_info", "set_default_backend"),
    "sgl_nb.language.global_config": ("global_config",),
    "sgl_nb.language.state": ("ProgramCancelled", "ProgramError", "ProgramState"),
    "sgl_nb.runtime.request": ("GenerateOutput",),
    "sgl_nb.runtime.sampling_params": ("SamplingParams",),
    "sgl_nb.tracing_api": ("disable_tracing", "enable_tracing"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

# SGLang's names for what sgl-nb does not have are public too: calling one says what to use.
__all__ = [*_MODULE_OF, "__version__"]
__version__ = "0.1.0"


def load_ipython_extension(ipython) -> None:
    """`%load_ext sgl_nb`: the %%sgl, %sgl_model, %sgl_cache, %sgl_trace, %sgl_widget and
    %sgl_diff magics, `%config SglMagics.widget`, and one summary widget for a cell's
    run_batch."""
    from sgl_nb.notebook.magics import load_ipython_extension as load  # IPython only when asked

    load(ipython)


def unload_ipython_extension(ipython) -> None:
    """`%unload_ext sgl_nb`: run_batch shows no summary any more."""
    from sgl_nb.notebook.magics import unload_ipython_extension as unload

    unload(ipython)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # found directly next time
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})
