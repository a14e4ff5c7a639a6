"""sgl-nb: a Jupyter-first runtime and tracing debugger for structured LLM programs."""

from sgl_nb.local_runtime import Runtime
from sgl_nb.runtime.request import GenerateOutput
from sgl_nb.runtime.sampling_params import SamplingParams

__all__ = ["Runtime", "GenerateOutput", "SamplingParams"]
__version__ = "0.1.0"
