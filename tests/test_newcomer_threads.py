"""Only the round's thread builds Python ASTs during a run: CPython 3.11 fails ASTs built in two threads at once."""

from __future__ import annotations

import ast
import threading

import pytest

from fedhog import api


@pytest.mark.slow
def test_no_thread_but_the_rounds_builds_an_ast_during_a_vectorized_run(tmp_path, monkeypatch):
    """The writer thread evaluated each round by decoding its ArrayRecord (np.load parses headers with
    ast.literal_eval) while the round's thread decoded the next: issue 35's SystemError."""
    threads: list[str] = []
    parse = ast.parse

    def recording(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return parse(*args, **kwargs)

    monkeypatch.setattr(ast, "parse", recording)
    api.run(None, engine="vectorized", population=10, num_samples=400, rounds=2, sampling_rate=0.5, model="mlp",
            mechanism="gaussian", results_dir=str(tmp_path / "run"))
    assert threads, "no AST built at all: the test no longer watches the decoding"
    assert set(threads) == {threading.main_thread().name}


def test_most_of_a_cohort_non_finite_is_a_warning_with_its_numbers():
    from fedhog.protocol import Rejection
    from fedhog.strategy import RoundRecord

    record = RoundRecord(round=20, clients_sampled=30)
    record.rejections = {Rejection.NON_FINITE_VALUES.value: 12, Rejection.NON_FINITE_THIRD_ORDER_TERM.value: 4}
    warning = record.divergence_warning(0.1)
    assert warning.startswith("divergence: 16 of 30 sampled clients sent NaN or inf") and "learning-rate=0.1" in warning
    record.rejections = {Rejection.NON_FINITE_VALUES.value: 15, Rejection.TOO_LARGE.value: 10}
    assert record.divergence_warning(0.1) == ""  # half, and other rejections, are not a divergence
    assert RoundRecord(round=1, clients_sampled=0).divergence_warning(0.1) == ""  # an empty cohort
