"""Prometheus metrics of a fedhog run: server-side figures per round, and client memory.

:class:`ServerMetrics` owns its own :class:`~prometheus_client.CollectorRegistry`
(never the process-wide default), so several runs or tests in one process
never collide. Feed it one finished round at a time with
:meth:`ServerMetrics.observe_round`; read it by scraping
:meth:`ServerMetrics.start_http_server` (bound to 127.0.0.1 unless told
otherwise) or from the text file :meth:`ServerMetrics.write_snapshot` leaves
in the results folder.

Counters count from the start of *this process*: a resumed run starts them at
zero again (Prometheus treats that as a counter reset, which ``rate()`` and
``increase()`` handle).

Clients measure their own memory with :func:`measure_peak_memory` and report
it in their MetricRecord under :data:`PEAK_MEMORY_KEY` and
:data:`PEAK_MEMORY_CUDA_KEY`; the server exposes the largest figure of each
round.
"""

from __future__ import annotations

import math
import resource
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import start_http_server as _start_http_server

from .files import atomic_write
from .protocol import THIRD_ORDER_SECONDS, Rejection

#: Client MetricRecord key: peak memory in bytes (see :func:`measure_peak_memory`).
PEAK_MEMORY_KEY = "peak-memory-bytes"
#: Client MetricRecord key: 1 if :data:`PEAK_MEMORY_KEY` is CUDA memory, 0 if it is the process's peak RSS.
PEAK_MEMORY_CUDA_KEY = "peak-memory-cuda"
#: Client MetricRecord key read for the third-order computation time (set by the ClientApp).
THIRD_ORDER_SECONDS_KEY = THIRD_ORDER_SECONDS

#: What a snapshot file is called in the results folder, by convention.
SNAPSHOT_NAME = "metrics.prom"

# Seconds per third-order computation: milliseconds (tiny models on CPU) to minutes.
THIRD_ORDER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                       10.0, 30.0, 60.0, 120.0, 300.0)
# Seconds per round: a simulation round on one core to a slow real deployment.
ROUND_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)

# Rejections that are not a sampled client's failure.
_NOT_A_COHORT_REPLY = (Rejection.NOT_SAMPLED.label, Rejection.DUPLICATE.label)
FAILURE_REASONS = (Rejection.CLIENT_ERROR.label, "no_reply")


# --- client side -----------------------------------------------------------------
@dataclass
class PeakMemory:
    """What :func:`measure_peak_memory` measured: filled in when the ``with`` block ends."""

    bytes: int = 0
    source: str = ""  # "cuda": torch.cuda.max_memory_allocated; "rss": the process's peak resident set size

    @property
    def is_cuda(self) -> bool:
        """Whether :attr:`bytes` is CUDA memory allocated by PyTorch."""
        return self.source == "cuda"

    def as_metrics(self) -> dict[str, int]:
        """The client MetricRecord entries: ``{PEAK_MEMORY_KEY: bytes, PEAK_MEMORY_CUDA_KEY: 0 or 1}``."""
        return {PEAK_MEMORY_KEY: int(self.bytes), PEAK_MEMORY_CUDA_KEY: int(self.is_cuda)}


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far, in bytes (``getrusage``; KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _cuda_device(device: Any) -> Any:
    """The CUDA device to measure, or None to measure RSS."""
    import torch  # the client has it; imported here so the server side needs no CUDA query at import

    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return device


@contextmanager
def measure_peak_memory(device: Any = None) -> Iterator[PeakMemory]:
    """Measure the peak memory of the enclosed block; the yielded :class:`PeakMemory` is set on exit.

    On a CUDA ``device`` (or, with ``device=None``, whenever CUDA is available)
    the figure is ``torch.cuda.max_memory_allocated`` after resetting the peak
    at entry: the memory PyTorch's allocator held for the block, autograd
    graphs of the higher-order derivatives included (``source="cuda"``).

    Otherwise it is the process's peak RSS from ``resource.getrusage``
    (``source="rss"``). That is a high-water mark of the whole process which
    cannot be reset: it includes everything before the block, never goes down
    between rounds, and under the Simulation Engine covers every client the
    worker process has run.

    >>> with measure_peak_memory("cpu") as peak:
    ...     pass
    >>> peak.source, peak.bytes > 0
    ('rss', True)
    """
    peak = PeakMemory()
    cuda = _cuda_device(device)
    if cuda is not None:
        import torch

        torch.cuda.synchronize(cuda)
        torch.cuda.reset_peak_memory_stats(cuda)
    try:
        yield peak
    finally:
        if cuda is not None:
            import torch

            torch.cuda.synchronize(cuda)
            peak.bytes, peak.source = int(torch.cuda.max_memory_allocated(cuda)), "cuda"
        else:
            peak.bytes, peak.source = peak_rss_bytes(), "rss"


# --- server side -----------------------------------------------------------------
def array_nbytes(array: Any) -> int:
    """Bytes of one Flower ``Array``'s values (elements × item size; the serialised size if the dtype is unknown)."""
    try:
        return int(math.prod(array.shape)) * np.dtype(array.dtype).itemsize
    except TypeError:
        return len(array.data)


def reply_nbytes(content: Any) -> int:
    """Sum of the ``nbytes`` of every array in every ArrayRecord of a reply's RecordDict."""
    return sum(array_nbytes(array) for record in content.array_records.values() for array in record.values())


def _number(value: Any) -> float | None:
    """A finite float, or None for missing / non-numeric / NaN values."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return None if math.isnan(value) else value


class ServerMetrics:
    """Counters, gauges and histograms of one fedhog run, in a registry of its own.

    Parameters
    ----------
    namespace : str
        Prefix of every metric name (``fedhog_rounds_total``, ...).
    const_labels : mapping, optional
        Labels put on every metric, e.g. ``{"run": "20250101-120000"}``.
    """

    def __init__(self, namespace: str = "fedhog", const_labels: Mapping[str, str] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._server: Any = None
        self._thread: Any = None
        labels = dict(const_labels or {})

        def make(kind: Any, name: str, documentation: str, labelnames: tuple[str, ...] = (), **kwargs: Any) -> Any:
            return kind(name, documentation, labelnames=tuple(labels) + labelnames, namespace=namespace,
                        registry=self.registry, **kwargs)

        self._labels = labels
        # rounds
        self.rounds = make(Counter, "rounds", "Rounds finished")
        self.last_round = make(Gauge, "last_round", "Number of the last finished round")
        self.round_seconds = make(Histogram, "round_seconds", "Seconds per round (sampling to evaluation)",
                                  buckets=ROUND_BUCKETS)
        # higher-order computation
        self.third_order_seconds = make(
            Histogram, "third_order_seconds",
            "Seconds per client third-order computation (accepted replies)", buckets=THIRD_ORDER_BUCKETS)
        self.third_order_seconds_max = make(
            Gauge, "third_order_seconds_max", "Largest third-order computation time of the last round")
        self.third_order_failures = make(
            Counter, "third_order_failures", "Third-order computations reported non-finite by clients")
        # clients
        self.clients_sampled = make(Counter, "clients_sampled", "Clients sampled into a cohort")
        self.clients_accepted = make(Counter, "clients_accepted", "Client replies accepted into aggregation")
        self.clients_rejected = make(Counter, "clients_rejected", "Client replies rejected, by reason",
                                     labelnames=("reason",))
        self.clients_failed = make(
            Counter, "clients_failed",
            "Sampled clients that delivered no result: replied with an error (client_error, also counted "
            "as rejected) or did not reply in time (no_reply)", labelnames=("reason",))
        self.client_peak_memory = make(
            Gauge, "client_peak_memory_bytes",
            "Largest client peak memory of the last round; source=cuda: torch.cuda.max_memory_allocated "
            "around the third-order computation, source=rss: the client process's peak RSS",
            labelnames=("source",))
        self.bytes_received = make(Counter, "bytes_received",
                                   "Bytes of array values in client replies (ArrayRecords, sum of nbytes)")
        # privacy and quality
        self.epsilon = make(Gauge, "epsilon", "Privacy budget spent so far, ε at the run's δ (+Inf: no guarantee)")
        self.test_accuracy = make(Gauge, "test_accuracy", "Central test accuracy after the last round")
        self.test_loss = make(Gauge, "test_loss", "Central test loss after the last round")
        self.test_auroc = make(Gauge, "test_auroc", "Central test AUROC after the last round (metrics with auroc)")
        self.test_auprc = make(Gauge, "test_auprc", "Central test AUPRC (average precision) after the last round "
                               "(metrics with auprc)")
        self.train_loss = make(Gauge, "train_loss", "Mean client training loss of the last round")
        for reason in FAILURE_REASONS:
            self._with(self.clients_failed, reason=reason)  # exported as 0 before the first failure
        for gauge in (self.test_accuracy, self.test_loss, self.test_auroc, self.test_auprc, self.train_loss,
                      self.third_order_seconds_max):
            self._with(gauge).set(math.nan)  # not measured yet (0 would read as a measurement)

    def _with(self, metric: Any, **labels: str) -> Any:
        """The child of ``metric`` for the constant labels plus ``labels`` (the metric itself if none)."""
        values = {**self._labels, **labels}
        return metric.labels(**values) if values else metric

    # --- feeding -------------------------------------------------------------------
    def observe_round(
        self,
        record: Any = None,
        client_metrics: Iterable[Mapping[str, Any]] = (),
        *,
        bytes_received: int | None = None,
        **fields: Any,
    ) -> None:
        """Account one finished round.

        Parameters
        ----------
        record : RoundRecord-like, optional
            Any object with the attributes of :class:`fedhog.strategy.RoundRecord`
            (``round``, ``clients_sampled``, ``clients_accepted``, ``rejections``,
            ``epsilon``, ``seconds``, ``accuracy``, ``loss``, ``auroc``, ``auprc``, ``train_loss``,
            ``third_order_seconds_max``, ``third_order_failures``); missing ones
            are skipped. Keyword ``fields`` of the same names override it, so
            ``observe_round(round=3, clients_sampled=10, ...)`` works without one.
        client_metrics : iterable of mappings
            The MetricRecords of the accepted replies: ``third-order-seconds``
            feeds the histogram, ``peak-memory-bytes`` / ``peak-memory-cuda`` the
            memory gauge.
        bytes_received : int, optional
            Bytes of the replies' arrays (see :func:`reply_nbytes`); also read
            from the record's ``bytes_received`` if it has one.
        """
        values = {name: getattr(record, name) for name in (
            "round", "clients_sampled", "clients_accepted", "clients_rejected", "rejections", "epsilon",
            "seconds", "accuracy", "loss", "auroc", "auprc", "train_loss", "third_order_seconds_max",
            "third_order_failures", "bytes_received") if record is not None and hasattr(record, name)}
        values.update(fields)
        if bytes_received is not None:
            values["bytes_received"] = bytes_received
        client_metrics = [dict(m) for m in client_metrics]

        self._with(self.rounds).inc()
        if _number(values.get("round")) is not None:
            self._with(self.last_round).set(values["round"])
        seconds = _number(values.get("seconds"))
        if seconds is not None and seconds >= 0:
            self._with(self.round_seconds).observe(seconds)

        # clients
        sampled = int(values.get("clients_sampled", 0))
        accepted = int(values.get("clients_accepted", len(client_metrics)))
        rejections = {Rejection(k).label: int(v) for k, v in dict(values.get("rejections") or {}).items()}
        unexplained = int(values.get("clients_rejected", sum(rejections.values()))) - sum(rejections.values())
        if unexplained > 0:
            rejections["unknown"] = rejections.get("unknown", 0) + unexplained
        self._with(self.clients_sampled).inc(max(sampled, 0))
        self._with(self.clients_accepted).inc(max(accepted, 0))
        for reason, count in rejections.items():
            self._with(self.clients_rejected, reason=reason).inc(max(count, 0))
        client_errors = rejections.get(Rejection.CLIENT_ERROR.label, 0)
        cohort_replies = accepted + sum(c for r, c in rejections.items() if r not in _NOT_A_COHORT_REPLY)
        self._with(self.clients_failed, reason=Rejection.CLIENT_ERROR.label).inc(max(client_errors, 0))
        self._with(self.clients_failed, reason="no_reply").inc(max(sampled - cohort_replies, 0))
        if values.get("bytes_received") is not None:
            self._with(self.bytes_received).inc(max(int(values["bytes_received"]), 0))

        # higher-order computation
        per_client = [s for s in (_number(m.get(THIRD_ORDER_SECONDS_KEY)) for m in client_metrics)
                      if s is not None and s >= 0]
        for s in per_client:
            self._with(self.third_order_seconds).observe(s)
        largest = _number(values.get("third_order_seconds_max"))
        if largest is None and per_client:
            largest = max(per_client)
        if largest is not None:
            self._with(self.third_order_seconds_max).set(largest)
        failures = int(values.get("third_order_failures", 0))
        if failures > 0:
            self._with(self.third_order_failures).inc(failures)

        # client memory: the largest figure of this round, per source
        peaks: dict[str, float] = {}
        for m in client_metrics:
            peak = _number(m.get(PEAK_MEMORY_KEY))
            if peak is None or peak < 0:
                continue
            source = "cuda" if m.get(PEAK_MEMORY_CUDA_KEY, 0) else "rss"
            peaks[source] = max(peaks.get(source, 0.0), peak)
        for source, peak in peaks.items():
            self._with(self.client_peak_memory, source=source).set(peak)

        # privacy and quality: gauges hold the latest value; NaN (not measured) leaves them as they were
        for gauge, name in ((self.epsilon, "epsilon"), (self.test_accuracy, "accuracy"), (self.test_loss, "loss"),
                            (self.test_auroc, "auroc"), (self.test_auprc, "auprc"), (self.train_loss, "train_loss")):
            value = _number(values.get(name))
            if value is not None:
                self._with(gauge).set(value)

    # --- reading -------------------------------------------------------------------
    def exposition(self) -> bytes:
        """The registry in the Prometheus text exposition format."""
        return generate_latest(self.registry)

    def write_snapshot(self, path: str | Path) -> Path:
        """Write :meth:`exposition` to ``path`` atomically (readers see the old file or the new one)."""
        path = Path(path)
        atomic_write(path, self.exposition())
        return path

    def start_http_server(self, port: int = 0, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``addr:port`` in a daemon thread; return the port (``port=0``: a free one).

        Binds to loopback unless ``addr`` says otherwise; the figures include
        ε and client counts, so expose them beyond the host deliberately.
        """
        if self._server is not None:
            raise RuntimeError(f"the metrics server already listens on port {self.port}")
        self._server, self._thread = _start_http_server(port, addr=addr, registry=self.registry)
        return int(self._server.server_port)

    @property
    def port(self) -> int | None:
        """The port the HTTP endpoint listens on, or None when it is not running."""
        return None if self._server is None else int(self._server.server_port)

    def stop(self) -> None:
        """Stop the HTTP endpoint, if running, and release its port. Safe to call twice."""
        server, thread, self._server, self._thread = self._server, self._thread, None, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    def __enter__(self) -> ServerMetrics:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
