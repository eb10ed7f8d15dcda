"""One gradient's wall time in milliseconds, per model of ``bench_derivatives.py`` and per device.

``bench_derivatives.py`` reports every quantity as a ratio to a gradient on the same device, timed alongside
it; this gives that gradient in absolute terms (its own models, batch and baseline), so that the check's
summary can state each quantity in ms on CUDA and on the CPU beside it (ratio × gradient ms, the two measured
minutes apart).

Usage::

    python simulations/gpu/gradient_ms.py --devices cuda cpu [--activation gelu] [--threads 16]   # one JSON object
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch

MODELS = ("mlp_15k", "cnn1d_40k", "mlp_1m")


def _bench_derivatives():
    path = Path(__file__).resolve().parents[1] / "bench_derivatives.py"
    spec = importlib.util.spec_from_file_location("bench_derivatives", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gradient_ms(device: torch.device, activation: str, calls: int = 20) -> dict[str, float]:
    """Median ms of one autograd gradient (``bench_derivatives.baseline``) of each model on ``device``."""
    bench = _bench_derivatives()
    out = {}
    for name in MODELS:
        model, shape = bench.make_model(name, activation)
        model = model.to(device)
        x, y = bench.make_batch(shape, device.type)
        f = bench.synchronized(bench.baseline(model, x, y), device)
        for _ in range(3):  # warm: kernels chosen, caches filled
            f()
        times = []
        for _ in range(calls):
            began = time.perf_counter()
            f()
            times.append(time.perf_counter() - began)
        out[name] = round(statistics.median(times) * 1e3, 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", nargs="+", default=["cpu"], choices=("cpu", "cuda"))
    parser.add_argument("--activation", default="gelu")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    devices = [d for d in args.devices if d == "cpu" or torch.cuda.is_available()]
    print(json.dumps({"activation": args.activation, "threads": args.threads, "batch": _bench_derivatives().BATCH,
                      "gradient_ms": {d: gradient_ms(torch.device(d), args.activation) for d in devices}}))


if __name__ == "__main__":
    main()
