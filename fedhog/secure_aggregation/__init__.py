"""Secure aggregation (SecAgg+): the server learns only the sum of the cohort's clipped contributions.

:mod:`.quantization` (contributions as integers mod M), :mod:`.masking`
(masks from the keys Flower's key agreement derives) and
:mod:`.distributed_noise` (the clients' noise shares, ``noise = "distributed"``)
are the mathematics;
:mod:`.client` and :mod:`.server` drive Flower's SecAgg+ stages over the
Message API. Key agreement, Shamir sharing and encryption are Flower's
(``flwr.common.secure_aggregation``, ``flwr.supercore.primitives``).
"""
