"""Where spans go: an OTLP/JSON lines file, or OTLP/HTTP protobuf to a receiver; and the
guard that keeps a failing destination from troubling the program."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from sgl_nb.tracing.otlp_json import encode_line

log = logging.getLogger("sgl_nb.tracing")

# The OTLP/HTTP exporter logs every failed batch itself; while our guard runs it, those
# records are dropped (on that thread only) and the guard says it once, in its own words.
_OTLP_LOGGERS = ("opentelemetry.exporter.otlp.proto.http.trace_exporter",
                 "opentelemetry.exporter.otlp.common.http")
_quiet = threading.local()


class _QuietFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(_quiet, "on", False)


_FILTER = _QuietFilter()
for _name in _OTLP_LOGGERS:
    logging.getLogger(_name).addFilter(_FILTER)


class JsonFileExporter(SpanExporter):
    """Appends one OTLP/JSON ExportTraceServiceRequest per batch, one per line."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._file = None
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        line = encode_line(spans)
        with self._lock:
            if self._file is None:
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open
            self._file.write(line)
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __repr__(self) -> str:
        return f"OTLP/JSON file {self.path}"


def otlp_http_exporter(endpoint: str, headers: dict | None = None,
                       timeout: float = 5.0) -> SpanExporter:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    exp = OTLPSpanExporter(endpoint=endpoint, headers=headers, timeout=timeout)
    exp.sgl_destination = f"OTLP/HTTP receiver {endpoint}"
    return exp


class GuardedExporter(SpanExporter):
    """Runs an exporter in the span processor's thread; when it fails (raises or reports
    failure) it logs ONE warning naming the destination, and while the destination stays
    down drops batches at once for `retry_s` seconds instead of waiting on it again."""

    def __init__(self, inner: SpanExporter, retry_s: float = 10.0):
        self.inner, self.retry_s = inner, retry_s
        self.failures = 0  # batches lost
        self.cpu_ns = 0  # CPU time spent exporting (encoding, writing, sending)
        self.warned = False
        self._down_until = 0.0

    @property
    def destination(self) -> str:
        return getattr(self.inner, "sgl_destination", None) or repr(self.inner)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if time.monotonic() < self._down_until:
            self.failures += 1
            return SpanExportResult.FAILURE
        _quiet.on = True
        t0 = time.thread_time_ns()
        try:
            result = self.inner.export(spans)
            error = None if result == SpanExportResult.SUCCESS else "the export failed"
        except Exception as e:  # noqa: BLE001 - a broken destination must not break the run
            result, error = SpanExportResult.FAILURE, f"{type(e).__name__}: {e}"
        finally:
            _quiet.on = False
            self.cpu_ns += time.thread_time_ns() - t0
        if error is not None:
            self._fail(error, len(spans))
        return result

    def _fail(self, error: str, n: int) -> None:
        self.failures += 1
        self._down_until = time.monotonic() + self.retry_s
        if not self.warned:
            self.warned = True
            log.warning("sgl-nb tracing: cannot export spans to %s (%s); %d spans dropped. "
                        "The program goes on; tracing keeps trying every %gs without "
                        "further warnings.", self.destination, error, n, self.retry_s)

    def shutdown(self) -> None:
        _quiet.on = True
        try:
            self.inner.shutdown()
        except Exception:  # noqa: BLE001, S110 - already warned about this destination
            pass
        finally:
            _quiet.on = False

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)
