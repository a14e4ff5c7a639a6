"""sgl-nb: a Jupyter-first runtime and tracing debugger for structured LLM programs.

Programs written for SGLang's frontend run with `import sgl_nb as sgl`.
"""

from sgl_nb.backends.local_runtime import Runtime
from sgl_nb.backends.runtime_endpoint import RuntimeEndpoint
from sgl_nb.backends.unsupported import (
    Anthropic,
    Crusoe,
    Engine,
    LiteLLM,
    OpenAI,
    ServerArgs,
    VertexAI,
)
from sgl_nb.language.diff import RunDiff, diff
from sgl_nb.language.expressions import (
    REGEX_BOOL,
    REGEX_FLOAT,
    REGEX_INT,
    REGEX_STR,
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    gen_int,
    gen_string,
    greedy_token_selection,
    image,
    select,
    separate_reasoning,
    system,
    system_begin,
    system_end,
    token_length_normalized,
    unconditional_likelihood_normalized,
    user,
    user_begin,
    user_end,
    video,
)
from sgl_nb.language.function import (
    flush_cache,
    function,
    get_default_backend,
    get_server_info,
    set_default_backend,
)
from sgl_nb.language.global_config import global_config
from sgl_nb.language.state import ProgramCancelled, ProgramError, ProgramState
from sgl_nb.runtime.request import GenerateOutput
from sgl_nb.runtime.sampling_params import SamplingParams
from sgl_nb.tracing_api import disable_tracing, enable_tracing

__all__ = [
    "REGEX_BOOL", "REGEX_FLOAT", "REGEX_INT", "REGEX_STR", "GenerateOutput", "ProgramCancelled",
    "ProgramError", "ProgramState", "Runtime", "SamplingParams", "assistant", "assistant_begin",
    "assistant_end", "flush_cache", "function", "gen", "gen_int", "gen_string",
    "get_default_backend", "get_server_info", "greedy_token_selection", "image", "select",
    "separate_reasoning", "set_default_backend", "system", "system_begin", "system_end",
    "token_length_normalized", "unconditional_likelihood_normalized", "user", "user_begin",
    "user_end", "video", "enable_tracing", "disable_tracing", "RuntimeEndpoint",
    "global_config", "diff", "RunDiff", "__version__",
    # SGLang's names for what sgl-nb does not have: calling one says what to use instead.
    "Anthropic", "Crusoe", "Engine", "LiteLLM", "OpenAI", "ServerArgs", "VertexAI",
]
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
