"""Accountants behind one interface: a registry by name, and each accountant describing itself."""

from __future__ import annotations

import inspect

import pytest
from flwr.supercore.privacy_accounting import GaussianPrivacyEvent

from fedhog import choices
from fedhog.privacy.accounting import (
    ACCOUNTANT_REGISTRY,
    Accountant,
    ClientLevelAccountant,
    new_backend,
    privacy_config,
)
from fedhog.privacy.distributed_gaussian import DdgAccounting, DistributedGaussianAccountant


def test_the_registry_offers_the_config_choices() -> None:
    assert tuple(ACCOUNTANT_REGISTRY) == choices.ACCOUNTANTS
    with pytest.raises(ValueError, match="accountant='prv' must be one of"):
        new_backend(privacy_config("poisson", 10_000, 1e-5), "prv")


@pytest.mark.parametrize("name,expected", [("rdp", 7.90), ("pld", 7.05)])
def test_each_registered_accountant_bounds_the_sampled_gaussian(name: str, expected: float) -> None:
    """σ = 1, q = 0.1, T = 100, δ = 1e-5: the figures dp_accounting gives (shared/notes/flower-1.42.md)."""
    accountant = new_backend(privacy_config("poisson", 10_000, 1e-5), name)
    accountant.compose(GaussianPrivacyEvent(noise_multiplier=1.0, sample_size=1000, population_size=10_000),
                       count=100)
    assert accountant.get_epsilon(1e-5) == pytest.approx(expected, abs=0.01)


def _distributed() -> DistributedGaussianAccountant:
    return DistributedGaussianAccountant(DdgAccounting(l2=800.0, dimension=1000, shares=16), 200.0, 1e-5,
                                         values_per_release=16 * 1000)


@pytest.mark.parametrize("make", [lambda: ClientLevelAccountant(1.0, "fixed", 0.1, 1000, 1e-5, accountant="rdp"),
                                  _distributed])
def test_each_accountant_has_the_whole_interface(make) -> None:
    accountant = make()
    members = {name for name, _ in inspect.getmembers(Accountant) if not name.startswith("_")}
    members |= set(Accountant.__annotations__)
    assert {name for name in members if not hasattr(accountant, name)} == set()
    for name in ("describe", "cover_sampler", "compose_round", "epsilon", "would_exceed"):
        assert (inspect.signature(getattr(accountant, name)).parameters.keys()
                == inspect.signature(getattr(Accountant, name)).parameters.keys() - {"self"}), name


def test_describe_says_what_the_start_up_log_said() -> None:
    """The line the strategy's summary printed from the event (its old format), now the accountant's own."""
    fixed = ClientLevelAccountant(1.0, "fixed", 0.1, 1000, 1e-5, accountant="pld")
    old = "accounting: %s, %s sampling, accountant σ=%g, expected cohort %d of %d, δ=%g" % (  # noqa: UP031 (its old format)
        fixed.method, fixed.sampling, fixed.event.noise_multiplier, fixed.event.sample_size,
        fixed.event.population_size, fixed.delta)
    assert fixed.describe() == old == ("accounting: rdp, fixed sampling, accountant σ=0.5, expected cohort 100 of "
                                       "1000, δ=1e-05")
    distributed = _distributed()
    assert distributed.describe() == f"distributed noise: each client adds N_Z(0, σ_l²); accounting: {distributed!r}"
    assert "ε = ∞" in ClientLevelAccountant(0.0, "poisson", 0.1, 1000, 1e-5).describe()


def test_only_the_server_noise_accountant_counts_the_sampler() -> None:
    """cover_sampler adds the lattice sampler's slack to a central accountant's ε, and nothing to the clients' (whose
    accountant counts their draws from its own plan)."""
    central = ClientLevelAccountant(1.0, "poisson", 0.1, 1000, 1e-5, accountant="rdp")
    covered = ClientLevelAccountant(1.0, "poisson", 0.1, 1000, 1e-5, accountant="rdp")
    covered.cover_sampler(2.0**10, 1000)  # a coarse lattice: a visible slack
    distributed, covered_distributed = _distributed(), _distributed()
    covered_distributed.cover_sampler(2.0**10, 1000)
    for accountant in (central, covered, distributed, covered_distributed):
        accountant.compose_round()
    assert covered.epsilon() > central.epsilon()
    assert covered_distributed.epsilon() == distributed.epsilon()
