"""What every run-config key means: ``fedhog keys`` prints them with their defaults.

One line a key; the README's Configuration table says the same at more length
(a test checks that every key of :class:`~fedhog.config.RunConfig` has its line here).
"""

MEANINGS: dict[str, str] = {
    'dataset': ('mnist1d, digits (scikit-learn), synthetic / synthetic:<α>,<β> (FedProx Synthetic(α, '
                'β)), synthetic-large / synthetic-large:<α>,<β> (the same, each client generated from its own '
                'stream when sampled: any population), hf:<id> (Hugging Face via flwr-datasets, needs '
                'network), or your table: csv:PATH, parquet:PATH, npz:PATH (see Your model, your data)'),
    'label-column': 'tables only: the column holding the label',
    'feature-columns': 'tables only: the feature columns, comma-separated (empty: all others)',
    'client-column': "tables only: the column naming each row's client (one client per value)",
    'metrics': 'comma-separated among accuracy, auroc, auprc (binary labels): evaluated on the test set every round',
    'num-samples': 'MNIST-1D examples to generate',
    'partitioner': ('iid, dirichlet, pathological (flwr-datasets partitioners; synthetic is '
                    'partitioned by construction)'),
    'dirichlet-alpha': 'α of the Dirichlet partitioner',
    'classes-per-client': 'k of the pathological partitioner',
    'validation-fraction': "share of each client's data held out for validation",
    'server-validation-fraction': ('share of all examples the server holds apart as its validation set'
                                   " (apart from every client and from the test set): every round's "
                                   'validation_accuracy in metrics.json; what tune in a sweep selects '
                                   'on'),
    'proxy-fraction': 'share of all examples the server holds apart as proxy data for a server-side step (server-step)',
    'population': 'N, number of clients (= SuperNodes)',
    'model': ('logreg, mlp, cnn1d, cnn2d (their activation: the activation key), or package.module:factory: '
              'your own, called as factory(input_shape=…, num_classes=…)'),
    'activation': ("the built-in models' activation: gelu (default), silu, softplus, relu, or tanh (the models "
                   'before this key; the noise saturates it under DP)'),
    'normalization': ("the built-in models' hidden layers: none (default), group (GroupNorm before each "
                      'activation: per example, DP-SGD-safe, unlike BatchNorm), ws (weight-standardised: '
                      "invariant to the weights' scale, which the DP noise inflates) or group-ws (both)"),
    'local-epochs': "local training: epochs over the client's data per round",
    'batch-size': 'local training: batch size',
    'learning-rate': "local training: the client's learning rate",
    'momentum': "local training: the client's momentum",
    'optimizer': ('sgd, or hog-step: each step along −∇L by the minimiser of the cubic model from the '
                  'first three directional derivatives, at most learning-rate (with momentum, '
                  'heavy-ball on that step)'),
    'device': ('auto (CUDA when present), cpu, cuda; fedhog run and deploy-local refuse cuda up front '
               "when this machine's torch sees no CUDA device"),
    'rounds': 'rounds to run (fewer if max-epsilon is reached)',
    'sampling': 'poisson or fixed',
    'sampling-rate': 'q; q·N must be a whole number',
    'server-learning-rate': 'η',
    'server-optimizer': ('how the server applies the release ū (post-processing, no privacy cost): sgd'
                         ' (θ + η·ū), momentum (FedAvgM), adam (FedAdam), yogi (FedYogi), with the '
                         "updates of Flower's own strategies; their moments go into checkpoints"),
    'server-momentum': "β₁: FedAvgM's momentum, Adam's and Yogi's first-moment decay",
    'server-beta2': "β₂: Adam's and Yogi's second-moment decay",
    'server-tau': "τ: Adam's and Yogi's adaptivity floor",
    'server-step': ("newton or cubic: take s times the server optimizer's step, s ∈ (0, "
                    'server-step-max] the minimiser of the quadratic (newton) or cubic (cubic) model '
                    "of the loss on the server's proxy data along that step (needs proxy-fraction > 0;"
                    ' post-processing, no privacy cost)'),
    'server-step-max': 'the largest s',
    'max-update-norm': ('replies whose update is longer are rejected as implausible (too large); a '
                        'sanity bound, not a privacy one'),
    'shards': ('the vectorized engine splits each cohort over this many workers: 1 trains in this process, '
               'more start Ray actors (a local Ray, or the cluster at RAY_ADDRESS); the release is the same '
               'bits for every count (see The vectorized engine)'),
    'round-timeout': ("seconds the server waits for a round's replies (and for discovery); a client "
                      'that has not answered by then counts as failed and the round goes on'),
    'aggregator': ("fedhog (SecureAggregator), or flower-dp: Flower's own "
                   'DifferentialPrivacyServerSideFixedClipping(FedAvg) with its RdpAccountant (no '
                   'amplification), a baseline for comparisons; it needs mechanism = "gaussian", '
                   'sampling = "fixed", accountant = "rdp" and writes no checkpoints (see the '
                   'comparison)'),
    'mechanism': 'none, gaussian, hog',
    'clipping-norm': 'C',
    'noise-multiplier': 'σ (noise std on the sum is σ·C)',
    'target-epsilon': ('-1: no calibration (σ is noise-multiplier); > 0: calibrate σ at the start of the run to '
                       'the smallest that keeps ε ≤ this '
                       'after rounds rounds (printed, and saved in metrics.json). Setting it and '
                       'noise-multiplier in one place (the file, or the --sets) is refused; a --set of'
                       " one replaces the file's other, and fedhog prints a note saying which value it"
                       ' dropped'),
    'mixing-strength': 'γ',
    'hog-mixing': ('random-sign (default: u = Δ + γξ(‖Δ‖/‖t‖)t, ξ ~ N(0, 1), DP-FedAvg in expectation) or '
                   "noise-aware: u = Δ − λ·½κτ²·ĝ, ĝ the client's Hutchinson estimate of ∇tr∇²L, τ the noise "
                   "the release leaves in the weights, λ its local step scale (see the mechanism specification)"),
    'noise-aware-strength': 'κ of hog-mixing = noise-aware (1: descend exactly the smoothed loss ½τ²tr∇²L)',
    'noise-aware-samples': ("Hutchinson's Rademacher directions in each client's ∇tr∇²L estimate "
                            '(hog-mixing = noise-aware)'),
    'adaptive-clipping': 'track a quantile of the norms; clipping-norm is then the initial C',
    'target-quantile': 'adaptive clipping: γ_q, the quantile of the norms C tracks',
    'clipping-learning-rate': 'adaptive clipping: η_C, the step of C',
    'count-noise-std': 'adaptive clipping: σ_b, the noise on the count of unclipped norms (-1: expected cohort / 20)',
    'hog-direction': 'random or update',
    'hog-term': ('third-order, or random: the control that mixes an isotropic random direction instead'
                 ' (same γ, same scaling), to tell whether the third-order structure matters'),
    'hog-batch-size': 'local examples the third-order term is computed on',
    'accountant': "pld (privacy loss distributions) or rdp (Flower's RdpAccountant); fixed sampling always uses RDP",
    'delta': 'δ; must be below 1/population',
    'client-dp': 'none or dpsgd (sample-level DP-SGD on each client, Opacus)',
    'dpsgd-noise-multiplier': "DP-SGD's σ",
    'dpsgd-max-grad-norm': "DP-SGD's per-example clipping norm",
    'dpsgd-delta': "DP-SGD's δ",
    'dpsgd-accountant': "DP-SGD's Opacus accountant: prv or rdp",
    'dpsgd-noise': ("fedhog: batches and lattice noise from the client's own OS entropy (or "
                    "privacy-seed); opacus-secure: Opacus' secure mode (needs torchcsprng)"),
    'max-epsilon': 'stop before a release that would exceed it',
    'secure-aggregation': ('off (trusted server) or secagg+: clients mix, clip, quantise and mask '
                           'their own contribution; the server unmasks only the sum (see Secure '
                           'aggregation)'),
    'secagg-num-shares': ('k, the neighbours a client shares its secrets with: 0 = the whole cohort '
                          '(SecAgg), ≥ 3 = a ring of k (SecAgg+, made odd)'),
    'secagg-threshold': 't = max(2, ⌈this·k⌉) shares reconstruct a secret; up to k − t of a neighbourhood may drop out',
    'secagg-modulus-bits': ('b: arithmetic mod 2^b (16..62; residues travel as uint32 up to 32 bits); '
                            'must leave ≥ 2 levels per client for the largest cohort (and, with '
                            'distributed noise, its noise)'),
    'noise': ('central: the server noises the sum; distributed (secagg+ only): each client adds its '
              'share of discrete Gaussian noise before masking and the server never sees an un-noised '
              'sum (see Distributed noise)'),
    'seed': 'data, partition, model initialisation, client shuffling and directions',
    'privacy-seed': ('-1: fresh 256-bit OS keys every round (ChaCha20), nothing to save or steal; ≥ 0:'
                     ' repeatable cohorts, ξ and noise, predictable to anyone with the seed '
                     '(experiments only, warned)'),
    'results-dir': ('results folder; empty: results/<timestamp> under the working directory; a folder '
                    'that holds a run or other files is refused (see Results)'),
    'resume': 'continue from checkpoint.pt in results-dir (what fedhog run --resume sets)',
    'metrics-port': ('-1: no HTTP endpoint; 0: any free port; else that port, on 127.0.0.1 (refused up'
                     ' front when it is taken)'),
}
