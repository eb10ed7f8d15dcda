"""ServerMetrics: exposition values, the HTTP endpoint, registry isolation, snapshots, client memory."""

from __future__ import annotations

import math
import socket
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from fedhog.monitoring import (
    PEAK_MEMORY_CUDA_KEY,
    PEAK_MEMORY_KEY,
    PeakMemory,
    ServerMetrics,
    measure_peak_memory,
    peak_rss_bytes,
    reply_nbytes,
)
from fedhog.protocol import Rejection
from fedhog.strategy import RoundRecord


def samples(text: str | bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of an exposition text."""
    if isinstance(text, bytes):
        text = text.decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(parsed, name: str, **labels: str) -> float:
    return parsed[(name, tuple(sorted(labels.items())))]


def total(parsed, name: str) -> float:
    """Sum of a sample over all its label sets."""
    return sum(v for (n, _), v in parsed.items() if n == name)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.status == 200
        return response.read().decode()


def round_record(n: int, **overrides) -> RoundRecord:
    """A synthetic round: 5 sampled, 3 accepted, 1 rejected as non-finite, 1 silent."""
    fields = {"round": n, "clients_sampled": 5, "clients_accepted": 3, "clients_rejected": 1,
              "rejections": {Rejection.NON_FINITE_THIRD_ORDER_TERM: 1}, "epsilon": 0.25 * n, "seconds": 0.75,
              "accuracy": 0.5 + 0.1 * n, "loss": 2.0 / n, "train_loss": 1.5 / n,
              "third_order_seconds_max": 0.02 * n, "third_order_failures": 1}
    fields.update(overrides)
    return RoundRecord(**fields)


def client_metrics(n: int) -> list[dict]:
    return [
        {"num-examples": 10, "third-order-seconds": 0.01 * n, PEAK_MEMORY_KEY: 1000 * n, PEAK_MEMORY_CUDA_KEY: 0},
        {"num-examples": 10, "third-order-seconds": 0.02 * n, PEAK_MEMORY_KEY: 3000 * n, PEAK_MEMORY_CUDA_KEY: 0},
        {"num-examples": 10, "third-order-seconds": 0.005, PEAK_MEMORY_KEY: 2000 * n, PEAK_MEMORY_CUDA_KEY: 0},
    ]


# --- values ------------------------------------------------------------------------
def test_fresh_metrics_are_zero_counters_and_unmeasured_gauges():
    parsed = samples(ServerMetrics().exposition())
    assert value(parsed, "fedhog_rounds_total") == 0
    assert value(parsed, "fedhog_clients_sampled_total") == 0
    assert value(parsed, "fedhog_clients_failed_total", reason="no_reply") == 0
    assert value(parsed, "fedhog_clients_failed_total", reason="client_error") == 0
    assert value(parsed, "fedhog_third_order_seconds_count") == 0
    assert value(parsed, "fedhog_epsilon") == 0
    assert math.isnan(value(parsed, "fedhog_test_accuracy"))
    assert math.isnan(value(parsed, "fedhog_third_order_seconds_max"))


def test_one_round_from_a_round_record():
    metrics = ServerMetrics()
    metrics.observe_round(round_record(1), client_metrics(1), bytes_received=4096)
    parsed = samples(metrics.exposition())
    assert value(parsed, "fedhog_rounds_total") == 1
    assert value(parsed, "fedhog_last_round") == 1
    assert value(parsed, "fedhog_clients_sampled_total") == 5
    assert value(parsed, "fedhog_clients_accepted_total") == 3
    assert value(parsed, "fedhog_clients_rejected_total", reason="non_finite_third_order_term") == 1
    assert value(parsed, "fedhog_clients_failed_total", reason="no_reply") == 1  # 5 - 3 accepted - 1 rejected
    assert value(parsed, "fedhog_clients_failed_total", reason="client_error") == 0
    assert value(parsed, "fedhog_third_order_failures_total") == 1
    assert value(parsed, "fedhog_bytes_received_total") == 4096
    assert value(parsed, "fedhog_epsilon") == 0.25
    assert value(parsed, "fedhog_test_accuracy") == pytest.approx(0.6)
    assert value(parsed, "fedhog_test_loss") == 2.0
    assert value(parsed, "fedhog_train_loss") == 1.5
    assert value(parsed, "fedhog_third_order_seconds_max") == 0.02
    assert value(parsed, "fedhog_client_peak_memory_bytes", source="rss") == 3000
    # histograms: one round of 0.75 s; three computations of 0.01, 0.02, 0.005 s
    assert value(parsed, "fedhog_round_seconds_count") == 1
    assert value(parsed, "fedhog_round_seconds_sum") == 0.75
    assert value(parsed, "fedhog_round_seconds_bucket", le="0.5") == 0
    assert value(parsed, "fedhog_round_seconds_bucket", le="1.0") == 1
    assert value(parsed, "fedhog_third_order_seconds_count") == 3
    assert value(parsed, "fedhog_third_order_seconds_sum") == pytest.approx(0.035)
    assert value(parsed, "fedhog_third_order_seconds_bucket", le="0.005") == 1
    assert value(parsed, "fedhog_third_order_seconds_bucket", le="0.01") == 2
    assert value(parsed, "fedhog_third_order_seconds_bucket", le="0.025") == 3


def test_explicit_keywords_without_a_record():
    metrics = ServerMetrics()
    metrics.observe_round(round=7, clients_sampled=4, clients_accepted=2, seconds=3.0, epsilon=math.inf,
                          rejections={"client error": 1, "not sampled": 2, "wrong shape": 1},
                          clients_rejected=4, accuracy=0.9,
                          client_metrics=[{"third-order-seconds": 0.5, PEAK_MEMORY_KEY: 7e9, PEAK_MEMORY_CUDA_KEY: 1},
                                          {"third-order-seconds": 1.5, PEAK_MEMORY_KEY: 9e8, PEAK_MEMORY_CUDA_KEY: 0}])
    parsed = samples(metrics.exposition())
    assert value(parsed, "fedhog_last_round") == 7
    assert value(parsed, "fedhog_epsilon") == math.inf  # no DP guarantee
    assert value(parsed, "fedhog_clients_rejected_total", reason="client_error") == 1
    assert value(parsed, "fedhog_clients_rejected_total", reason="not_sampled") == 2
    assert value(parsed, "fedhog_clients_rejected_total", reason="wrong_shape") == 1
    # the cohort of 4: 2 accepted, 1 error, 1 wrong shape; the 2 'not sampled' replies came from outside it
    assert value(parsed, "fedhog_clients_failed_total", reason="client_error") == 1
    assert value(parsed, "fedhog_clients_failed_total", reason="no_reply") == 0
    # the max gauge falls back on the clients' figures when no record gives it
    assert value(parsed, "fedhog_third_order_seconds_max") == 1.5
    assert value(parsed, "fedhog_client_peak_memory_bytes", source="cuda") == 7e9
    assert value(parsed, "fedhog_client_peak_memory_bytes", source="rss") == 9e8
    assert math.isnan(value(parsed, "fedhog_test_loss"))  # not given: still unmeasured


def test_rejections_not_itemised_are_counted_as_unknown():
    metrics = ServerMetrics()
    metrics.observe_round(round=1, clients_sampled=3, clients_accepted=1, clients_rejected=2,
                          rejections={"duplicate": 1})
    parsed = samples(metrics.exposition())
    assert value(parsed, "fedhog_clients_rejected_total", reason="duplicate") == 1
    assert value(parsed, "fedhog_clients_rejected_total", reason="unknown") == 1
    assert total(parsed, "fedhog_clients_rejected_total") == 2


def test_nan_figures_leave_gauges_and_histograms_alone():
    metrics = ServerMetrics()
    metrics.observe_round(round_record(1), client_metrics(1))
    metrics.observe_round(round_record(2, accuracy=math.nan, loss=math.nan, seconds=math.nan,
                                       third_order_seconds_max=math.nan, train_loss=math.nan),
                          [{"num-examples": 1}])  # a non-hog client: no seconds, no memory
    parsed = samples(metrics.exposition())
    assert value(parsed, "fedhog_rounds_total") == 2
    assert value(parsed, "fedhog_test_accuracy") == pytest.approx(0.6)  # round 1's
    assert value(parsed, "fedhog_round_seconds_count") == 1
    assert value(parsed, "fedhog_third_order_seconds_count") == 3
    assert value(parsed, "fedhog_third_order_seconds_max") == 0.02
    assert value(parsed, "fedhog_client_peak_memory_bytes", source="rss") == 3000
    assert value(parsed, "fedhog_epsilon") == 0.5


def test_metric_records_are_accepted_as_client_metrics():
    metrics = ServerMetrics()
    record = MetricRecord({"num-examples": 3, "third-order-seconds": 0.2, PEAK_MEMORY_KEY: 123,
                           PEAK_MEMORY_CUDA_KEY: 0})
    metrics.observe_round(round=1, clients_sampled=1, clients_accepted=1, client_metrics=[record])
    parsed = samples(metrics.exposition())
    assert value(parsed, "fedhog_third_order_seconds_count") == 1
    assert value(parsed, "fedhog_client_peak_memory_bytes", source="rss") == 123


def test_reply_nbytes_sums_array_values_of_every_array_record():
    content = RecordDict({
        "update": ArrayRecord({"w": torch.zeros(3, 4, dtype=torch.float32), "b": torch.zeros(4, dtype=torch.float64)}),
        "third-order-term": ArrayRecord([np.zeros((2,), np.int64)]),
        "metrics": MetricRecord({"num-examples": 5}),
    })
    assert reply_nbytes(content) == 3 * 4 * 4 + 4 * 8 + 2 * 8
    assert reply_nbytes(RecordDict({"metrics": MetricRecord({"a": 1})})) == 0


# --- the HTTP endpoint ------------------------------------------------------------
def test_scraping_during_a_run_shows_figures_moving():
    metrics = ServerMetrics()
    port = metrics.start_http_server(0)
    try:
        assert port > 0 and metrics.port == port
        scrapes = [samples(scrape(port))]
        for n in range(1, 4):
            metrics.observe_round(round_record(n), client_metrics(n), bytes_received=1000)
            scrapes.append(samples(scrape(port)))
    finally:
        metrics.stop()

    counters = ["fedhog_rounds_total", "fedhog_clients_sampled_total", "fedhog_clients_accepted_total",
                "fedhog_bytes_received_total", "fedhog_third_order_failures_total",
                "fedhog_round_seconds_count", "fedhog_third_order_seconds_count"]
    for name in counters:
        series = [value(s, name) for s in scrapes]
        assert series == sorted(series) and series[-1] > series[0], (name, series)
    assert [value(s, "fedhog_rounds_total") for s in scrapes] == [0, 1, 2, 3]
    assert [value(s, "fedhog_clients_sampled_total") for s in scrapes] == [0, 5, 10, 15]
    assert [value(s, "fedhog_bytes_received_total") for s in scrapes] == [0, 1000, 2000, 3000]
    assert [value(s, "fedhog_third_order_seconds_count") for s in scrapes] == [0, 3, 6, 9]
    assert [value(s, "fedhog_round_seconds_bucket", le="1.0") for s in scrapes] == [0, 1, 2, 3]
    assert [total(s, "fedhog_clients_rejected_total") for s in scrapes] == [0, 1, 2, 3]
    # gauges hold the current round's figure, not a sum
    assert [value(s, "fedhog_last_round") for s in scrapes[1:]] == [1, 2, 3]
    assert [value(s, "fedhog_epsilon") for s in scrapes] == [0, 0.25, 0.5, 0.75]
    assert [value(s, "fedhog_test_accuracy") for s in scrapes[1:]] == pytest.approx([0.6, 0.7, 0.8])
    assert [value(s, "fedhog_third_order_seconds_max") for s in scrapes[1:]] == pytest.approx([0.02, 0.04, 0.06])
    assert [value(s, "fedhog_client_peak_memory_bytes", source="rss") for s in scrapes[1:]] == [3000, 6000, 9000]


def test_stop_releases_the_port_and_is_idempotent():
    metrics = ServerMetrics()
    port = metrics.start_http_server(0, addr="127.0.0.1")
    with pytest.raises(RuntimeError, match="already listens"):
        metrics.start_http_server(0)
    metrics.stop()
    metrics.stop()
    assert metrics.port is None
    with pytest.raises(urllib.error.URLError):
        scrape(port)
    with socket.socket() as probe:  # the port is free again
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", port))
    with ServerMetrics() as again:  # and a context manager stops its server
        assert again.start_http_server(port) == port
        assert "fedhog_rounds_total 0.0" in scrape(port)
    assert again.port is None


def test_two_instances_in_one_process_do_not_collide():
    first, second = ServerMetrics(), ServerMetrics()
    ports = first.start_http_server(0), second.start_http_server(0)
    try:
        assert ports[0] != ports[1]
        first.observe_round(round_record(1), client_metrics(1))
        for n in (1, 2, 3):
            second.observe_round(round_record(n, clients_sampled=10), client_metrics(n))
        a, b = samples(scrape(ports[0])), samples(scrape(ports[1]))
    finally:
        first.stop()
        second.stop()
    assert value(a, "fedhog_rounds_total") == 1 and value(b, "fedhog_rounds_total") == 3
    assert value(a, "fedhog_clients_sampled_total") == 5 and value(b, "fedhog_clients_sampled_total") == 30
    assert value(a, "fedhog_epsilon") == 0.25 and value(b, "fedhog_epsilon") == 0.75
    assert first.registry is not second.registry
    # nothing went into the process-wide default registry
    assert not [name for name in REGISTRY._names_to_collectors if name.startswith("fedhog")]


def test_const_labels_and_namespace():
    metrics = ServerMetrics(namespace="hog", const_labels={"run": "r1"})
    metrics.observe_round(round_record(1), client_metrics(1))
    parsed = samples(metrics.exposition())
    assert value(parsed, "hog_rounds_total", run="r1") == 1
    assert value(parsed, "hog_clients_rejected_total", run="r1", reason="non_finite_third_order_term") == 1
    assert value(parsed, "hog_client_peak_memory_bytes", run="r1", source="rss") == 3000


# --- snapshots ---------------------------------------------------------------------
def test_snapshot_is_valid_exposition_text_and_replaced_atomically(tmp_path: Path):
    metrics = ServerMetrics()
    path = tmp_path / "metrics.prom"
    metrics.observe_round(round_record(1), client_metrics(1))
    assert metrics.write_snapshot(path) == path
    assert value(samples(path.read_text()), "fedhog_rounds_total") == 1
    metrics.observe_round(round_record(2), client_metrics(2))
    metrics.write_snapshot(str(path))
    parsed = samples(path.read_text())
    assert value(parsed, "fedhog_rounds_total") == 2
    assert value(parsed, "fedhog_epsilon") == 0.5
    assert path.read_bytes() == metrics.exposition()
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.prom"]  # no temporary files left


# --- client memory -----------------------------------------------------------------
def test_measure_peak_memory_on_cpu_reads_the_process_peak_rss():
    before = peak_rss_bytes()
    with measure_peak_memory("cpu") as peak:
        assert peak.bytes == 0  # filled in on exit
        block = np.ones(8 * 1024 * 1024)  # 64 MiB touched
    assert peak.source == "rss" and not peak.is_cuda
    assert peak.bytes >= before > 0
    assert peak.bytes >= block.nbytes
    assert peak.as_metrics() == {PEAK_MEMORY_KEY: peak.bytes, PEAK_MEMORY_CUDA_KEY: 0}
    assert MetricRecord(peak.as_metrics())[PEAK_MEMORY_KEY] == peak.bytes  # fits a MetricRecord


def test_measure_peak_memory_is_set_even_when_the_block_raises():
    with pytest.raises(ZeroDivisionError), measure_peak_memory("cpu") as peak:
        raise ZeroDivisionError("the block raises")
    assert peak.bytes > 0 and peak.source == "rss"


def test_peak_memory_reports_cuda():
    assert PeakMemory(5, "cuda").as_metrics() == {PEAK_MEMORY_KEY: 5, PEAK_MEMORY_CUDA_KEY: 1}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_measure_peak_memory_on_cuda_reads_the_allocator_peak():
    with measure_peak_memory("cuda") as first:
        big = torch.ones(64 * 1024 * 1024, device="cuda")  # 256 MiB
        del big
    with measure_peak_memory("cuda") as second:
        small = torch.ones(1024 * 1024, device="cuda")  # 4 MiB
        del small
    assert first.source == second.source == "cuda"
    assert first.bytes >= 256 * 1024 * 1024
    assert 4 * 1024 * 1024 <= second.bytes < first.bytes  # the peak was reset at entry
    with measure_peak_memory() as default:  # device=None: CUDA when available
        pass
    assert default.is_cuda
