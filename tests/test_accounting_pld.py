"""PLD accounting against dp_accounting called directly, Opacus's PRV accountant, RDP and closed forms."""

import json
import math

import dp_accounting
import pytest
from dp_accounting import pld, rdp
from flwr.serverapp import RdpAccountant
from flwr.supercore.privacy_accounting import (
    GaussianPrivacyEvent,
    NeighboringRelation,
    PrivacyConfig,
    SamplingMethod,
)
from hypothesis import example, given, settings
from hypothesis import strategies as st
from scipy.stats import norm

import fedhog.privacy.pld as pld_module
from fedhog.privacy.accounting import (
    ACCOUNTANTS,
    PLD_VALUE_DISCRETIZATION_INTERVAL,
    ClientLevelAccountant,
)
from fedhog.privacy.pld import PldAccountant
from fedhog.privacy.self_composition import SelfComposition

N = 1000
DVI = 1e-3  # grid width for the fast checks; dp_accounting gets the same


def config(method=SamplingMethod.POISSON, delta=1e-5, population=N, max_epsilon=None):
    relation = (NeighboringRelation.REPLACE_ONE if method is SamplingMethod.WITHOUT_REPLACEMENT
                else NeighboringRelation.ADD_OR_REMOVE_ONE)
    return PrivacyConfig(delta, population, relation, method, max_epsilon)


def event(sigma, q, population=N):
    return GaussianPrivacyEvent(sigma, round(q * population), population)


def direct_pld(sigma, q, rounds, delta, interval=DVI):
    accountant = pld.PLDAccountant(value_discretization_interval=interval)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), rounds)
    return accountant.get_epsilon(delta)


def direct_rdp(sigma, q, rounds, delta):
    accountant = rdp.RdpAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), rounds)
    return accountant.get_epsilon(delta)


def prv_epsilon(sigma, q, rounds, delta):
    accountants = pytest.importorskip("opacus.accountants")
    accountant = accountants.PRVAccountant()
    for _ in range(rounds):
        accountant.step(noise_multiplier=sigma, sample_rate=q)
    return accountant.get_epsilon(delta)


GRID = [(sigma, q, rounds, delta)
        for sigma in (0.8, 2.0) for q in (0.01, 0.1) for rounds in (10, 300) for delta in (1e-5, 1e-7)]


@pytest.mark.parametrize("sigma, q, rounds, delta", GRID)
def test_pld_matches_dp_accounting(sigma, q, rounds, delta):
    accountant = PldAccountant(config(), value_discretization_interval=DVI)
    accountant.compose(event(sigma, q), rounds)
    assert accountant.num_releases == rounds
    assert accountant.get_epsilon(delta) == pytest.approx(direct_pld(sigma, q, rounds, delta), rel=1e-6)
    spent = accountant.get_privacy_spent(delta)
    assert (spent.num_releases, spent.accounting_method, spent.delta) == (rounds, "pld", delta)


@pytest.mark.parametrize("sigma, q, rounds", [(1.2, 0.03, 500), (2.0, 0.1, 300), (1.0, 0.05, 50), (3.0, 0.2, 100)])
def test_pld_agrees_with_opacus_prv(sigma, q, rounds):
    # at dp_accounting's default grid; PRV's own error (0.01 in ε) keeps to ε ≥ 2 for 1 %
    accountant = PldAccountant(config())
    accountant.compose(event(sigma, q), rounds)
    assert accountant.get_epsilon(1e-5) == pytest.approx(prv_epsilon(sigma, q, rounds, 1e-5), rel=0.01)


@settings(max_examples=15, deadline=None)
@given(sigma=st.floats(0.6, 5.0), q=st.sampled_from([0.001, 0.01, 0.1, 0.5, 1.0]),
       rounds=st.integers(1, 500), delta=st.sampled_from([1e-4, 1e-5, 1e-7]))
@example(sigma=5.0, q=0.001, rounds=500, delta=1e-4)
@pytest.mark.slow
def test_rdp_bounds_are_never_tighter_than_pld(sigma, q, rounds, delta):
    # at dp_accounting's default grid: the 1e-3 grid overstates tiny ε (σ = 5, q = 0.001,
    # T = 500: 0.017 against 0.0076) past RDP's 0.013
    pld_accountant = PldAccountant(config())
    rdp_accountant = RdpAccountant(config())
    for accountant in (pld_accountant, rdp_accountant):
        accountant.compose(event(sigma, q), rounds)
    assert rdp_accountant.get_epsilon(delta) >= pld_accountant.get_epsilon(delta)


@pytest.mark.parametrize("sigma, rounds, epsilon", [(1.0, 1, 1.0), (5.0, 100, 0.5), (30.0, 1000, 2.0)])
def test_no_amplification_is_the_analytic_gaussian(sigma, rounds, epsilon):
    # T Gaussian releases of sensitivity 1 = one Gaussian with σ/√T (Balle & Wang 2018, Thm 8)
    accountant = PldAccountant(config(SamplingMethod.NO_AMPLIFICATION))
    accountant.compose(event(sigma, 0.1), rounds)
    s = sigma / math.sqrt(rounds)
    exact = norm.cdf(1 / (2 * s) - epsilon * s) - math.exp(epsilon) * norm.cdf(-1 / (2 * s) - epsilon * s)
    delta = accountant.get_delta(epsilon)
    assert exact <= delta <= exact * 1.01  # pessimistic, and tight


@pytest.mark.parametrize("sigma, q, rounds, slack", [(5.0, 0.001, 1000, 0.02), (5.0, 0.01, 1000, 0.005),
                                                     (2.0, 0.1, 1000, 0.001)])
def test_runtime_grid_only_overstates_epsilon(sigma, q, rounds, slack):
    fine = direct_pld(sigma, q, rounds, 1e-5, interval=1e-4)
    coarse = direct_pld(sigma, q, rounds, 1e-5, interval=PLD_VALUE_DISCRETIZATION_INTERVAL)
    assert fine <= coarse <= fine + slack


# The published figures (/work/shared/notes/flower-1.42.md): σ, q, T, δ, RDP ε, PLD ε, PRV ε
PUBLISHED = [
    (1.0, 0.1, 100, 1e-5, 7.90, 7.05, 7.06),
    (1.0, 0.1, 1000, 1e-5, 27.16, 25.21, 25.22),
    (0.5, 0.01, 1000, 1e-5, 15.47, 13.36, 13.37),
]


@pytest.mark.parametrize("sigma, q, rounds, delta, rdp_eps, pld_eps, prv_eps", PUBLISHED)
def test_published_figures(sigma, q, rounds, delta, rdp_eps, pld_eps, prv_eps):
    rdp_accountant = RdpAccountant(config(delta=delta))
    rdp_accountant.compose(event(sigma, q), rounds)
    assert rdp_accountant.get_epsilon(delta) == pytest.approx(rdp_eps, rel=0.01)
    accountant = ClientLevelAccountant(sigma, "poisson", q, N, delta, accountant="pld")
    accountant.load_state_dict({"releases": rounds, "backend": {
        **accountant.state_dict()["backend"],
        "compositions": [{"event": vars(accountant.event), "count": rounds}]}})
    assert accountant.epsilon() == pytest.approx(pld_eps, rel=0.01)
    assert prv_epsilon(sigma, q, rounds, delta) == pytest.approx(prv_eps, rel=0.01)


def test_identical_events_build_their_pld_once_and_would_exceed_does_not_replay(monkeypatch):
    """The subsampled Gaussian's PLD (the costly part) is built once per event, however many rounds and
    projections follow; every ε still equals dp_accounting's PLDAccountant composing from scratch."""
    reference = direct_pld(1.0, 0.1, 1001, 1e-5)  # before counting: it builds and composes too
    builds, compositions = [], []
    real_build, real_self_compose = pld_module.pld_lib.from_gaussian_mechanism, SelfComposition.__call__

    def counting_build(*args, **kwargs):
        builds.append(kwargs.get("sampling_prob"))
        return real_build(*args, **kwargs)

    def counting_self_compose(self, count):
        compositions.append(count)
        return real_self_compose(self, count)

    monkeypatch.setattr(pld_module.pld_lib, "from_gaussian_mechanism", counting_build)
    monkeypatch.setattr(SelfComposition, "__call__", counting_self_compose)
    pld_module._subsampled_gaussian.cache_clear()
    accountant = PldAccountant(config(), value_discretization_interval=DVI)
    for _ in range(1000):
        accountant.compose(event(1.0, 0.1))
    first = accountant.get_epsilon(1e-5)
    assert builds == [0.1] and compositions == [1000]
    assert accountant.get_epsilon(1e-6) > first and compositions == [1000]  # cached backend
    assert not accountant.would_exceed(event(1.0, 0.1), max_epsilon=1e3)
    assert builds == [0.1] and compositions == [1000, 1001]
    accountant.compose(event(1.0, 0.1))
    assert accountant.get_epsilon(1e-5) == reference  # the same bits as dp_accounting composing from scratch
    assert compositions == [1000, 1001]  # the projection was the next committed state
    accountant.compose(event(1.0, 0.1))
    accountant.get_epsilon(1e-5)
    assert builds == [0.1]  # a later round composes the PLD built in round one
    pld_module._subsampled_gaussian.cache_clear()


def test_would_exceed_is_about_the_next_release_and_does_not_compose():
    accountant = PldAccountant(config(max_epsilon=100.0), value_discretization_interval=DVI)
    accountant.compose(event(1.0, 0.1), 5)
    now, nxt = accountant.get_epsilon(1e-5), direct_pld(1.0, 0.1, 6, 1e-5)
    assert accountant.would_exceed(event(1.0, 0.1), max_epsilon=nxt * 0.999)
    assert not accountant.would_exceed(event(1.0, 0.1), max_epsilon=nxt * 1.001)
    assert accountant.would_exceed(event(1.0, 0.1), max_epsilon=direct_pld(1.0, 0.1, 8, 1e-5) * 0.999, count=3)
    assert not accountant.would_exceed(event(1.0, 0.1))  # the config's max_epsilon
    assert accountant.num_releases == 5 and accountant.get_epsilon(1e-5) == now
    with pytest.raises(ValueError, match="max_epsilon"):
        PldAccountant(config()).would_exceed(event(1.0, 0.1))


def test_mixed_events_compose_as_dp_accounting_does():
    accountant = PldAccountant(config(), value_discretization_interval=DVI)
    accountant.compose(event(1.0, 0.1), 3)
    accountant.compose(event(2.0, 0.05), 2)
    accountant.compose(event(1.0, 0.1))
    direct = pld.PLDAccountant(value_discretization_interval=DVI)
    direct.compose(dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(1.0)), 4)
    direct.compose(dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(2.0)), 2)
    assert accountant.num_releases == 6
    assert accountant.get_epsilon(1e-5) == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)
    assert accountant.get_delta(1.0) == pytest.approx(direct.get_delta(1.0), rel=1e-9)


def test_state_dict_round_trip_and_resume():
    accountant = PldAccountant(config(), value_discretization_interval=DVI)
    accountant.compose(event(1.0, 0.1), 7)
    accountant.compose(event(2.0, 0.1))
    state = json.loads(json.dumps(accountant.state_dict()))
    assert state["schema_version"] == 1 and state["backend"] == "pld"
    restored = PldAccountant(config())  # the grid width comes from the state
    restored.load_state_dict(state)
    assert restored.value_discretization_interval == DVI
    assert restored.num_releases == 8
    assert restored.get_epsilon(1e-5) == accountant.get_epsilon(1e-5)
    for resumed in (accountant, restored):
        resumed.compose(event(1.0, 0.1), 2)
    assert restored.get_epsilon(1e-5) == accountant.get_epsilon(1e-5)
    assert restored.state_dict() == accountant.state_dict()


def test_load_state_dict_refuses_other_configurations_and_states():
    accountant = PldAccountant(config(), value_discretization_interval=DVI)
    accountant.compose(event(1.0, 0.1), 2)
    state = json.loads(json.dumps(accountant.state_dict()))
    for other in (config(delta=1e-6), config(population=999), config(SamplingMethod.NO_AMPLIFICATION)):
        with pytest.raises(ValueError, match="config"):
            PldAccountant(other).load_state_dict(state)
    with pytest.raises(ValueError, match="schema_version"):
        accountant.load_state_dict({**state, "schema_version": 2})
    rdp_accountant = RdpAccountant(config())
    with pytest.raises(ValueError, match="backend"):
        accountant.load_state_dict(rdp_accountant.state_dict())
    with pytest.raises(ValueError, match="different backend"):
        rdp_accountant.load_state_dict(state)
    with pytest.raises(ValueError, match="value_discretization_interval"):
        accountant.load_state_dict({**state, "value_discretization_interval": -1.0})
    assert accountant.num_releases == 2  # refused states leave the accountant as it was


def test_unsupported_combination_and_bad_events_are_refused():
    with pytest.raises(ValueError, match=r"without-replacement.*SampledWithoutReplacementDpEvent"):
        PldAccountant(config(SamplingMethod.WITHOUT_REPLACEMENT))
    # the reason: dp_accounting's PLD accountant does not support that event
    assert not pld.PLDAccountant(dp_accounting.NeighboringRelation.REPLACE_ONE).supports(
        dp_accounting.SampledWithoutReplacementDpEvent(N, 100, dp_accounting.GaussianDpEvent(1.0)))
    accountant = PldAccountant(config())
    with pytest.raises(ValueError, match="population_size=999"):
        accountant.compose(event(1.0, 0.1, population=999))
    with pytest.raises(ValueError, match="count"):
        accountant.compose(event(1.0, 0.1), 0)
    with pytest.raises(ValueError, match="value_discretization_interval"):
        PldAccountant(config(), value_discretization_interval=0.0)
    assert accountant.num_releases == 0 and accountant.get_epsilon(1e-5) == 0.0


# --- ClientLevelAccountant with PLD ------------------------------------------------


def test_client_level_pld_tracks_dp_accounting_round_by_round():
    sigma, q, rounds, delta = 1.0, 0.1, 12, 1e-5
    accountant = ClientLevelAccountant(sigma, "poisson", q, N, delta, accountant="pld")
    assert ACCOUNTANTS == ("pld", "rdp") and accountant.method == "pld"
    assert accountant.epsilon() == 0.0
    for t in range(1, rounds + 1):
        nxt = direct_pld(sigma, q, t, delta, PLD_VALUE_DISCRETIZATION_INTERVAL)
        assert accountant.would_exceed(nxt * 0.999) and not accountant.would_exceed(nxt * 1.001)
        accountant.compose_round()
        assert accountant.epsilon() == pytest.approx(nxt, rel=1e-9)
    assert accountant.epsilon() < direct_rdp(sigma, q, rounds, delta)


def test_client_level_fixed_sampling_falls_back_to_rdp():
    fallback = ClientLevelAccountant(2.0, "fixed", 0.1, N, 1e-5, accountant="pld")
    reference = ClientLevelAccountant(2.0, "fixed", 0.1, N, 1e-5, accountant="rdp")
    assert fallback.method == reference.method == "rdp"
    assert fallback.event.noise_multiplier == 1.0  # σ/2 under replace-one
    for accountant in (fallback, reference):
        accountant.compose_round()
    assert fallback.epsilon() == reference.epsilon()


@pytest.mark.parametrize("sampling", ["poisson", "fixed"])
def test_client_level_pld_without_guarantee_and_bad_accountant(sampling):
    accountant = ClientLevelAccountant(1.0, sampling, 0.1, 100, 1e-5, has_guarantee=False, accountant="pld")
    assert accountant.epsilon() == 0.0 and accountant.would_exceed(1e6)
    accountant.compose_round()
    assert accountant.epsilon() == math.inf
    with pytest.raises(ValueError, match="accountant='prv'"):
        ClientLevelAccountant(1.0, sampling, 0.1, 100, 1e-5, accountant="prv")


def test_client_level_pld_checkpoint_resumes_identically():
    accountant = ClientLevelAccountant(1.5, "poisson", 0.1, N, 1e-5, accountant="pld")
    for _ in range(3):
        accountant.compose_round()
    state = json.loads(json.dumps(accountant.state_dict()))
    restored = ClientLevelAccountant(1.5, "poisson", 0.1, N, 1e-5, accountant="pld")
    restored.load_state_dict(state)
    assert restored.epsilon() == accountant.epsilon()
    accountant.compose_round()
    restored.compose_round()
    assert restored.epsilon() == accountant.epsilon()
    with pytest.raises(ValueError, match="different backend"):  # an RDP checkpoint is not a PLD one
        ClientLevelAccountant(1.5, "poisson", 0.1, N, 1e-5, accountant="rdp").load_state_dict(state)
