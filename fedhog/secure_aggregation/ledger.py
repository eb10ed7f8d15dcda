"""A client's release ledger: what it has contributed, kept on its own disk, so that it keeps its own promise.

A server (or whoever submits a run) can ask a client for a round as often as
it likes: Flower lets the SecAgg+ setup restart at any time, and each
contribution carries fresh noise, so averaging R replays of one round divides
the noise's std by √R while the run's accountant counts one release. The
ledger refuses what the run's ε does not cover:

- a client contributes at most once per (run, round), and rounds only
  increase: a train message or a SecAgg+ setup for a round it has already
  contributed to (or an earlier one) is refused, as is a second unmask
  request for a round it has already helped to unmask;
- a round beyond the run's ``rounds`` is refused;
- every contribution is recorded (before its reply leaves) with what it
  releases as the client itself sees it (:class:`Release`), across all runs,
  so that an operator's ``max-epsilon`` floor (:mod:`.floors`) bounds the ε of
  everything this node ever released, whatever runs were submitted.

The run is Flower's (``context.run_id``): a resumed run is a new Flower run,
whose rounds this ledger serves again, and counts again in the node's ε.

One JSON file per node, ``<state dir>/release-ledger/partition-<id>.json``
(:func:`fedhog.client_state.state_dir`), written atomically; it holds round
numbers and public noise parameters only, nothing secret. The ledger keeps
the last :data:`MAX_RUNS` runs' rounds (older runs are over) and all releases.
A ledger that exists but cannot be read or does not parse is not guessed
around: every request is refused (:class:`LedgerUntrusted`) until the
operator restores it. A missing ledger is a new node's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..files import atomic_write
from ..privacy.distributed_gaussian import ORDERS, ddg_rdp
from ..privacy.sampler_slack import discrete_sampler_slack

LEDGER_DIR = "release-ledger"
VERSION = 1
MAX_RUNS = 1000


class RoundRefused(ValueError):
    """A client refuses a request: a round it has served, a setup weaker than it allows, a floor not met.

    ``str(error)`` is one line, without paths: it is what the server is told.
    """


class LedgerUntrusted(RoundRefused):
    """The release ledger exists but cannot be read: the client cannot know what it released, so it refuses."""


@dataclass(frozen=True)
class Release:
    """What one contribution releases, as the client itself accounts it (no amplification by sampling).

    ``mechanism`` is ``"gaussian"`` (the noise a trusted server adds, at the
    accountant's ``noise_multiplier``: its std over the sum's sensitivity),
    ``"ddg"`` (the distributed discrete Gaussian: the client's own share of std
    ``local_std`` lattice steps and m − 1 others', sensitivity ``l2`` steps in
    ``dimension`` coordinates, ``draws`` sampled values in the sum, whose
    sampler's slack :func:`epsilon_of` adds) or ``"none"`` (no noise: ε = ∞).
    """

    mechanism: str
    noise_multiplier: float = 0.0
    local_std: float = 0.0
    shares: int = 0
    l2: float = 0.0
    dimension: int = 0
    draws: int = 0

    def rdp(self) -> np.ndarray:
        """ε(α) of one such release at :data:`~fedhog.privacy.distributed_gaussian.ORDERS` (∞ without noise)."""
        alpha = np.asarray(ORDERS, dtype=np.float64)
        if self.mechanism == "gaussian" and self.noise_multiplier > 0:
            return alpha / (2 * self.noise_multiplier**2)
        if self.mechanism == "ddg":
            return ddg_rdp(self.local_std, self.shares, self.l2, self.dimension)
        return np.full(alpha.shape, math.inf)


def epsilon_of(releases: Iterable[tuple[Release, int]], delta: float) -> float:
    """ε at δ of ``releases`` (each release with its count) composed (RDP; 0 for none, ∞ if any has no noise), plus
    the slack of the clients' sampler on the draws in them
    (:func:`~fedhog.privacy.sampler_slack.discrete_sampler_slack`)."""
    total = np.zeros(len(ORDERS))
    draws = 0
    any_release = False
    for release, count in releases:
        if count:
            any_release = True
            total = total + count * release.rdp()
            draws += count * release.draws
    if not any_release:
        return 0.0
    if not np.isfinite(total).any():
        return math.inf
    # imported here: every deployed message is a fresh ClientApp process, which loads no accountant unless it accounts
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    return float(compute_epsilon(ORDERS, total, delta)[0]) + discrete_sampler_slack(draws, 1, 0.0, delta).epsilon


def ledger_path(directory: Path, partition_id: int) -> Path:
    """``<directory>/release-ledger/partition-<id>.json``."""
    if isinstance(partition_id, bool) or not isinstance(partition_id, int) or partition_id < 0:
        raise ValueError(f"partition-id={partition_id!r} is not allowed; expected an integer ≥ 0")
    return directory / LEDGER_DIR / f"partition-{partition_id}.json"


@dataclass
class _RunEntry:
    served: int = 0  # the last round contributed to
    unmasked: int = 0  # the last round whose unmask request was answered


class ReleaseLedger:
    """One node's ledger (see the module docstring); :meth:`load` it, check, then :meth:`record` before replying."""

    def __init__(self, path: Path, runs: dict[str, _RunEntry], releases: list[tuple[Release, int]]) -> None:
        self.path = path
        self._runs = runs
        self._releases = releases

    @classmethod
    def load(cls, path: Path) -> ReleaseLedger:
        """The ledger at ``path`` (empty if there is none yet).

        Raises
        ------
        LedgerUntrusted
            If the file exists but cannot be read, is not JSON, or is not a ledger of this version.
        """
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return cls(path, {}, [])
        except (OSError, UnicodeDecodeError) as error:
            raise LedgerUntrusted(f"this client's release ledger cannot be read ({type(error).__name__}); "
                                  "it refuses every round until its operator restores it") from None
        try:
            return cls(path, *_parse(json.loads(text)))
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise LedgerUntrusted(f"this client's release ledger is corrupt ({str(error).splitlines()[0][:80]}); "
                                  "it refuses every round until its operator restores it") from None

    def served(self, run: int) -> int:
        """The last round of ``run`` this client contributed to (0: none)."""
        return self._entry(run).served

    def check_round(self, run: int, server_round: int, rounds: int) -> None:
        """Refuse a round that is not a positive integer, beyond ``rounds``, or not after the last one served."""
        if isinstance(server_round, bool) or not isinstance(server_round, int) or server_round < 1:
            raise RoundRefused(f"round {server_round!r} is not a round number (an integer ≥ 1)")
        if server_round > rounds:
            raise RoundRefused(f"round {server_round} is beyond this run's rounds={rounds}")
        served = self.served(run)
        if server_round <= served:
            raise RoundRefused(f"round {server_round} asked for again: this client has contributed to round {served} "
                               "of this run, and contributes once a round, in increasing rounds")

    def check_unmask(self, run: int, server_round: int) -> None:
        """Refuse a second unmask request for a round this client has already helped to unmask."""
        unmasked = self._entry(run).unmasked
        if server_round <= unmasked:
            raise RoundRefused(f"unmask request for round {server_round} asked for again: this client has "
                               f"answered the unmask request of round {unmasked} of this run")

    def releases(self) -> list[tuple[Release, int]]:
        """Every release this node recorded, each with its count."""
        return list(self._releases)

    def epsilon(self, delta: float, extra: Release | None = None) -> float:
        """ε at δ of everything this node released (with ``extra`` one more release), its own accounting."""
        releases = self.releases() + ([(extra, 1)] if extra is not None else [])
        return epsilon_of(releases, delta)

    def record(self, run: int, server_round: int, release: Release) -> None:
        """Record a contribution to ``server_round`` of ``run`` and write the ledger (call before replying)."""
        self._entry(run).served = server_round
        for i, (known, count) in enumerate(self._releases):
            if known == release:
                self._releases[i] = (known, count + 1)
                break
        else:
            self._releases.append((release, 1))
        self._save()

    def record_unmask(self, run: int, server_round: int) -> None:
        """Record that this client answered the unmask request of ``server_round`` of ``run``; write the ledger."""
        self._entry(run).unmasked = server_round
        self._save()

    def _entry(self, run: int) -> _RunEntry:
        key = str(run)
        if key not in self._runs:
            self._runs[key] = _RunEntry()
            while len(self._runs) > MAX_RUNS:
                del self._runs[next(iter(self._runs))]
        return self._runs[key]

    def _save(self) -> None:
        document = {"version": VERSION,
                    "runs": {run: asdict(entry) for run, entry in self._runs.items()},
                    "releases": [{**asdict(release), "count": count} for release, count in self._releases]}
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        atomic_write(self.path, json.dumps(document).encode("utf-8"))


def _parse(document: Mapping[str, Any]) -> tuple[dict[str, _RunEntry], list[tuple[Release, int]]]:
    if document.get("version") != VERSION:
        raise ValueError(f"version {document.get('version')!r}, expected {VERSION}")
    runs = {}
    for run, entry in document["runs"].items():
        served, unmasked = entry["served"], entry["unmasked"]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (served, unmasked)):
            raise ValueError(f"run {run} has rounds {served!r}, {unmasked!r}")
        runs[str(run)] = _RunEntry(served, unmasked)
    releases = []
    for item in document["releases"]:
        count = item.pop("count")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"a release counted {count!r} times")
        release = Release(**item)
        if release.mechanism not in ("gaussian", "ddg", "none"):
            raise ValueError(f"a release of mechanism {release.mechanism!r}")
        releases.append((release, count))
    return runs, releases
