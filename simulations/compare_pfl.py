"""fedhog's vectorized engine against Apple's pfl-research, side by side, interleaved, all-in seconds a round.

The workload of ``bench_rounds.py`` (MNIST-1D, 1 000 clients, Dirichlet 0.5, an MLP, one local epoch of batch 10,
learning rate 0.05) with DP-FedAvg (clipping norm C = 1, noise σ = 1.675·C on the sum, 100 rounds), both on the
same arrays, the same partition and the same initial model: this script (fedhog's venv) exports them to a
folder, and a child process in a Python that has ``pfl`` (``--pfl-python``; a separate venv, never a fedhog
dependency) builds pfl's ``SimulatedBackend`` over them. Cohorts: fedhog samples Poisson q = 0.1 (100 on
average), pfl a fixed 100. Both evaluate the test set every round (pfl's evaluation of each sampled user's own
data before and after training, which fedhog does not do, is off but for its first round). Runs alternate
(fedhog, pfl, fedhog, pfl…), each in a fresh process with ``--threads`` torch threads, so a drift of the
machine's load falls on both alike.

All-in: the wall time of the rounds (training, mechanism, accounting, evaluation and, for fedhog, its checkpoint
and results, all included) divided by the rounds; start-up (data, partitioning, imports) is left out of both.
For fedhog that is the sum of ``metrics.json``'s per-round ``seconds``, for pfl the wall time of
``FederatedAveraging.run``.

Setting up pfl (once)::

    python3 -m venv /work/venv-pfl && /work/venv-pfl/bin/pip install torch==2.13.0 && \\
        /work/venv-pfl/bin/pip install "pfl[pytorch]==0.6.0"

Usage::

    python simulations/compare_pfl.py [--pfl-python /work/venv-pfl/bin/python] [--repeat 3] [--rounds 100]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_rounds import WORKLOAD  # noqa: E402 -- the one workload of the speed figures

NOISE_MULTIPLIER, CLIPPING_NORM, COHORT = 1.675, 1.0, 100


def export(folder: Path) -> dict:
    """Write the population's arrays, partition, test set and initial model for the pfl child; return the config."""
    import numpy as np
    import torch

    from fedhog.config import RunConfig
    from fedhog.data import dataset_info, load_test_set, population_training_data
    from fedhog.models import build_model

    config = RunConfig().with_overrides({**WORKLOAD, "model": "mlp", "mechanism": "gaussian"})
    x, y, indices = population_training_data(config.data_spec)
    test = load_test_set(config.data_spec)
    torch.manual_seed(config.seed)  # as the ServerApp builds its initial model
    model = build_model(config.model, *dataset_info(config.data_spec), config.activation, config.normalization)
    np.savez(folder / "data.npz", x=x, y=y, test_x=test.x, test_y=test.y,
             offsets=np.cumsum([0] + [len(i) for i in indices]), order=np.concatenate(indices))
    torch.save(model.state_dict(), folder / "initial.pt")
    return {"activation": config.activation, "learning_rate": config.learning_rate, "batch_size": config.batch_size,
            "local_epochs": config.local_epochs, "repr": repr(model)}


def run_fedhog(rounds: int, threads: int, folder: Path) -> dict:
    """One fedhog run (vectorized engine) in this process; all-in seconds a round from metrics.json."""
    import torch

    from fedhog.client_app import app as client_app
    from fedhog.config import RunConfig
    from fedhog.engines.vectorized import run_vectorized
    from fedhog.server_app import app as server_app

    torch.set_num_threads(threads)
    config = RunConfig().with_overrides({**WORKLOAD, "model": "mlp", "mechanism": "gaussian", "rounds": rounds,
                                         "results-dir": str(folder / f"fedhog-{time.time_ns()}")})
    run_vectorized(server_app, client_app, config)
    document = json.loads((Path(config.results_dir) / "metrics.json").read_text())
    seconds = [r["seconds"] for r in document["rounds"]]
    return {"all_in_s": sum(seconds) / len(seconds), "median_round_s": statistics.median(seconds),
            "accuracy": document["rounds"][-1]["accuracy"], "epsilon": document["summary"]["epsilon"]}


PFL_CHILD = r'''
import json, sys, time
import numpy as np, torch
from torch import nn
from pfl.aggregate.simulate import SimulatedBackend
from pfl.aggregate.weighting import WeightByUser
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
from pfl.callback.central_evaluation import CentralEvaluationCallback
from pfl.data.dataset import Dataset
from pfl.data.federated_dataset import FederatedDataset
from pfl.data.sampling import get_user_sampler
from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
from pfl.model.pytorch import PyTorchModel
from pfl.privacy import CentrallyAppliedPrivacyMechanism, GaussianMechanism

spec = json.loads(sys.argv[1])
torch.set_num_threads(spec["threads"])
data = np.load(spec["folder"] + "/data.npz")
activation = {"gelu": nn.GELU, "tanh": nn.Tanh, "relu": nn.ReLU, "silu": nn.SiLU, "softplus": nn.Softplus}

class MLP(nn.Module):  # fedhog's mlp, with the loss and metrics pfl asks a module for
    def __init__(self):
        super().__init__()
        act = activation[spec["activation"]]
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(40, 64), act(), nn.Linear(64, 64), act(), nn.Linear(64, 10))
    def forward(self, x):
        return self.net(x)
    def loss(self, x, y, eval=False):
        self.eval() if eval else self.train()
        return nn.functional.cross_entropy(self(x), y)
    @torch.no_grad()
    def metrics(self, x, y, eval=False):
        from pfl.metrics import Weighted
        self.eval() if eval else self.train()
        logits = self(x)
        return {"loss": Weighted(float(nn.functional.cross_entropy(logits, y, reduction="sum")), len(y)),
                "accuracy": Weighted(float((logits.argmax(1) == y).sum()), len(y))}

module = MLP()
module.net.load_state_dict(torch.load(spec["folder"] + "/initial.pt"))
x, y = torch.as_tensor(data["x"]), torch.as_tensor(data["y"]).long()
offsets, order = data["offsets"], data["order"]
users = list(range(len(offsets) - 1))
def make_dataset(user):
    rows = torch.as_tensor(order[offsets[user]:offsets[user + 1]])
    return Dataset(raw_data=[x[rows], y[rows]], user_id=str(user))
train = FederatedDataset(make_dataset, get_user_sampler("random", users))
test = Dataset(raw_data=[torch.as_tensor(data["test_x"]), torch.as_tensor(data["test_y"]).long()])
mechanism = CentrallyAppliedPrivacyMechanism(GaussianMechanism(spec["clipping_norm"], spec["noise_multiplier"]))
backend = SimulatedBackend(training_data=train, val_data=None, postprocessors=[WeightByUser(), mechanism])
model = PyTorchModel(model=module, local_optimizer_create=torch.optim.SGD,
                     central_optimizer=torch.optim.SGD(module.parameters(), lr=1.0))
eval_params = NNEvalHyperParams(local_batch_size=4096)
evaluation = CentralEvaluationCallback(test, model_eval_params=eval_params, frequency=1)
algorithm = FederatedAveraging()
# evaluation_frequency: pfl's own evaluation of every sampled user's data before and after local training (fedhog
# does none); the test set is evaluated every round by the callback, as fedhog's server does
params = NNAlgorithmParams(central_num_iterations=spec["rounds"], evaluation_frequency=spec["rounds"],
                           train_cohort_size=spec["cohort"], val_cohort_size=0)
train_params = NNTrainHyperParams(local_learning_rate=spec["learning_rate"], local_num_epochs=spec["local_epochs"],
                                  local_batch_size=spec["batch_size"])
started = time.perf_counter()
algorithm.run(algorithm_params=params, backend=backend, model=model, model_train_params=train_params,
              model_eval_params=eval_params, callbacks=[evaluation], send_metrics_to_platform=False)
seconds = time.perf_counter() - started
accuracy = float(model.evaluate(test, lambda n: n, eval_params)["accuracy"].overall_value)
print(json.dumps({"all_in_s": seconds / spec["rounds"], "accuracy": accuracy}))
'''


def run_pfl(python: str, rounds: int, threads: int, folder: Path, exported: dict) -> dict:
    spec = {**exported, "folder": str(folder), "rounds": rounds, "threads": threads, "cohort": COHORT,
            "clipping_norm": CLIPPING_NORM, "noise_multiplier": NOISE_MULTIPLIER}
    done = subprocess.run([python, "-c", PFL_CHILD, json.dumps(spec)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"pfl run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def pfl_available(python: str) -> bool:
    return subprocess.run([python, "-c", "import pfl.aggregate.simulate"], capture_output=True).returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pfl-python", default="/work/venv-pfl/bin/python", help="a Python where pfl is installed")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each framework, alternating")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each run (default 1)")
    parser.add_argument("--fedhog-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fedhog_child:
        print(json.dumps(run_fedhog(args.rounds, args.threads, Path(args.fedhog_child))))
        return
    if not (Path(args.pfl_python).exists() and pfl_available(args.pfl_python)):
        print(f"pfl is not importable from {args.pfl_python}: nothing compared (see the module docstring to set it up)")
        return
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="fedhog-vs-pfl-") as work:
        folder = Path(work)
        exported = export(folder)
        runs: dict[str, list[dict]] = {"fedhog": [], "pfl": []}
        for _ in range(args.repeat):
            child = [sys.executable, __file__, "--fedhog-child", str(folder), "--rounds", str(args.rounds),
                     "--threads", str(args.threads)]
            done = subprocess.run(child, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"fedhog run failed:\n{done.stderr[-3000:]}")
            runs["fedhog"].append(json.loads(done.stdout.strip().splitlines()[-1]))
            runs["pfl"].append(run_pfl(args.pfl_python, args.rounds, args.threads, folder, exported))
            print(f"  fedhog {runs['fedhog'][-1]['all_in_s'] * 1e3:.1f} ms/round, "
                  f"pfl {runs['pfl'][-1]['all_in_s'] * 1e3:.1f} ms/round", file=sys.stderr)
    ratios = [p["all_in_s"] / f["all_in_s"] for f, p in zip(runs["fedhog"], runs["pfl"], strict=True)]
    summary = {
        "rounds": args.rounds, "threads": args.threads, "repeat": args.repeat,
        "fedhog_all_in_s": [round(r["all_in_s"], 4) for r in runs["fedhog"]],
        "pfl_all_in_s": [round(r["all_in_s"], 4) for r in runs["pfl"]],
        "pfl_over_fedhog": [round(r, 2) for r in ratios], "median_ratio": round(statistics.median(ratios), 2),
        "fedhog_accuracy": [round(r["accuracy"], 3) for r in runs["fedhog"]],
        "pfl_accuracy": [round(r["accuracy"], 3) for r in runs["pfl"]],
        "fedhog_epsilon": runs["fedhog"][0]["epsilon"],
        "load_average_before": [round(v, 2) for v in load_before],
        "load_average_after": [round(v, 2) for v in os.getloadavg()], "cpus": os.cpu_count(),
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
