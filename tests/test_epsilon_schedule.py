"""ε from the background schedule is the accountant's ε, composed release by release, to the last bit."""

from __future__ import annotations

import threading

import pytest
from flwr.supercore.privacy_accounting import GaussianPrivacyEvent

from fedhog.privacy import schedule as schedule_module
from fedhog.privacy.accounting import PLD_VALUE_DISCRETIZATION_INTERVAL, ClientLevelAccountant, privacy_config
from fedhog.privacy.pld import PldAccountant
from fedhog.privacy.schedule import LOOKAHEAD, EpsilonSchedule

SIGMA, Q, POPULATION, DELTA = 1.1, 0.1, 1000, 1e-5


def _accountant(**kwargs) -> ClientLevelAccountant:
    return ClientLevelAccountant(SIGMA, "poisson", Q, POPULATION, DELTA, accountant="pld", **kwargs)


def _release_by_release(rounds: int) -> list[float]:
    """ε after each of ``rounds`` releases from a PLD accountant that composes them one at a time."""
    reference = PldAccountant(privacy_config("poisson", POPULATION, DELTA),
                              value_discretization_interval=PLD_VALUE_DISCRETIZATION_INTERVAL)
    event = GaussianPrivacyEvent(noise_multiplier=SIGMA, sample_size=int(Q * POPULATION), population_size=POPULATION)
    values = []
    for _ in range(rounds):
        reference.compose(event)
        values.append(reference.get_epsilon(DELTA))
    return values


@pytest.mark.parametrize("planned", [True, False])
def test_scheduled_epsilon_equals_release_by_release_composition(planned: bool) -> None:
    accountant = _accountant()
    if planned:
        accountant.plan(6)
    seen = []
    for _ in range(8):  # two rounds past the plan: computed where they are asked for
        accountant.compose_round()
        seen.append(accountant.epsilon())
    assert seen == _release_by_release(8)


def test_budget_stop_agrees_with_the_backend_at_every_limit() -> None:
    epsilons = _release_by_release(4)
    accountant = _accountant()
    accountant.plan(4)
    for _ in range(3):
        following = epsilons[accountant.releases]  # ε after one more release
        backend = PldAccountant(privacy_config("poisson", POPULATION, DELTA),
                                value_discretization_interval=PLD_VALUE_DISCRETIZATION_INTERVAL)
        backend.load_state_dict(accountant.state_dict()["backend"])
        for limit in (following * 0.999, following, following * 1.001, 0.5 * following):
            assert accountant.would_exceed(limit) == backend.would_exceed(accountant.event, limit)
        accountant.compose_round()


def test_a_restored_foreign_ledger_is_read_from_the_backend() -> None:
    other = ClientLevelAccountant(2 * SIGMA, "poisson", Q, POPULATION, DELTA, accountant="pld")
    for _ in range(3):
        other.compose_round()
    state = other.state_dict()
    accountant = _accountant()
    accountant.load_state_dict(state)  # three releases of another σ: not the schedule's event
    assert accountant.epsilon() == pytest.approx(other.epsilon(), rel=0, abs=0)
    assert accountant.epsilon() < _release_by_release(3)[-1]


def test_a_restored_own_ledger_continues_on_the_schedule() -> None:
    first = _accountant()
    for _ in range(3):
        first.compose_round()
    resumed = _accountant()
    resumed.load_state_dict(first.state_dict())
    resumed.plan(5)
    resumed.compose_round()
    assert resumed.epsilon() == _release_by_release(4)[-1]


def test_the_plan_is_computed_ahead_in_a_background_thread() -> None:
    calls: list[tuple[int, str]] = []
    first_done = threading.Event()

    def epsilon_after(n: int) -> float:
        calls.append((n, threading.current_thread().name))
        first_done.set()
        return float(n) / 10

    schedule = EpsilonSchedule(epsilon_after)
    schedule.plan(1, 5)
    assert first_done.wait(5)
    for n in range(1, 6):
        assert schedule(n) == n / 10
    assert sorted(n for n, _ in calls) == [1, 2, 3, 4, 5]  # each computed once, and by the worker
    assert {name for _, name in calls} == {"fedhog-epsilon-schedule"}
    assert schedule(7) == 0.7 and calls[-1] == (7, threading.current_thread().name)  # outside the plan: here
    assert schedule(2) == 0.2 and len(calls) == 6  # remembered


def test_a_run_that_stops_early_leaves_at_most_the_lookahead_computed() -> None:
    calls: list[int] = []
    schedule = EpsilonSchedule(lambda n: calls.append(n) or float(n))
    schedule.plan(1, 1000)
    assert schedule(1) == 1.0 and schedule(2) == 2.0
    for thread in threading.enumerate():
        if thread.name == "fedhog-epsilon-schedule":
            thread.join(5)
    assert len(calls) == len(set(calls)) and {1, 2} <= set(calls)  # each at most once
    assert max(calls) <= 2 + LOOKAHEAD  # nothing beyond the lookahead of the last value asked for


def test_a_failing_worker_hands_the_error_to_the_caller() -> None:
    def epsilon_after(n: int) -> float:
        if n == 2:
            raise ArithmeticError("composition failed at 2")
        return float(n)

    schedule = EpsilonSchedule(epsilon_after)
    schedule.plan(1, 4)
    assert schedule(1) == 1.0
    with pytest.raises(ArithmeticError, match="failed at 2"):
        schedule(2)
    assert schedule(3) == 3.0  # the worker stopped; the caller computes the rest


def test_one_worker_computes_a_run_of_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker waits for the next values instead of ending: the rounds start no thread each."""
    monkeypatch.setattr(schedule_module, "IDLE_SECONDS", 5.0)  # far longer than these rounds
    workers: list[threading.Thread] = []  # the threads themselves, kept: no two compare equal

    def epsilon_after(n: int) -> float:
        workers.append(threading.current_thread())
        return float(n)

    schedule = EpsilonSchedule(epsilon_after)
    schedule.plan(1, 30)
    assert [schedule(n) for n in range(1, 31)] == [float(n) for n in range(1, 31)]
    assert len(workers) == 30 and threading.current_thread() not in workers  # each once, none by the caller
    assert len(set(workers)) == 1
