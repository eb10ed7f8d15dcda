"""The client's promise: before each contribution, its release ledger (:mod:`.ledger`) and its operator's floors
(:mod:`.floors`).

A plain train message is one contribution: :meth:`ClientPromise.admit`, the
work, :meth:`ClientPromise.commit`, the reply. Under SecAgg+ the setup names
its round (the server sends the train instruction's config with every stage):
the setup is admitted, its round is kept in ``context.state`` for the
session, the collect stage must be for that round and is committed before the
masked vector leaves, and the unmask request is answered once a round.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from flwr.app import ConfigRecord, Context, Message

from .. import protocol
from ..replies import server_round_of
from .floors import NodeFloors, RunTerms
from .ledger import ReleaseLedger, RoundRefused

SESSION = "fedhog-secagg-session"  # context.state's record of the SecAgg+ session's round


def instruction_round(msg: Message) -> int:
    """The round a message's train instruction config names.

    Raises
    ------
    RoundRefused
        If the message carries no ``config`` record with an integer ``server-round``.
    """
    try:
        return server_round_of(msg)
    except (KeyError, ValueError) as error:
        raise RoundRefused(f"the message names no round ({error}); this client contributes only to a round it "
                           "can record") from None


@dataclass
class ClientPromise:
    """One node's ledger and floors for one message of run ``run`` (Flower's run id).

    ``terms(dimension)`` is what the run asks of the client (:class:`~.floors.RunTerms`); ``dimension`` is the
    model's, or None where the message carries no model (a SecAgg+ setup).
    """

    ledger: ReleaseLedger
    floors: NodeFloors
    run: int
    terms: Callable[[int | None], RunTerms]

    def admit(self, server_round: int, dimension: int | None) -> None:
        """Refuse a round the ledger or a floor forbids (:class:`RoundRefused`)."""
        terms = self.terms(dimension)
        self.ledger.check_round(self.run, server_round, terms.rounds)
        self.floors.check(terms, self.ledger)

    def commit(self, server_round: int, dimension: int) -> None:
        """Record the contribution to ``server_round`` (write-ahead: before its reply leaves)."""
        release = self.terms(dimension).release
        if release is None:
            raise RoundRefused("this client cannot say what its contribution releases")
        self.ledger.record(self.run, server_round, release)

    # --- SecAgg+ sessions ---------------------------------------------------------
    def open_session(self, msg: Message, context: Context) -> None:
        """A setup: admit its round and keep it as the session's."""
        server_round = instruction_round(msg)
        self.admit(server_round, None)
        context.state.config_records[SESSION] = ConfigRecord({protocol.SERVER_ROUND: server_round})

    def session_round(self, msg: Message, context: Context) -> int:
        """The session's round; refused if there is none, or the message names another."""
        record = context.state.config_records.get(SESSION)
        if record is None:
            raise RoundRefused("no SecAgg+ setup of this client names a round for this stage")
        server_round = int(record[protocol.SERVER_ROUND])  # type: ignore[arg-type]
        if "config" in msg.content.config_records and (asked := instruction_round(msg)) != server_round:
            raise RoundRefused(f"the stage asks for round {asked}; this client's SecAgg+ setup was for round "
                               f"{server_round}")
        return server_round

    def check_unmask(self, msg: Message, context: Context) -> int:
        """The session's round, refused if this client has already answered its unmask request."""
        server_round = self.session_round(msg, context)
        self.ledger.check_unmask(self.run, server_round)
        return server_round

    def commit_unmask(self, server_round: int) -> None:
        """Record the answered unmask request of ``server_round``."""
        self.ledger.record_unmask(self.run, server_round)
