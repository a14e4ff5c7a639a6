"""sgl-nb: a Jupyter-first runtime and tracing debugger for structured LLM programs.

Programs written for SGLang's frontend run with `import sgl_nb as sgl`.
"""

from sgl_nb.expressions import (
    REGEX_BOOL,
    REGEX_FLOAT,
    REGEX_INT,
    REGEX_STR,
    assistant,
    gen,
    gen_int,
    gen_string,
    select,
    system,
    user,
)
from sgl_nb.function import function, get_default_backend, set_default_backend
from sgl_nb.local_runtime import Runtime
from sgl_nb.runtime.request import GenerateOutput
from sgl_nb.runtime.sampling_params import SamplingParams
from sgl_nb.runtime_endpoint import RuntimeEndpoint
from sgl_nb.state import ProgramError, ProgramState
from sgl_nb.tracing_api import disable_tracing, enable_tracing

__all__ = [
    "REGEX_BOOL", "REGEX_FLOAT", "REGEX_INT", "REGEX_STR", "GenerateOutput", "ProgramError",
    "ProgramState", "Runtime", "SamplingParams", "assistant", "function", "gen", "gen_int",
    "gen_string", "get_default_backend", "select", "set_default_backend", "system", "user",
    "enable_tracing", "disable_tracing", "RuntimeEndpoint",
]
__version__ = "0.1.0"


def load_ipython_extension(ipython) -> None:
    """`%load_ext sgl_nb`: the %%sgl, %sgl_model, %sgl_cache and %sgl_trace magics."""
    from sgl_nb.magics import load_ipython_extension as load  # IPython only when asked

    load(ipython)
