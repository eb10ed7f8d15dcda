"""An in-process engine: the same ServerApp and ClientApp objects, no Ray, no SuperLink.

:class:`InProcessGrid` implements Flower's :class:`~flwr.serverapp.Grid` by
calling the ClientApp directly for every message, with one
:class:`~flwr.app.Context` per node as the Simulation Engine keeps them
(``partition-id``, ``num-partitions``), made when a node is first sent a
message (:class:`NodeContexts`). Messages are serialised and parsed on
the way in and out, as a transport would, so no object is shared between the
server and a client. A ClientApp that raises answers with an error reply, as
under Flower's engines.
"""

from __future__ import annotations

import random
import secrets
import traceback
import uuid
from collections.abc import Iterable, Iterator, Mapping, MutableMapping

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from fedhog.compat import stamp_message  # absolute: this module moves to fedhog/engines/


class NodeContexts(MutableMapping[int, Context]):
    """Node id -> its :class:`~flwr.app.Context`, each made when first asked for.

    A population of a million nodes holds the contexts of the nodes that were
    sent a message, not a million (the vectorized engine trains without them).
    """

    def __init__(self, partition_of_node: Mapping[int, int], run_config: Mapping, run_id: int = 1) -> None:
        self._partition_of_node = partition_of_node
        self.run_id = run_id
        self._run_config = dict(run_config)
        self._made: dict[int, Context] = {}

    def __getitem__(self, node_id: int) -> Context:
        context = self._made.get(node_id)
        if context is None:
            partition = self._partition_of_node[node_id]  # KeyError for a node that does not exist
            context = self._made[node_id] = Context(
                run_id=self.run_id, node_id=node_id, node_config={"partition-id": partition,
                                                        "num-partitions": len(self._partition_of_node)},
                state=RecordDict(), run_config=dict(self._run_config))
        return context

    def __setitem__(self, node_id: int, context: Context) -> None:
        if node_id not in self._partition_of_node:
            raise KeyError(f"no node {node_id} in this grid")
        self._made[node_id] = context

    def __delitem__(self, node_id: int) -> None:
        raise TypeError("a grid's nodes stay: their contexts cannot be deleted")

    def __iter__(self) -> Iterator[int]:
        return iter(self._partition_of_node)

    def __len__(self) -> int:
        return len(self._partition_of_node)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._partition_of_node


class InProcessGrid(Grid):
    """A Grid whose nodes are contexts in this process.

    Parameters
    ----------
    client_app : ClientApp
        The app every node runs.
    num_nodes : int
        How many nodes (partition ids 0..num_nodes-1).
    run_config : dict
        The run config every node's context carries.
    node_id_seed : int
        Node ids are random 63-bit integers, as on a SuperLink; the seed makes them repeatable.
    """

    def __init__(self, client_app: ClientApp, num_nodes: int, run_config: dict, node_id_seed: int = 0) -> None:
        self.client_app = client_app
        node_ids = random.Random(node_id_seed).sample(range(1, 2**63), num_nodes)
        self.partition_of_node = {node_id: i for i, node_id in enumerate(node_ids)}
        # a fresh run id, as a SuperLink gives each run: the clients' release ledgers serve each run's rounds once
        run_id = secrets.randbelow(2**63 - 1) + 1
        self.contexts = NodeContexts(self.partition_of_node, run_config, run_id)
        self._run = Run.create_empty(run_id)
        self._replies: dict[str, Message] = {}
        # Messages take their run and sender from the task identity, as in a ServerApp process.
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, self._run.run_id, SUPERLINK_NODE_ID

    def set_run(self, run: Run) -> None:
        """Set the run this grid serves."""
        self._run = run

    @property
    def run(self) -> Run:
        """The run this grid serves."""
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:
        """Create a message (kept for the Grid interface; prefer ``Message(...)``)."""
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        """All node ids."""
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Deliver each message to its node's ClientApp now; keep the reply."""
        ids = []
        for message in messages:
            message_id = self._stamp(message)
            self._replies[message_id] = self._transport(self._deliver(self._transport(message)))
            ids.append(message_id)
        return ids

    def _stamp(self, message: Message) -> str:
        """Give ``message`` a fresh id and this run, as the SuperLink does on push; return the id."""
        message_id = uuid.uuid4().hex
        stamp_message(message, message_id, self._run.run_id)
        return message_id

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Hand over (and forget) the replies to ``message_ids``."""
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Push and pull at once: every node answers before this returns."""
        return self.pull_messages(self.push_messages(messages))

    def _deliver(self, message: Message) -> Message:
        context = self.contexts.get(message.metadata.dst_node_id)
        if context is None:
            return Message(Error(ErrorCode.NODE_UNAVAILABLE, "no such node"), reply_to=message)
        try:
            return self.client_app(message, context)
        except Exception as error:  # pylint: disable=broad-except  # a client's fault is its reply
            reason = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=3)}"
            return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason), reply_to=message)

    @staticmethod
    def _transport(message: Message) -> Message:
        return message_from_proto(message_to_proto(message))


def run_in_process(server_app: ServerApp, client_app: ClientApp, num_nodes: int, run_config: dict) -> None:
    """Run ``server_app`` against ``num_nodes`` in-process nodes running ``client_app``."""
    grid = InProcessGrid(client_app, num_nodes, run_config)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=dict(run_config))
    server_app(grid, context)
