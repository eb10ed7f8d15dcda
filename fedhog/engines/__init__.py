"""The engines that run fedhog's ServerApp and ClientApp on one machine.

:mod:`~fedhog.engines.inprocess` (a Flower Grid in this process),
:mod:`~fedhog.engines.vectorized` (that Grid training each cohort as one
batch, with :mod:`~fedhog.engines.cohort`) and
:mod:`~fedhog.engines.simulation` (Flower's Simulation Engine, Ray).
"""
