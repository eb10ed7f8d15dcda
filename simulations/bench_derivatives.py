"""Benchmark of fedhog.derivatives: time of each quantity as a ratio to one gradient.

For each model (MLP, MNIST-1D 1-D CNN, ~1M-parameter MLP; ``--full`` adds a ~5M
MLP) and each formulation (Taylor mode, nested ``torch.func``, nested
``autograd``), a quantity is timed alternately with one ``torch.autograd.grad``
forward+backward of the same batch; the reported ratio is the median of the
per-pair time ratios.  Peak memory of the gradient and of the third-order
vector is the growth of the peak resident set size (Linux ``VmHWM``, reset
through ``/proc/self/clear_refs``) during one call in a fresh subprocess.

Usage::

    python simulations/bench_derivatives.py [--quick] [--json] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable

import numpy as np
import torch
from torch import nn

from fedhog.derivatives import (
    call_greeks,
    cross_entropy,
    directional_derivatives,
    gradient,
    hessian_vector_product,
    third_order_vector,
)

BATCH = 128


def make_model(name: str) -> tuple[nn.Module, tuple[int, ...]]:
    """Model and per-example input shape (float32, tanh activations, 10 classes)."""
    torch.manual_seed(0)
    if name == "mlp_15k":
        return nn.Sequential(nn.Linear(40, 200), nn.Tanh(), nn.Linear(200, 32), nn.Tanh(), nn.Linear(32, 10)), (40,)
    if name == "cnn1d_40k":
        return nn.Sequential(
            nn.Conv1d(1, 32, 5),
            nn.Tanh(),
            nn.Conv1d(32, 32, 5),
            nn.Tanh(),
            nn.Flatten(),
            nn.Linear(32 * 32, 32),
            nn.Tanh(),
            nn.Linear(32, 10),
        ), (1, 40)
    if name == "mlp_1m":
        return nn.Sequential(nn.Linear(784, 1024), nn.Tanh(), nn.Linear(1024, 256), nn.Tanh(), nn.Linear(256, 10)), (
            784,
        )
    if name == "mlp_5m":
        return nn.Sequential(nn.Linear(784, 2048), nn.Tanh(), nn.Linear(2048, 1536), nn.Tanh(), nn.Linear(1536, 10)), (
            784,
        )
    raise ValueError(name)


def make_batch(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, *shape, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def make_direction(model: nn.Module) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    v = {k: torch.randn(p.shape, generator=g) for k, p in model.named_parameters()}
    norm = torch.sqrt(sum((t * t).sum() for t in v.values()))
    return {k: t / norm for k, t in v.items()}


def tasks(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[tuple[str, str], Callable[[], object]]:
    """``(quantity, method) -> thunk`` for every formulation of every quantity."""
    v = make_direction(model)
    out: dict[tuple[str, str], Callable[[], object]] = {}
    for method in ("autograd", "torch.func", "taylor"):
        out[("gradient", method)] = lambda m=method: gradient(model, x, y, method=m)
        out[("hvp", method)] = lambda m=method: hessian_vector_product(model, x, y, v, method=m)
        out[("third_order_vector", method)] = lambda m=method: third_order_vector(model, x, y, v, method=m)
    for k in range(1, 6):
        for method in ("taylor", "torch.func"):
            out[(f"directional_k{k}", method)] = lambda m=method, k=k: directional_derivatives(
                model, x, y, v, k, method=m
            )
    return out


def baseline(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], object]:
    params = list(model.parameters())
    return lambda: torch.autograd.grad(cross_entropy(model(x), y), params)


def interleaved_ratio(f: Callable[[], object], base: Callable[[], object], budget_s: float) -> float:
    """Median over alternating runs of ``time(f) / time(base)``.

    Each ratio pairs ``f`` with the gradient run just before it, so load from
    other processes that drifts over seconds cancels out.
    """
    f(), base()
    ratios = []
    start = time.perf_counter()
    while len(ratios) < 5 or (time.perf_counter() - start < budget_s and len(ratios) < 100):
        s = time.perf_counter()
        base()
        tb = time.perf_counter() - s
        s = time.perf_counter()
        f()
        ratios.append((time.perf_counter() - s) / tb)
    return statistics.median(ratios)


def peak_child(model_name: str, quantity: str, method: str, threads: int) -> float:
    """Run one computation in a fresh process and return its peak RSS growth in MiB."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=os.pathsep.join(sys.path))
    cmd = [sys.executable, __file__, "--peak", model_name, quantity, method, "--threads", str(threads)]
    return float(subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.strip())


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def measure_peak(model_name: str, quantity: str, method: str) -> None:
    """Print the peak RSS growth (MiB) of a second call, after resetting the kernel's high-water mark."""
    model, shape = make_model(model_name)
    x, y = make_batch(shape)
    f = baseline(model, x, y) if method == "baseline" else tasks(model, x, y)[(quantity, method)]
    f()  # one-time initialisations (BLAS buffers, tracing) are not part of the peak
    with open("/proc/self/clear_refs", "w") as refs:  # "5" resets VmHWM to the current RSS
        refs.write("5")
    before = _status_kib("VmRSS")
    f()
    print((_status_kib("VmHWM") - before) / 1024)


def greeks_timing(n: int = 100_000) -> dict[str, float]:
    """Seconds for all Greeks of ``n`` calls: engine (vmap, float64) vs numpy/scipy analytic."""
    from scipy.stats import norm

    rng = np.random.default_rng(0)
    s, t, vol = rng.uniform(80, 120, n), rng.uniform(0.25, 2.0, n), rng.uniform(0.15, 0.5, n)
    f64 = lambda a: torch.as_tensor(a, dtype=torch.float64)  # noqa: E731
    start = time.perf_counter()
    call_greeks(f64(s), f64(100.0), f64(t), f64(0.03), f64(vol))
    engine = time.perf_counter() - start
    start = time.perf_counter()
    sd = vol * np.sqrt(t)
    d1 = (np.log(s / 100.0) + (0.03 + 0.5 * vol**2) * t) / sd
    gamma = norm.pdf(d1) / (s * sd)
    _ = (norm.cdf(d1), gamma, -gamma / s * (d1 / sd + 1), s * norm.pdf(d1) * np.sqrt(t))
    analytic = time.perf_counter() - start
    return {"options": n, "engine_s": engine, "numpy_analytic_s": analytic}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller time budget per row (< 2 minutes)")
    parser.add_argument("--full", action="store_true", help="add the ~5M-parameter MLP")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peak", nargs=3, metavar=("MODEL", "QUANTITY", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.peak:
        measure_peak(*args.peak)
        return
    budget = 0.4 if args.quick else 3.0
    names = ["mlp_15k", "cnn1d_40k", "mlp_1m"] + (["mlp_5m"] if args.full else [])
    rows = []
    for name in names:
        model, shape = make_model(name)
        x, y = make_batch(shape)
        base = baseline(model, x, y)
        peaks = {}
        if not args.quick or name == "mlp_1m":
            peaks = {
                m: peak_child(name, "third_order_vector", m, args.threads) for m in ("taylor", "torch.func", "autograd")
            }
            peaks["baseline"] = peak_child(name, "gradient", "baseline", args.threads)
        for (quantity, method), f in tasks(model, x, y).items():
            slow = method == "torch.func" and quantity.startswith("directional_k") and int(quantity[-1]) >= 4
            if args.quick and slow and name == "mlp_1m":
                continue  # nested jvp of order ≥ 4 takes seconds per call on the 1M model
            ratio = interleaved_ratio(f, base, budget)
            peak = peaks.get(method) if quantity == "third_order_vector" else None
            rows.append(
                {
                    "model": name,
                    "quantity": quantity,
                    "method": method,
                    "ratio_to_gradient": round(ratio, 3),
                    "peak_mib": peak,
                }
            )
        if peaks:
            rows.append(
                {
                    "model": name,
                    "quantity": "gradient",
                    "method": "autograd.grad (baseline)",
                    "ratio_to_gradient": 1.0,
                    "peak_mib": peaks["baseline"],
                }
            )
    greeks = greeks_timing()
    if args.json:
        print(json.dumps({"rows": rows, "greeks": greeks}))
        return
    print(f"threads={args.threads} batch={BATCH} torch={torch.__version__} (medians; ratio to one autograd.grad)")
    print(f"{'model':<10} {'quantity':<20} {'method':<26} {'ratio':>8} {'peak MiB':>9}")
    for r in rows:
        peak = "" if r["peak_mib"] is None else f"{r['peak_mib']:.1f}"
        print(f"{r['model']:<10} {r['quantity']:<20} {r['method']:<26} {r['ratio_to_gradient']:>8.2f} {peak:>9}")
    print(
        f"Greeks of {greeks['options']} calls: engine {greeks['engine_s']:.3f} s, "
        f"numpy/scipy analytic {greeks['numpy_analytic_s']:.3f} s"
    )


if __name__ == "__main__":
    main()
