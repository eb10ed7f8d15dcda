"""Seconds per round and peak memory of fedhog's engines, side by side in one run.

The workload of issue 11: MNIST-1D, 1 000 clients of about 20 examples
(Dirichlet 0.5), Poisson sampling q = 0.1 (cohorts of 100), one local epoch of
batch 10, DP-FedAvg with σ = 1.675 or HOG mixing with γ = 0.5, an MLP or the
1-D CNN. Every configuration runs in a fresh process (so its peak RSS is its
own) on:

- ``inprocess``: the Flower apps, one message per client (:mod:`fedhog.engines.inprocess`);
- ``vectorized``: the cohort as one batch (:mod:`fedhog.engines.vectorized`);
- ``simulation`` (``--full`` only): Flower's Simulation Engine through ``fedhog run``.

An extra pair of rows runs the MLP with ``accountant = "rdp"``: the PLD
accountant's ε after every round (≈ 3.5 ms at 100 rounds, 10–35 ms before it was memoised) is the
same work on every engine, so those rows show what the engines themselves cost.
The figure is the median of rounds 2..T of each run's own per-round
``seconds`` in ``metrics.json`` (sampling to evaluation, results written);
the vectorized rows also give the all-in time (every round's ``seconds``
over the rounds) and its ratio to the time the cohort's training
(``CohortTrainer.train``) and the mechanism (``finish_replies``: reply
validation, clipping, noise, aggregation) took.
Every row runs the default activation (``fedhog.models.DEFAULT_ACTIVATION``);
``--activations`` instead times what an activation changes in a vectorized
round — the cohort's local training and its third-order terms — for the MLP
and the CNN per activation, interleaved, against tanh's (fedhog's models
before the activation became a choice): a smooth activation must not make the
round or the HOG term much slower. ``--normalizations`` adds each activation
with those normalisations (``fedhog.models.NORMALIZATIONS``; weight
standardisation and GroupNorm are extra work in every layer), still against
tanh without normalisation. Its last column sets the cohort's work against
one vmapped gradient of every client on the examples its term is computed on
(the first ``hog-batch-size`` of its first epoch): the training (one epoch)
and the term alone (HOG's cohort less the DP-FedAvg one) in such gradients.
The vectorized engine also runs populations of 10 000 and 100 000 clients
with cohorts of 100 (IID, about 20 examples each: MNIST-1D is generated
once and cached, which takes minutes for 100 000 clients), and a long run of
500 rounds whose RSS is sampled every 50 rounds (it must stay flat).
Every row says its ``shards`` (:mod:`fedhog.engines.shards`): the MLP's
DP-FedAvg row runs again with ``shards = 2`` (two Ray actors, started
before round 1 and so in no round's time); its peak RSS is that of the
driver and its actors together (sampled every 0.2 s). And
a population of 1 000 000 clients (``synthetic-large``: each client's data
generated when it is sampled) runs 3 rounds with cohorts of 10 000.
``--device`` sets every row's ``device`` (default ``auto``: CUDA when present).
``--scaling cuda cpu`` instead runs only the vectorized engine on
``synthetic-large`` for populations of 10³ to 10⁶ (cohorts of a tenth, at most
10 000), the MLP and the CNN, DP-FedAvg and HOG, on each device named: the
seconds a round and, on CUDA, the peak GPU memory
(``torch.cuda.max_memory_allocated``); one process per device and population,
CUDA's first, and the rows that ``--budget`` seconds leave no time for are
listed as skipped (``simulations/gpu/check.sh``).

Usage::

    python simulations/bench_rounds.py            # Markdown tables
    python simulations/bench_rounds.py --json     # {"rows": [...], "rss_over_rounds": [...]}
    python simulations/bench_rounds.py --quick    # fewer rounds, population 1 000 only
    python simulations/bench_rounds.py --full     # adds Flower's Simulation Engine
    python simulations/bench_rounds.py --core --repeat 3  # the engine rows only, 3 passes round-robin
    python simulations/bench_rounds.py --activations [gelu silu] [--quick]  # the round per activation vs tanh
    python simulations/bench_rounds.py --activations gelu --normalizations none ws group-ws --quick
    python simulations/bench_rounds.py --scaling cuda cpu --json --budget 170  # CUDA against CPU, 10³ to 10⁶ clients
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKLOAD = {"dataset": "mnist1d", "num-samples": 32_000, "population": 1000, "sampling-rate": 0.1,
            "partitioner": "dirichlet", "local-epochs": 1, "batch-size": 10, "learning-rate": 0.05,
            "noise-multiplier": 1.675, "mixing-strength": 0.5, "clipping-norm": 1.0, "privacy-seed": 1}
EXAMPLES_PER_CLIENT = 32  # num-samples per client: 20% test, 10% validation, about 22 to train
MILLION = 1_000_000  # synthetic-large; OS-entropy sampling: discovery asks no client its partition


def run_one(spec: dict) -> dict:
    """Run one configuration in this process; return its measures (called in a child process)."""
    import torch

    from fedhog import results
    from fedhog.client_app import app as client_app
    from fedhog.config import RunConfig
    from fedhog.engines import shards as shards_module
    from fedhog.engines.cohort import CohortTrainer
    from fedhog.engines.inprocess import run_in_process
    from fedhog.engines.vectorized import run_vectorized
    from fedhog.server_app import app as server_app
    from fedhog.strategy import SecureAggregator

    torch.set_num_threads(spec["threads"])
    config = RunConfig().with_overrides(spec["config"])
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    rss: list[tuple[int, float]] = []
    add_round = results.ResultsWriter.add_round

    def recording(writer, record):  # RSS after every round, for the long run
        add_round(writer, record)
        rss.append((record.round, _rss_mib()))

    results.ResultsWriter.add_round = recording
    work = {"training": 0.0, "mechanism": 0.0}  # the clients' local work; the server's validation, clipping, noise
    _timed(CohortTrainer, "train", work, "training")
    _timed(SecureAggregator, "finish_replies", work, "mechanism")  # the in-process engines' round end
    _timed(SecureAggregator, "finish_reduced", work, "mechanism")  # the vectorized engine's, and its shards' half:
    _timed(shards_module, "reduce_results", work, "mechanism")  # checked, clipped, summed (in this process: shards 1)
    with ShardsRss() as shards_rss:
        if spec["engine"] == "vectorized":
            run_vectorized(server_app, client_app, config)
        else:
            run_in_process(server_app, client_app, config.population, config.to_mapping())
    document = json.loads((Path(config.results_dir) / "metrics.json").read_text())
    every = [r["seconds"] for r in document["rounds"]]
    peak = _peak_rss_mib() if config.shards == 1 else shards_rss.peak_mib
    in_process = work["training"] and config.shards == 1  # Ray actors' work is not timed here
    return {"seconds_per_round": statistics.median(every[1:]), "all_in_seconds_per_round": sum(every) / len(every),
            "all_in_over_training_and_mechanism": (sum(every) / (work["training"] + work["mechanism"])
                                                   if in_process else None),  # vectorized: the cohort's work
            "peak_rss_mib": peak, "rss": rss,
            "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None}


def _timed(owner: object, name: str, totals: dict[str, float], key: str) -> None:
    """Add the seconds every call of ``owner.name`` (a class's method or a module's function) takes to
    ``totals[key]``."""
    method = getattr(owner, name)

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - started

    setattr(owner, name, timed)


class ShardsRss:
    """The peak of this process's RSS plus that of its Ray shard actors (``ray::CohortShard`` processes), sampled."""

    def __init__(self, every: float = 0.2) -> None:
        import threading

        self.every, self.peak_mib = every, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> ShardsRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(self.every):
            total = _rss_mib()
            for proc in Path("/proc").glob("[0-9]*"):
                try:
                    if (proc / "cmdline").read_bytes().startswith(b"ray::CohortShard"):
                        total += _rss_mib(proc / "statm")
                except OSError:  # a process that ended meanwhile
                    pass
            self.peak_mib = max(self.peak_mib, total)


def _rss_mib(statm: Path | str = "/proc/self/statm") -> float:
    with open(statm) as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(engine: str, overrides: dict, rounds: int, threads: int, workdir: Path) -> dict:
    """One configuration in a fresh process (or Flower's Simulation Engine through the CLI)."""
    config = {**WORKLOAD, **overrides, "rounds": rounds, "results-dir": str(workdir / f"{time.time_ns()}")}
    if engine == "simulation":
        return _measure_simulation(config)
    spec = json.dumps({"engine": engine, "config": config, "threads": threads})
    done = subprocess.run([sys.executable, __file__, "--one", spec], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{engine} {overrides} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _measure_simulation(config: dict) -> dict:
    args = [sys.executable, "-m", "fedhog.cli", "run", "--engine", "simulation"]
    for key, value in config.items():
        args += ["--set", f"{key}={json.dumps(value)}"]
    started = time.perf_counter()
    subprocess.run(args, check=True, capture_output=True, env={**os.environ,
                                                               "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"})
    document = json.loads((Path(config["results-dir"]) / "metrics.json").read_text())
    seconds = [r["seconds"] for r in document["rounds"][1:]]
    return {"seconds_per_round": statistics.median(seconds), "peak_rss_mib": float("nan"), "rss": [],
            "wall_seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    parser.add_argument("--quick", action="store_true", help="fewer rounds, population 1 000 only")
    parser.add_argument("--full", action="store_true", help="also Flower's Simulation Engine")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each run (default 1)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="passes over the engine rows, round-robin (a row's figure: the median of its passes; "
                        "ratios: each pass's), so a drift of the machine's load falls on every row alike")
    parser.add_argument("--core", action="store_true", help="the engine rows only (model x mechanism x engine)")
    parser.add_argument("--activations", nargs="*", metavar="NAME",
                        help="only the vectorized rows, once per activation (all when none is named; tanh always), "
                        "each against tanh's")
    parser.add_argument("--normalizations", nargs="+", default=["none"], metavar="NAME",
                        help="with --activations: each activation with each of these normalizations (default none)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="every row's device (default auto: CUDA when present)")
    parser.add_argument("--scaling", nargs="+", metavar="DEVICE", choices=("cpu", "cuda"),
                        help="only the vectorized engine, populations 10^3..10^6, on each of these devices")
    parser.add_argument("--budget", type=float, default=float("inf"),
                        help="with --scaling: seconds for all rows; those left without time are listed as skipped")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--scaling-one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return
    if args.scaling_one:
        scaling_one(json.loads(args.scaling_one))
        return
    WORKLOAD["device"] = args.device
    if args.scaling:
        scaling_table(args.scaling, args.quick, args.threads, args.budget, args.json)
        return
    rounds = 6 if args.quick else 20
    if args.activations is not None:
        activation_table(rounds, args.threads, args.json, args.activations, args.normalizations, args.device)
        return
    engines = ["inprocess", "vectorized"] + (["simulation"] if args.full else [])
    rows = []
    with tempfile.TemporaryDirectory(prefix="fedhog-bench-") as work:
        workdir = Path(work)
        passes: list[list[dict]] = []
        for _ in range(args.repeat):
            passes.append([])
            for model in ("mlp", "cnn1d"):
                for mechanism in ("gaussian", "hog"):
                    for engine in engines:
                        result = measure(engine, {"model": model, "mechanism": mechanism}, rounds, args.threads,
                                         workdir)
                        passes[-1].append({"engine": engine, "model": model, "mechanism": mechanism,
                                           "population": 1000, "cohort": 100, "shards": 1,
                                           "seconds_per_round": result["seconds_per_round"],
                                           "all_in_seconds_per_round": result.get("all_in_seconds_per_round"),
                                           "all_in_over_training_and_mechanism":
                                               result.get("all_in_over_training_and_mechanism"),
                                           "peak_rss_mib": result["peak_rss_mib"]})
                        _progress(passes[-1][-1], args.json)
        rows += _median_rows(passes)
        for engine in () if args.core else engines[:2]:  # the MLP round with RDP: the engines without PLD's ε
            result = measure(engine, {"model": "mlp", "mechanism": "gaussian", "accountant": "rdp"}, rounds,
                             args.threads, workdir)
            rows.append({"engine": engine, "model": "mlp", "mechanism": "gaussian (rdp)", "population": 1000,
                         "cohort": 100, "shards": 1, "seconds_per_round": result["seconds_per_round"],
                         "peak_rss_mib": result["peak_rss_mib"]})
            _progress(rows[-1], args.json)
        for shards in () if args.core else (2,):  # the cohorts split over Ray actors (2 cores: not faster)
            result = measure("vectorized", {"model": "mlp", "mechanism": "gaussian", "shards": shards}, rounds,
                             args.threads, workdir)
            rows.append({"engine": "vectorized", "model": "mlp", "mechanism": "gaussian", "population": 1000,
                         "cohort": 100, "shards": shards, "seconds_per_round": result["seconds_per_round"],
                         "peak_rss_mib": result["peak_rss_mib"]})
            _progress(rows[-1], args.json)
        for population in () if args.quick or args.core else (10_000, 100_000):
            scale = {"model": "mlp", "mechanism": "gaussian", "population": population, "partitioner": "iid",
                     "sampling-rate": 100 / population, "num-samples": EXAMPLES_PER_CLIENT * population,
                     "delta": 0.1 / population}  # δ must stay below 1/N
            result = measure("vectorized", scale, rounds, args.threads, workdir)
            rows.append({"engine": "vectorized", "model": "mlp", "mechanism": "gaussian", "population": population,
                         "cohort": 100, "shards": 1, "seconds_per_round": result["seconds_per_round"],
                         "peak_rss_mib": result["peak_rss_mib"]})
            _progress(rows[-1], args.json)
        for population, cohort in () if args.quick or args.core else ((MILLION, MILLION // 100),):
            million = {"dataset": "synthetic-large", "model": "mlp", "mechanism": "gaussian", "population": population,
                       "sampling-rate": cohort / population, "delta": 0.1 / population, "privacy-seed": -1}
            result = measure("vectorized", million, 3, args.threads, workdir)
            rows.append({"engine": "vectorized", "model": "mlp", "mechanism": "gaussian", "population": population,
                         "cohort": cohort, "shards": 1, "seconds_per_round": result["seconds_per_round"],
                         "peak_rss_mib": result["peak_rss_mib"]})
            _progress(rows[-1], args.json)
        long_rounds = 60 if args.quick else 500
        rss_over_rounds = []
        if not args.core:
            long = measure("vectorized", {"model": "mlp", "mechanism": "gaussian"}, long_rounds, args.threads, workdir)
            rss_over_rounds = [{"round": r, "rss_mib": m} for r, m in long["rss"] if r % (long_rounds // 10) == 0]
    if args.json:
        print(json.dumps({"rows": rows, "passes": passes, "rss_over_rounds": rss_over_rounds}, indent=2))
        return
    print(f"torch threads per run: {args.threads}; median of rounds 2..{rounds}"
          + (f"; engine rows: median of {args.repeat} passes, round-robin" if args.repeat > 1 else "") + "\n")
    print("| engine | model | mechanism | population | cohort | shards | ms / round | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['engine']} | {row['model']} | {row['mechanism']} | {row['population']:,} | {row['cohort']:,} "
              f"| {row['shards']} | {row['seconds_per_round'] * 1e3:.1f} | {row['peak_rss_mib']:.0f} |")
    print("\nall-in (every round's seconds, writes included, over the rounds) ÷ (cohort training + mechanism), "
          "vectorized:")
    for row in rows[:len(engines) * 4]:
        if row.get("all_in_over_training_and_mechanism"):
            print(f"- {row['model']} {row['mechanism']}: {row['all_in_seconds_per_round'] * 1e3:.1f} ms all-in, "
                  f"{row['all_in_over_training_and_mechanism']:.2f}×")
    print("\nspeed-up of the vectorized engine over inprocess (same model and mechanism; each pass's):")
    for model, mechanism in (("mlp", "gaussian"), ("mlp", "hog"), ("cnn1d", "gaussian"), ("cnn1d", "hog"),
                             ("mlp", "gaussian (rdp)")):
        ratios = [_pick(rows_of, "engine", model=model, mechanism=mechanism)
                  for rows_of in ([rows] if mechanism.endswith("(rdp)") else passes)]
        if all("inprocess" in pick for pick in ratios):
            print(f"- {model} {mechanism}: " + ", ".join(f"{p['inprocess'] / p['vectorized']:.1f}×" for p in ratios))
    for model in ("mlp", "cnn1d"):
        ratios = [_pick(rows_of, "mechanism", model=model, engine="vectorized") for rows_of in passes]
        print(f"- vectorized {model}: a hog round costs "
              + ", ".join(f"{p['hog'] / p['gaussian']:.2f}×" for p in ratios) + " a gaussian round")
    if rss_over_rounds:
        print(f"\nRSS of one vectorized run over {long_rounds} rounds (MiB): "
              + ", ".join(f"round {p['round']}: {p['rss_mib']:.0f}" for p in rss_over_rounds))


def _median_rows(passes: list[list[dict]]) -> list[dict]:
    """One row per configuration: the first pass's row with the medians of its passes' figures."""
    rows = []
    for k, first in enumerate(passes[0]):
        row = dict(first)
        for key in ("seconds_per_round", "all_in_seconds_per_round", "all_in_over_training_and_mechanism",
                    "peak_rss_mib"):
            values = [p[k][key] for p in passes if p[k].get(key) is not None]
            row[key] = statistics.median(values) if values else None
        rows.append(row)
    return rows


def _pick(rows: list[dict], by: str, **where: str) -> dict[str, float]:
    """``seconds_per_round`` of the population-1000, one-shard rows matching ``where``, keyed by their ``by``."""
    return {r[by]: r["seconds_per_round"] for r in rows
            if all(r[k] == v for k, v in where.items()) and r["population"] == 1000 and r["shards"] == 1}


def activation_table(rounds: int, threads: int, quiet: bool, names: list[str], normalizations: list[str],
                     device: str = "auto") -> None:
    """The cohort's local work (gaussian) and with the HOG term, per activation and normalisation, against tanh's.

    What an activation changes in a vectorized round is the cohort's training and, with HOG, its third-order
    terms (:class:`fedhog.engines.cohort.CohortTrainer`); the rest of a round (sampling, clipping, noise, accounting,
    evaluation) does not depend on it. So this times exactly that, in this process, the activations
    interleaved (``rounds`` repetitions, round-robin, medians), so that load from other processes on a
    shared machine falls on every activation alike.
    """
    import torch

    from fedhog.config import RunConfig
    from fedhog.data import dataset_info, population_training_data
    from fedhog.engines.cohort import CohortTrainer, HogSettings
    from fedhog.models import ACTIVATIONS, NORMALIZATIONS, build_model
    from fedhog.training import direction_seed, hog_rows, select_device

    unknown = set(names) - set(ACTIVATIONS)
    if unknown:
        raise SystemExit(f"--activations: {sorted(unknown)} not allowed; expected names among {list(ACTIVATIONS)}")
    if set(normalizations) - set(NORMALIZATIONS):
        raise SystemExit(f"--normalizations: {sorted(set(normalizations) - set(NORMALIZATIONS))} not allowed; "
                         f"expected names among {list(NORMALIZATIONS)}")
    chosen = [("tanh", "none"), *((name, norm) for name in (names or ACTIVATIONS) for norm in normalizations
                                  if (name, norm) != ("tanh", "none"))]
    torch.set_num_threads(threads)
    config = RunConfig().with_overrides({k: v for k, v in WORKLOAD.items() if k != "noise-multiplier"})
    x, y, indices = population_training_data(config.data_spec)
    cohort = list(range(100))
    seeds = [direction_seed(config.seed, 1, p) for p in cohort]
    term_rows = [indices[p][hog_rows(len(indices[p]), 32, s)] for p, s in zip(cohort, seeds, strict=True)]
    width = max(len(rows) for rows in term_rows)
    rows_index = torch.zeros(len(cohort), width, dtype=torch.int64)
    rows_mask = torch.zeros(len(cohort), width)
    for k, rows in enumerate(term_rows):
        rows_index[k, :len(rows)], rows_mask[k, :len(rows)] = torch.as_tensor(rows), 1.0
    timings: dict[tuple[str, str, str], list[float]] = {}
    trainers = {}
    for model in ("mlp", "cnn1d"):
        for variant in chosen:
            torch.manual_seed(0)
            network = build_model(model, *dataset_info(config.data_spec), *variant)
            trainers[model, variant] = (CohortTrainer(network, x, y, indices, select_device(device)),
                                        network.state_dict())
    for _ in range(rounds):
        for (model, activation), (trainer, start) in trainers.items():
            for mechanism, hog in (("gaussian", None), ("hog", HogSettings("random", "third-order", 32))):
                began = time.perf_counter()
                trainer.train(start, cohort, seeds, 1, config.batch_size, config.learning_rate, 0.0, hog)
                timings.setdefault((model, mechanism, activation), []).append(time.perf_counter() - began)
            # the yardstick of the term: every client's gradient, vmapped, on the examples its term is computed on
            stacked = {k: v.unsqueeze(0).expand(len(cohort), *v.shape).clone() for k, v in start.items()}
            index, mask = rows_index.to(trainer.device), rows_mask.to(trainer.device)
            began = time.perf_counter()
            trainer._losses_and_gradients(stacked, trainer.x[index], trainer.y[index], mask)
            if trainer.device.type == "cuda":
                torch.cuda.synchronize(trainer.device)  # its kernels run asynchronously
            timings.setdefault((model, "gradient", activation), []).append(time.perf_counter() - began)
    gradient = {(m, *a): statistics.median(t) for (m, k, a), t in timings.items() if k == "gradient"}
    rows = [{"model": m, "mechanism": k, "activation": a[0], "normalization": a[1], "seconds": statistics.median(t),
             "term_rows_gradient_seconds": gradient[(m, *a)]}
            for (m, k, a), t in timings.items() if k != "gradient"]
    if quiet:
        print(json.dumps({"rows": rows}, indent=2))
        return
    tanh = {(r["model"], r["mechanism"]): r["seconds"] for r in rows
            if (r["activation"], r["normalization"]) == ("tanh", "none")}
    gaussian = {(r["model"], r["activation"], r["normalization"]): r["seconds"] for r in rows
                if r["mechanism"] == "gaussian"}
    print(f"a cohort of 100 (MNIST-1D, 1 local epoch of batch 10; hog: + the third-order term on 32 examples), "
          f"torch threads: {threads}; median of {rounds} interleaved repetitions\n")
    print("| model | mechanism | activation | normalization | ms per cohort | × tanh's | hog × gaussian "
          "| ÷ gradient on the term's rows (hog: the term alone) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["model"] != "mlp", r["mechanism"],
                                         chosen.index((r["activation"], r["normalization"])))):
        own = r["model"], r["activation"], r["normalization"]
        hog = f"{r['seconds'] / gaussian[own]:.2f}" if r["mechanism"] == "hog" else ""
        work = r["seconds"] - (gaussian[own] if r["mechanism"] == "hog" else 0.0)
        print(f"| {r['model']} | {r['mechanism']} | {r['activation']} | {r['normalization']} "
              f"| {r['seconds'] * 1e3:.0f} | {r['seconds'] / tanh[r['model'], r['mechanism']]:.2f} | {hog} "
              f"| {work / gradient[own]:.2f} |")


SCALING_POPULATIONS = (1_000, 10_000, 100_000, MILLION)
SCALING_COHORT_MAX = 10_000


def scaling_table(devices: list[str], quick: bool, threads: int, budget: float, quiet: bool) -> None:
    """The vectorized engine on ``synthetic-large`` over populations, per device: seconds a round, peak GPU memory.

    One child process per (device, population) runs the MLP and the CNN, DP-FedAvg and HOG, and prints each row
    as it is measured; the devices' rows come in the order named, populations ascending. A child is given the
    time left of ``budget`` at most (its rows printed by then are kept), and rows no time is left for are listed
    with ``skipped``.
    """
    populations = SCALING_POPULATIONS[:2] if quick else SCALING_POPULATIONS
    started = time.perf_counter()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="fedhog-bench-") as work:
        for device in devices:
            for population in populations:
                left = budget - (time.perf_counter() - started)
                planned = [(m, k) for m in ("mlp", "cnn1d") for k in ("gaussian", "hog")]
                done: list[dict] = []
                if left > 10:
                    spec = {"device": device, "population": population, "threads": threads,
                            "rounds": 3 if quick or population >= MILLION else 4, "workdir": work}
                    try:
                        out = subprocess.run([sys.executable, __file__, "--scaling-one", json.dumps(spec)],
                                             capture_output=True, text=True, timeout=left).stdout
                    except subprocess.TimeoutExpired as expired:
                        out = expired.stdout.decode() if isinstance(expired.stdout, bytes) else expired.stdout or ""
                    done = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
                for model, mechanism in planned[len(done):]:
                    done.append({"device": device, "population": population, "model": model, "mechanism": mechanism,
                                 "skipped": "the budget ran out" if left > 10 else "no budget left"})
                for row in done:
                    rows.append(row)
                    if not quiet:
                        print(f"  {row['device']} N={row['population']:,} {row['model']} {row['mechanism']}: "
                              + (f"{row['seconds_per_round'] * 1e3:.1f} ms/round" if "seconds_per_round" in row
                                 else row["skipped"]), file=sys.stderr)
    import torch

    meta = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "cpu_threads": threads, "budget_seconds": budget, "seconds": time.perf_counter() - started}
    if quiet:
        print(json.dumps({"meta": meta, "rows": rows}, indent=2))
        return
    print(f"vectorized engine, synthetic-large, cohorts of a tenth (at most {SCALING_COHORT_MAX:,}); GPU "
          f"{meta['gpu']}, CPU rows with {threads} torch threads; median of rounds 2..T\n")
    print("| device | population | cohort | model | mechanism | ms / round | peak GPU MiB |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        if "seconds_per_round" in row:
            gpu = f"{row['peak_gpu_mib']:.0f}" if row["peak_gpu_mib"] is not None else "–"
            print(f"| {row['device']} | {row['population']:,} | {row['cohort']:,} | {row['model']} "
                  f"| {row['mechanism']} | {row['seconds_per_round'] * 1e3:.1f} | {gpu} |")
        else:
            print(f"| {row['device']} | {row['population']:,} | | {row['model']} | {row['mechanism']} "
                  f"| {row['skipped']} | |")


def scaling_one(spec: dict) -> None:
    """One device and population of :func:`scaling_table`, in this (child) process: a JSON line per row."""
    import torch

    from fedhog.client_app import app as client_app
    from fedhog.config import RunConfig
    from fedhog.engines.vectorized import run_vectorized
    from fedhog.server_app import app as server_app

    torch.set_num_threads(spec["threads"])
    population = spec["population"]
    cohort = min(population // 10, SCALING_COHORT_MAX)
    for model in ("mlp", "cnn1d"):
        for mechanism in ("gaussian", "hog"):
            folder = Path(spec["workdir"]) / f"{spec['device']}-{population}-{model}-{mechanism}"
            config = RunConfig().with_overrides({
                **{k: v for k, v in WORKLOAD.items() if k not in ("dataset", "num-samples", "partitioner")},
                "dataset": "synthetic-large", "population": population, "sampling-rate": cohort / population,
                "delta": 0.1 / population, "privacy-seed": -1, "model": model, "mechanism": mechanism,
                "device": spec["device"], "rounds": spec["rounds"], "results-dir": str(folder)})
            cuda = spec["device"] == "cuda"
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            run_vectorized(server_app, client_app, config)
            seconds = [r["seconds"] for r in json.loads((folder / "metrics.json").read_text())["rounds"]]
            print(json.dumps({"device": spec["device"], "population": population, "cohort": cohort, "model": model,
                              "mechanism": mechanism, "threads": spec["threads"],
                              "seconds_per_round": statistics.median(seconds[1:]), "first_round_seconds": seconds[0],
                              "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None}),
                  flush=True)


def _progress(row: dict, quiet: bool) -> None:
    if not quiet:
        print(f"  measured {row['engine']} {row['model']} {row['mechanism']} {row.get('activation', '')} "
              f"N={row['population']}: "
              f"{row['seconds_per_round'] * 1e3:.1f} ms/round", file=sys.stderr)


if __name__ == "__main__":
    main()
