"""Correlated noise across rounds: banded matrix factorization (BandMF) of the prefix sums of the releases.

One module a job: :mod:`.strategies` (the banded lower-triangular Toeplitz strategies C), :mod:`.sensitivity`
(C's sensitivity under b-separated participation, computed from its columns), :mod:`.noise` (row t of C⁻¹Z,
streamed), :mod:`.release` (the exact lattice release r_t = round((C·S)_t) + z_t and the model's C⁻¹r),
:mod:`.accounting` (amplified BandMF's privacy event and its calibration) and :mod:`.planner` (the noise a model
accumulates for each number of bands, from public parameters, and the choice of b).
"""
