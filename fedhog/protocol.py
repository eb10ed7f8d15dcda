"""What the server sends a client and what a client replies: the keys both sides use.

A train instruction carries the global model under ``"arrays"`` and a
ConfigRecord under ``"config"`` with :data:`SERVER_ROUND` and :data:`JOB_ID`.
A reply carries the update Δ under :data:`UPDATE`, with ``hog`` the
third-order term under :data:`TERM` (both keyed like the global model), and a
MetricRecord under :data:`METRICS`. Under DP-SGD the reply carries no record
counts (:data:`NUM_EXAMPLES`, local step counts): the record-level ε does not
cover them, so the server weighs such clients equally.

A standard Flower ClientApp replies the other way, as Flower's examples do:
its trained weights under :data:`WEIGHTS` and :data:`NUM_EXAMPLES` in a
MetricRecord. With a trusted server, SecureAggregator reads such a reply as the
update weights − global model of the round; under secure aggregation it is
refused (the server must never see a client's own model).
"""

# records of a train reply
UPDATE = "update"
TERM = "third-order-term"
METRICS = "metrics"
WEIGHTS = "arrays"  # Flower's convention (its examples' ClientApps): the trained weights, not the update

# the train instruction's config
SERVER_ROUND = "server-round"
JOB_ID = "job-id"  # the training job's name, the same across resumes

# metrics of a reply
PARTITION_ID = "partition-id"
NUM_EXAMPLES = "num-examples"
THIRD_ORDER_FINITE = "third-order-finite"

# secure aggregation (SecAgg+): a collect-stage reply carries only the masked vector, mod 2^bits
MASKED = "masked-contribution"
