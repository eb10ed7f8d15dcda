"""Operator floors: what a SuperNode's owner requires of every run, from ``node_config``, which no run overrides.

In a deployment ``context.run_config`` is the app bundle's defaults fused with
the run's overrides, both supplied by whoever submits the run; ``node_config``
(``flower-supernode --node-config '...'``) is the one thing the node's
operator sets. These keys set floors that each client enforces against every
run (:meth:`NodeFloors.check`), refusing with the floor and the value asked for:

``min-noise-multiplier``
    the run's noise multiplier (with ``noise = "distributed"`` the clients'
    own: √m·σ_l/Δ₂, which each client adds itself) must be at least this.
``max-epsilon``
    the ε of everything this node has released (its own accounting in the
    release ledger, :mod:`.ledger`, across all runs, no amplification by
    sampling) may not pass this; at ``max-epsilon-delta`` (default 1e-5).
``min-secagg-threshold``
    under secure aggregation, ``secagg-threshold`` must be at least this.
``require-secure-aggregation``
    ``true``: the client contributes only through SecAgg+.
``max-rounds``
    the run's ``rounds`` may not exceed this.

With a trusted server (no secure aggregation) the server sees each update in
the clear and adds the noise itself: the noise floors then refuse runs that
*ask* for too little, but only secure aggregation with distributed noise puts
the noise out of the server's hands (docs/specification/threat-model.md).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .ledger import Release, ReleaseLedger, RoundRefused

#: node config keys fedhog reads besides the floors
NODE_KEYS = ("partition-id", "num-partitions", "state-dir")
FLOOR_KEYS = ("min-noise-multiplier", "max-epsilon", "max-epsilon-delta", "min-secagg-threshold",
              "require-secure-aggregation", "max-rounds")
_FEDHOG_PREFIXES = ("min-", "max-", "require-", "secagg-")


class NodeConfigError(ValueError):
    """A node config value this client cannot run with: names the key, the value and what is allowed."""


@dataclass(frozen=True)
class RunTerms:
    """What a run asks of this client, from its run config, as :class:`NodeFloors` checks it.

    ``noise_multiplier`` and ``release`` are None where they cannot be known
    yet (a SecAgg+ setup carries no model, and distributed noise depends on its dimension).
    """

    rounds: int
    secure_aggregation: bool
    secagg_threshold: float
    seeded: bool  # a fixed privacy-seed: the noise can be recomputed from the config
    noise_multiplier: float | None = None
    release: Release | None = None


@dataclass(frozen=True)
class NodeFloors:
    """The floors of one node (see the module docstring); all off by default."""

    min_noise_multiplier: float = 0.0
    max_epsilon: float = math.inf
    max_epsilon_delta: float = 1e-5
    min_secagg_threshold: float = 0.0
    require_secure_aggregation: bool = False
    max_rounds: int = 0  # 0: no limit

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> NodeFloors:
        """The floors a node config sets, validated.

        Raises
        ------
        NodeConfigError
            For an unknown key that looks like one of fedhog's, or a value out of range, naming key, value and
            what is allowed.
        """
        known = NODE_KEYS + FLOOR_KEYS
        for key in node_config:
            if key in known:
                continue
            close = difflib.get_close_matches(key, known, n=2, cutoff=0.75)
            if close or key.startswith(_FEDHOG_PREFIXES):
                hint = f"did you mean {' or '.join(repr(c) for c in close)}?" if close else \
                    f"fedhog's floors are {', '.join(FLOOR_KEYS)}"
                raise NodeConfigError(f"unknown node config key '{key}' (value {node_config[key]!r}); {hint}")
        values: dict[str, Any] = {}
        get = node_config.get
        if "min-noise-multiplier" in node_config:
            values["min_noise_multiplier"] = _number("min-noise-multiplier", get("min-noise-multiplier"),
                                                     lambda v: math.isfinite(v) and v >= 0, "a finite number ≥ 0")
        if "max-epsilon" in node_config:
            values["max_epsilon"] = _number("max-epsilon", get("max-epsilon"), lambda v: v > 0,
                                            "a number > 0 (inf: no limit)")
        if "max-epsilon-delta" in node_config:
            values["max_epsilon_delta"] = _number("max-epsilon-delta", get("max-epsilon-delta"),
                                                  lambda v: 0 < v < 1, "a number in (0, 1)")
        if "min-secagg-threshold" in node_config:
            values["min_secagg_threshold"] = _number("min-secagg-threshold", get("min-secagg-threshold"),
                                                     lambda v: 0 <= v <= 1, "a number in [0, 1]")
        if "require-secure-aggregation" in node_config:
            value = get("require-secure-aggregation")
            if not isinstance(value, bool):
                raise NodeConfigError(f"node config require-secure-aggregation={value!r} is not allowed; "
                                      "expected true or false")
            values["require_secure_aggregation"] = value
        if "max-rounds" in node_config:
            value = get("max-rounds")
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise NodeConfigError(f"node config max-rounds={value!r} is not allowed; expected an integer ≥ 1")
            values["max_rounds"] = value
        return cls(**values)

    @property
    def limits_noise(self) -> bool:
        """Whether a floor asks for noise (then a seeded run is refused)."""
        return self.min_noise_multiplier > 0 or math.isfinite(self.max_epsilon)

    def check(self, run: RunTerms, ledger: ReleaseLedger) -> None:
        """Refuse ``run`` where it is below a floor, naming the floor and the value asked for.

        Raises
        ------
        RoundRefused
            With one line: ``<floor>=<value> (this node's floor): ...``.
        """
        if self.max_rounds and run.rounds > self.max_rounds:
            raise RoundRefused(f"max-rounds={self.max_rounds} (this node's floor): the run asks for "
                               f"rounds={run.rounds}")
        if self.require_secure_aggregation and not run.secure_aggregation:
            raise RoundRefused("require-secure-aggregation=true (this node's floor): the run asks for "
                               "secure-aggregation=\"off\"")
        if run.secure_aggregation and run.secagg_threshold < self.min_secagg_threshold:
            raise RoundRefused(f"min-secagg-threshold={self.min_secagg_threshold:g} (this node's floor): the run asks "
                               f"for secagg-threshold={run.secagg_threshold:g}")
        if self.limits_noise and run.seeded:
            raise RoundRefused("min-noise-multiplier/max-epsilon (this node's floors) need noise from OS entropy: "
                               "the run fixes privacy-seed, so anyone with its config can subtract the noise")
        if run.noise_multiplier is not None and run.noise_multiplier < self.min_noise_multiplier:
            raise RoundRefused(f"min-noise-multiplier={self.min_noise_multiplier:g} (this node's floor): the run asks "
                               f"for noise multiplier {run.noise_multiplier:.4g}")
        if run.release is not None and math.isfinite(self.max_epsilon):
            epsilon = ledger.epsilon(self.max_epsilon_delta, run.release)
            if epsilon > self.max_epsilon:
                contributions = sum(count for _, count in ledger.releases())
                raise RoundRefused(f"max-epsilon={self.max_epsilon:g} (this node's floor): one more contribution "
                                   f"would take this node's ε to {epsilon:.4g} at δ={self.max_epsilon_delta:g} "
                                   f"(its own accounting, after {contributions} contributions)")


def _number(key: str, value: object, allowed: Any, expected: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not allowed(float(value)):
        raise NodeConfigError(f"node config {key}={value!r} is not allowed; expected {expected}")
    return float(value)
