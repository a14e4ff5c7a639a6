"""SGLang 0.5.23's public frontend surface, name by name, read from its sources with `ast`
(nothing of SGLang is imported): what docs/sglang_compat.md must cover. Used by
tests/test_sglang_surface.py, with SGLang's sources from `.venv-sglang` (or the folder
SGL_NB_SGLANG_SRC names)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def sglang_package() -> Path | None:
    """The installed `sglang` package folder (its sources are read, never imported)."""
    env = os.environ.get("SGL_NB_SGLANG_SRC")
    if env:
        return Path(env)
    found = sorted(ROOT.glob(".venv-sglang/lib/python3*/site-packages/sglang"))
    return found[0] if found else None


def _tree(pkg: Path, rel: str) -> ast.Module:
    return ast.parse((pkg / rel).read_text(encoding="utf-8"))


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _function(body: list, name: str) -> ast.FunctionDef:
    return next(n for n in body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                and n.name == name)


def _params(fn: ast.FunctionDef, skip: tuple = ("self",)) -> set[str]:
    args = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
    return {a.arg for a in args if a.arg not in skip}


def _self_attrs(fn: ast.FunctionDef) -> set[str]:
    return {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)
            and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
            and n.value.id == "self"}


def _members(cls: ast.ClassDef, dunders: bool = True, attrs: bool = True) -> set[str]:
    """Public methods (and dunders but __init__), class-level names, and (attrs) what
    __init__ assigns to self."""
    out: set[str] = set()
    for n in cls.body:
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
            public = not n.name.startswith("_")
            dunder = n.name.startswith("__") and n.name != "__init__"
            if public or (dunders and dunder):
                out.add(n.name)
            if n.name == "__init__" and attrs:
                out |= {a for a in _self_attrs(n) if not a.startswith("_")}
        elif isinstance(n, ast.Assign):
            out |= {t.id for t in n.targets if isinstance(t, ast.Name)
                    and not t.id.startswith("_")}
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
    return out


def sglang_surface(pkg: Path) -> dict[str, set[str]]:
    """Section of docs/sglang_compat.md -> the SGLang names it must have a row for."""
    init = _tree(pkg, "__init__.py")
    all_names = next(n.value for n in init.body if isinstance(n, ast.Assign)
                     and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets))
    api, ir = _tree(pkg, "lang/api.py"), _tree(pkg, "lang/ir.py")
    interp = _tree(pkg, "lang/interpreter.py")
    function = _class(ir, "SglFunction")
    state_attrs = {n.attr for n in ast.walk(interp) if isinstance(n, ast.Attribute)
                   and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
                   and n.value.id == "state"}  # run_internal's state.ret_value
    choices = _tree(pkg, "lang/choices.py")
    endpoint = _tree(pkg, "lang/backend/runtime_endpoint.py")
    runtime_cls = _class(endpoint, "Runtime")
    endpoint_cls = _class(endpoint, "RuntimeEndpoint")
    return {
        "sgl": {ast.literal_eval(e) for e in all_names.elts},
        "gen()": _params(_function(api.body, "gen"), skip=()),
        "SglSamplingParams": _members(_class(ir, "SglSamplingParams")),
        "run()": _params(_function(function.body, "run"))
        | _params(_function(function.body, "run_batch"), skip=("self", "batch_kwargs")),
        "SglFunction": _members(function),
        "ProgramState": _members(_class(interp, "ProgramState")) | state_attrs,
        "ProgramStateGroup": _members(_class(interp, "ProgramStateGroup")),
        "StreamExecutor": _members(_class(interp, "StreamExecutor"), dunders=False,
                                   attrs=False),
        "choices": {n.name for n in choices.body if isinstance(n, ast.ClassDef)}
        | {t.id for n in choices.body if isinstance(n, ast.Assign) for t in n.targets
           if isinstance(t, ast.Name)},
        "global_config": _self_attrs(_function(_class(_tree(pkg, "lang/global_config.py"),
                                                      "GlobalConfig").body, "__init__")),
        "Runtime": _members(runtime_cls)
        | _params(_function(runtime_cls.body, "__init__")),
        "RuntimeEndpoint": _members(endpoint_cls)
        | _params(_function(endpoint_cls.body, "__init__")),
        "BaseBackend": _members(_class(_tree(pkg, "lang/backend/base_backend.py"),
                                       "BaseBackend")),
    }


# The surface of SGLang 0.5.23 (what sglang_surface() reads from its sources): the table
# is checked against this always, and this against the installed sources when present.
SGLANG_0_5_23: dict[str, set[str]] = {
    "sgl": {
        "Anthropic", "Crusoe", "Engine", "LiteLLM", "OpenAI", "Runtime", "RuntimeEndpoint",
        "ServerArgs", "VertexAI", "__version__", "assistant", "assistant_begin", "assistant_end",
        "flush_cache", "function", "gen", "gen_int", "gen_string", "get_server_info",
        "global_config", "greedy_token_selection", "image", "select", "separate_reasoning",
        "set_default_backend", "system", "system_begin", "system_end", "token_length_normalized",
        "unconditional_likelihood_normalized", "user", "user_begin", "user_end", "video"
    },
    "gen()": {
        "choices", "choices_method", "dtype", "frequency_penalty", "ignore_eos", "json_schema",
        "logprob_start_len", "max_tokens", "min_p", "min_tokens", "n", "name", "presence_penalty",
        "regex", "return_logprob", "return_text_in_logprobs", "stop", "stop_regex",
        "stop_token_ids", "temperature", "top_k", "top_logprobs_num", "top_p"
    },
    "SglSamplingParams": {
        "clone", "dtype", "frequency_penalty", "ignore_eos", "json_schema", "logprob_start_len",
        "max_new_tokens", "min_new_tokens", "min_p", "n", "presence_penalty", "regex",
        "return_logprob", "return_text_in_logprobs", "stop", "stop_regex", "stop_token_ids",
        "temperature", "to_anthropic_kwargs", "to_litellm_kwargs", "to_openai_kwargs",
        "to_srt_kwargs", "to_vertexai_kwargs", "top_k", "top_logprobs_num", "top_p"
    },
    "run()": {
        "backend", "frequency_penalty", "generator_style", "ignore_eos", "logprob_start_len",
        "max_new_tokens", "min_p", "n", "num_threads", "presence_penalty", "progress_bar",
        "return_logprob", "return_text_in_logprobs", "stop", "stop_regex", "stop_token_ids",
        "stream", "temperature", "top_k", "top_logprobs_num", "top_p", "use_thread"
    },
    "SglFunction": {
        "__call__", "arg_defaults", "arg_names", "bind", "bind_arguments", "cache", "func",
        "num_api_spec_tokens", "pin_prefix_rid", "run", "run_batch", "trace"
    },
    "ProgramState": {
        "__contains__", "__del__", "__getitem__", "__iadd__", "__repr__", "__setitem__",
        "assistant", "copy", "error", "fork", "get_meta_info", "get_var", "messages", "ret_value",
        "set_var", "stream_executor", "sync", "system", "text", "text_async_iter", "text_iter",
        "user", "var_scope"
    },
    "ProgramStateGroup": {
        "__getitem__", "__iadd__", "__setitem__", "join", "src_state", "states"
    },
    "StreamExecutor": {
        "end", "error", "fork", "get_meta_info", "get_var", "messages", "set_var", "submit",
        "sync", "text"
    },
    "choices": {
        "ChoicesDecision", "ChoicesSamplingMethod", "GreedyTokenSelection",
        "TokenLengthNormalized", "UnconditionalLikelihoodNormalized", "greedy_token_selection",
        "token_length_normalized", "unconditional_likelihood_normalized"
    },
    "global_config": {
        "default_backend", "enable_parallel_encoding", "enable_precache_with_tracing",
        "skip_special_tokens_in_output", "spaces_between_special_tokens_in_out", "verbosity"
    },
    "Runtime": {
        "__del__", "add_request", "async_generate", "cache_prefix", "encode", "endpoint",
        "generate", "generate_url", "get_server_info", "get_tokenizer", "launch_timeout",
        "log_level", "pid", "server_args", "shutdown", "start_profile", "stop_profile", "url"
    },
    "RuntimeEndpoint": {
        "api_key", "base_url", "cache_prefix", "chat_template", "chat_template_name",
        "commit_lazy_operations", "concatenate_and_append", "fill_image", "flush_cache",
        "generate", "generate_stream", "get_chat_template", "get_model_name", "get_server_info",
        "model_info", "select", "start_profile", "stop_profile", "support_concate_and_append",
        "verify"
    },
    "BaseBackend": {
        "begin_program", "cache_prefix", "chat_template", "commit_lazy_operations",
        "concatenate_and_append", "end_program", "end_request", "fill_image", "flush_cache",
        "fork_program", "generate", "generate_stream", "get_chat_template", "get_model_name",
        "get_server_info", "select", "shutdown", "support_concate_and_append", "uncache_prefix"
    },
}
