"""OTLP/JSON: spans to one ExportTraceServiceRequest per line, and back.

As the OTLP/JSON spec says: lowerCamelCase field names, enums as integers, trace and span
ids as hex strings (not base64), 64-bit integers as decimal strings."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan

# ---- encoding ------------------------------------------------------------------------------


def _any(v) -> dict:
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v if math.isfinite(v) else str(v).replace("inf", "Infinity")
                .replace("nan", "NaN")}
    if isinstance(v, str):
        return {"stringValue": v}
    if isinstance(v, bytes):
        import base64

        return {"bytesValue": base64.b64encode(v).decode()}
    if isinstance(v, list | tuple):
        return {"arrayValue": {"values": [_any(x) for x in v]}}
    if isinstance(v, dict):
        return {"kvlistValue": {"values": _kvs(v)}}
    return {"stringValue": str(v)}


def _kvs(attrs) -> list[dict]:
    return [{"key": k, "value": _any(v)} for k, v in (attrs or {}).items()]


def _span(s: ReadableSpan) -> dict:
    c = s.context
    out = {"traceId": f"{c.trace_id:032x}", "spanId": f"{c.span_id:016x}",
           "name": s.name, "kind": s.kind.value + 1,  # OTLP counts SPAN_KIND_UNSPECIFIED = 0
           "startTimeUnixNano": str(s.start_time), "endTimeUnixNano": str(s.end_time),
           "attributes": _kvs(s.attributes), "flags": int(c.trace_flags) | 0x100}
    if s.parent is not None:
        out["parentSpanId"] = f"{s.parent.span_id:016x}"
    if s.events:
        out["events"] = [{"timeUnixNano": str(e.timestamp), "name": e.name,
                          "attributes": _kvs(e.attributes)} for e in s.events]
    if s.links:
        out["links"] = [{"traceId": f"{lk.context.trace_id:032x}",
                         "spanId": f"{lk.context.span_id:016x}",
                         "attributes": _kvs(lk.attributes)} for lk in s.links]
    st = s.status
    if st.status_code.value:
        out["status"] = {"code": st.status_code.value, **({"message": st.description}
                                                          if st.description else {})}
    return out


def encode(spans: Sequence[ReadableSpan]) -> dict:
    """One ExportTraceServiceRequest: spans grouped by resource, then by scope."""
    by_resource: dict = {}
    for s in spans:
        scopes = by_resource.setdefault(id(s.resource), (s.resource, {}))[1]
        scope = s.instrumentation_scope
        scopes.setdefault(id(scope), (scope, []))[1].append(_span(s))
    out = []
    for resource, scopes in by_resource.values():
        scope_spans = []
        for scope, items in scopes.values():
            sc = {"name": scope.name if scope else ""}
            if scope is not None and scope.version:
                sc["version"] = scope.version
            if scope is not None and getattr(scope, "attributes", None):
                sc["attributes"] = _kvs(scope.attributes)
            scope_spans.append({"scope": sc, "spans": items})
        out.append({"resource": {"attributes": _kvs(resource.attributes)},
                    "scopeSpans": scope_spans})
    return {"resourceSpans": out}


def encode_line(spans: Sequence[ReadableSpan]) -> str:
    return json.dumps(encode(spans), separators=(",", ":"), ensure_ascii=False) + "\n"


# ---- decoding ------------------------------------------------------------------------------


class TraceFormatError(ValueError):
    """The file is not a trace this version of sgl-nb can replay (the message says why and
    where)."""


# What a field of the wrong shape raises while a span is read back.
# What a well-formed line with a wrong field raises while decoding (OverflowError: a time
# of inf, as json reads "Infinity").
MALFORMED = (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError)


@dataclass
class SpanRecord:
    """A span read back from OTLP/JSON."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    start: int
    end: int
    attributes: dict
    events: list[tuple[str, int, dict]] = field(default_factory=list)
    links: list[tuple[str, str, dict]] = field(default_factory=list)
    status: int = 0
    scope: str = ""
    scope_attributes: dict = field(default_factory=dict)
    resource: dict = field(default_factory=dict)


def _value(v: dict):
    (kind, x), = v.items() if v else (("stringValue", None),)
    if kind == "intValue":
        return int(x)
    if kind == "doubleValue":
        return float(x)  # float("NaN") / float("Infinity") read the spec's strings
    if kind == "arrayValue":
        return [_value(i) for i in x.get("values", [])]
    if kind == "kvlistValue":
        return _attrs(x.get("values", []))
    return x


def _attrs(kvs) -> dict:
    return {kv["key"]: _value(kv.get("value") or {}) for kv in kvs or []}


def decode(request: dict) -> Iterator[SpanRecord]:
    for rs in request.get("resourceSpans", []):
        resource = _attrs((rs.get("resource") or {}).get("attributes"))
        for ss in rs.get("scopeSpans", []):
            scope = ss.get("scope") or {}
            scope_attrs = _attrs(scope.get("attributes"))
            for s in ss.get("spans", []):
                yield SpanRecord(
                    s["traceId"], s["spanId"], s.get("parentSpanId") or None, s["name"],
                    int(s["startTimeUnixNano"]), int(s["endTimeUnixNano"]),
                    _attrs(s.get("attributes")),
                    [(e["name"], int(e["timeUnixNano"]), _attrs(e.get("attributes")))
                     for e in s.get("events", [])],
                    [(lk["traceId"], lk["spanId"], _attrs(lk.get("attributes")))
                     for lk in s.get("links", [])],
                    (s.get("status") or {}).get("code", 0), scope.get("name", ""),
                    scope_attrs, resource)


def read_spans(path) -> list[SpanRecord]:
    """Every span of an OTLP/JSON lines file, in line order; TraceFormatError naming the
    line for anything else."""
    out = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise TraceFormatError(f"{where}: not UTF-8 text") from None
            if not line.strip():
                continue
            try:
                request = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as e:
                why = getattr(e, "msg", "nested too deeply")
                raise TraceFormatError(f"{where}: not an OTLP/JSON line ({why})") from None
            if not isinstance(request, dict) or "resourceSpans" not in request:
                raise TraceFormatError(f"{where}: not an OTLP/JSON trace export "
                                       "(no resourceSpans)")
            try:
                out.extend(decode(request))
            except MALFORMED as e:
                raise TraceFormatError(f"{where}: a malformed span ({type(e).__name__}: "
                                       f"{e})") from None
    return out
