"""Benchmark of fedhog.derivatives: time of each quantity as a ratio to one gradient.

For each model (15k MLP, MNIST-1D-sized 1-D CNN of 38k parameters, ~1M MLP;
``--full`` adds a ~4.7M MLP; tanh after each hidden layer, or ``--activation``)
and each formulation (Taylor mode, nested ``torch.func``, nested ``autograd``), a quantity is timed alternately with one
``torch.autograd.grad`` forward+backward of the same batch; the ratio is the
median of the per-pair time ratios, and with ``--repeat N`` the median of N such
medians (taken in N passes over all rows, so slow drifts of the machine's load
hit every formulation alike).  ``hessian_trace_gradient`` is timed for k = 1, 4, 16 Rademacher directions in one
batched call, against k single third-order vectors and against its matrix products alone
(:func:`trace_product_floor`).  Peak memory of the gradient and of the
third-order vector: on CPU the growth of the peak resident set size (Linux
``VmHWM``, reset through ``/proc/self/clear_refs``) during one call in a fresh
subprocess; on CUDA ``torch.cuda.max_memory_allocated`` above the memory held
before the call.  The load average is printed with the table (the machine may
be shared).

Usage::

    python simulations/bench_derivatives.py [--quick] [--full] [--json] [--threads 1] [--repeat 3] [--device cuda]
        [--activation gelu] [--cpu-time]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from fedhog.derivatives import (
    call_greeks,
    cross_entropy,
    directional_derivatives,
    gradient,
    hessian_trace_gradient,
    hessian_vector_product,
    third_order_vector,
)
from fedhog.derivatives.engine import random_directions
from fedhog.models import ACTIVATIONS

BATCH = 128


def make_model(name: str, activation: str = "tanh") -> tuple[nn.Module, tuple[int, ...]]:
    """Model and per-example input shape (float32, ``activation`` after each hidden layer, 10 classes)."""
    torch.manual_seed(0)
    act = ACTIVATIONS[activation]
    if name == "mlp_15k":
        return nn.Sequential(nn.Linear(40, 200), act(), nn.Linear(200, 32), act(), nn.Linear(32, 10)), (40,)
    if name == "cnn1d_40k":
        return nn.Sequential(
            nn.Conv1d(1, 32, 5),
            act(),
            nn.Conv1d(32, 32, 5),
            act(),
            nn.Flatten(),
            nn.Linear(32 * 32, 32),
            act(),
            nn.Linear(32, 10),
        ), (1, 40)
    if name == "mlp_1m":
        return nn.Sequential(nn.Linear(784, 1024), act(), nn.Linear(1024, 256), act(), nn.Linear(256, 10)), (784,)
    if name == "mlp_5m":
        return nn.Sequential(nn.Linear(784, 2048), act(), nn.Linear(2048, 1536), act(), nn.Linear(1536, 10)), (784,)
    raise ValueError(name)


def make_batch(shape: tuple[int, ...], device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, *shape, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
    return x.to(device), y.to(device)


def make_direction(model: nn.Module) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    v = {k: torch.randn(p.shape, generator=g) for k, p in model.named_parameters()}
    norm = torch.sqrt(sum((t * t).sum() for t in v.values()))
    return {k: t / norm for k, t in v.items()}


def product_ratio(model: nn.Module, shape: tuple[int, ...]) -> float:
    """The third-order vector's cost over a gradient's in the multiply-adds of their matrix products alone, with the
    fewest products we know per layer: a layer whose input is the data 3 against 2 (W x, V x and ∇W against W x and
    ∇W), any other 11 against 3 (4 forward, 4 input adjoints and 3 for ∇W, Karatsuba's: :mod:`fedhog.derivatives.
    products`; against forward, input adjoint and ∇W). Where the products dominate both, the time ratio sits near
    it; the gradient's other work (activations, loss) can take the measured ratio a little under it."""
    first, rest = _layer_macs(model, shape)
    return (3 * first + 11 * rest) / (2 * first + 3 * rest)


def _layer_macs(model: nn.Module, shape: tuple[int, ...]) -> tuple[int, int]:
    """One example's multiply-adds in the layer that reads the data, and in all the others."""
    macs: list[int] = []

    def count(layer: nn.Module, inputs: object, output: torch.Tensor) -> None:
        per_output = (layer.in_features if isinstance(layer, nn.Linear)
                      else layer.in_channels // layer.groups * math.prod(layer.kernel_size))
        macs.append(output[0].numel() * per_output)  # one example's

    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d))]
    hooks = [layer.register_forward_hook(count) for layer in layers]
    try:
        with torch.no_grad():
            model(torch.zeros(1, *shape))
    finally:
        for hook in hooks:
            hook.remove()
    return macs[0], sum(macs[1:])  # in the order the forward runs them: the first one reads the data


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
                model, x, y, v, order=k, method=m
            )
    params = {name: p.detach() for name, p in model.named_parameters()}
    for k in TRACE_DIRECTIONS:
        stacked = random_directions(params, k, "rademacher", torch.Generator().manual_seed(3))
        vs = [{name: d[j] for name, d in stacked.items()} for j in range(k)]
        out[(f"trace_gradient_k{k}", "taylor")] = lambda vs=vs: hessian_trace_gradient(model, x, y, directions=vs,
                                                                                       method="taylor")
        out[(f"trace_gradient_k{k}", "k single calls")] = lambda vs=vs: [
            third_order_vector(model, x, y, d, method="taylor") for d in vs]
    return out


TRACE_DIRECTIONS = (1, 4, 16)
"""Hutchinson's directions ``hessian_trace_gradient`` is timed for, batched and as k single third-order vectors."""


def trace_product_floor(model: nn.Module, shape: tuple[int, ...], k: int) -> float:
    """``hessian_trace_gradient``'s cost over a gradient's in matrix products alone, for k directions. One runs as
    the third-order vector (:func:`product_ratio`). More run batched, the primal shared: a layer reading the data
    k + 2 products (W x once, V_j x each, ∇W once from the summed adjoint) against 2; any other 3 + 10k against 3
    (W x₀, x̄₀ = ḡ₀ W and ∇W's ḡ₀ᵀx₀ once; per direction W x₁, V x₀, W x₂, V x₁ forward and their six adjoint
    products: Leibniz pairs, as Karatsuba's steps aside under vmap). torch's FLOP counter finds these counts."""
    if k == 1:
        return product_ratio(model, shape)
    first, rest = _layer_macs(model, shape)
    return ((k + 2) * first + (3 + 10 * k) * rest) / (2 * first + 3 * rest)


def baseline(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], object]:
    params = list(model.parameters())
    return lambda: torch.autograd.grad(cross_entropy(model(x), y), params)


def synchronized(f: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """``f`` followed by a device synchronisation (CUDA kernels run asynchronously)."""
    if device.type != "cuda":
        return f

    def g() -> object:
        out = f()
        torch.cuda.synchronize(device)
        return out

    return g


def interleaved_ratio(f: Callable[[], object], base: Callable[[], object], budget_s: float,
                      clock: Callable[[], float] = time.perf_counter) -> float:
    """Median over alternating runs of ``time(f) / time(base)``.

    Each ratio pairs ``f`` with the gradient run just before it, so load from
    other processes that drifts over seconds cancels out.
    """
    f(), base()
    ratios = []
    start = time.perf_counter()
    while len(ratios) < 5 or (time.perf_counter() - start < budget_s and len(ratios) < 100):
        s = clock()
        base()
        tb = clock() - s
        s = clock()
        f()
        ratios.append((clock() - s) / tb)
    return statistics.median(ratios)


def peak_cuda(model: nn.Module, x: torch.Tensor, y: torch.Tensor, quantity: str, method: str) -> float:
    """Peak CUDA memory (MiB) allocated during one call above what was held before it."""
    f = baseline(model, x, y) if method == "baseline" else tasks(model, x, y)[(quantity, method)]
    f()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    f()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def peak_child(model_name: str, quantity: str, method: str, threads: int, activation: str) -> float:
    """Run one computation in a fresh process and return its peak RSS growth in MiB."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=os.pathsep.join(sys.path))
    cmd = [sys.executable, __file__, "--peak", model_name, quantity, method, "--threads", str(threads),
           "--activation", activation]
    return float(subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.strip())


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def measure_peak(model_name: str, quantity: str, method: str, activation: str) -> None:
    """Print the peak RSS growth (MiB) of a second call, after resetting the kernel's high-water mark."""
    model, shape = make_model(model_name, activation)
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


SUMMARY = (
    ("third_order_vector", ("taylor", "autograd", "torch.func")),
    ("hvp", ("taylor", "autograd")),
    ("directional_k5", ("taylor", "torch.func")),
)


def summary(rows: list[dict]) -> list[str]:
    """The README table: ratios side by side per model, peaks, and the issue's goals."""
    lines = [
        "| model | third-order vector: Taylor / triple backward / torch.func [≤ 3.0] | in matrix products alone "
        "| HVP: Taylor / double backward | order-5 directional: Taylor / nested jvp [≤ 2.5] "
        "| peak MiB: gradient / Taylor / triple backward [Taylor ≤ 0.5× triple] |",
        "|---|---|---|---|---|---|",
    ]
    for model in dict.fromkeys(r["model"] for r in rows):
        get = {(r["quantity"], r["method"]): r for r in rows if r["model"] == model}
        cells = []
        for quantity, methods in SUMMARY:
            found = [get.get((quantity, m)) for m in methods]
            text = [f"{r['ratio_to_gradient']:.2f}" if r else "–" for r in found]
            goal = {"third_order_vector": 3.0, "directional_k5": 2.5}.get(quantity)
            if goal and found[0] and found[0]["ratio_to_gradient"] <= goal:
                text[0] = f"**{text[0]}**"
            cells.append(" / ".join(text))
            if quantity == "third_order_vector":
                products = get.get((quantity, "matrix products alone"))
                cells.append("–" if products is None else f"{products['ratio_to_gradient']:.2f}")
        peaks = [get.get(k, {}).get("peak_mib") for k in (("gradient", "autograd.grad (baseline)"),
                                                          ("third_order_vector", "taylor"),
                                                          ("third_order_vector", "autograd"))]  # fmt: skip
        cells.append(" / ".join("–" if p is None else f"{p:.1f}" for p in peaks))
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return lines


def trace_summary(rows: list[dict]) -> list[str]:
    """hessian_trace_gradient per model and k: batched, k single third-order vectors, its matrix products alone."""
    ks = " / ".join(f"k={k}" for k in TRACE_DIRECTIONS)
    lines = [f"| model | ∇tr∇²L batched ({ks}) | k single third-order vectors | batched, in matrix products alone |",
             "|---|---|---|---|"]
    for model in dict.fromkeys(r["model"] for r in rows):
        get = {(r["quantity"], r["method"]): r["ratio_to_gradient"] for r in rows if r["model"] == model}
        cells = [" / ".join("–" if get.get((f"trace_gradient_k{k}", m)) is None
                            else f"{get[(f'trace_gradient_k{k}', m)]:.2f}" for k in TRACE_DIRECTIONS)
                 for m in ("taylor", "k single calls", "matrix products alone")]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller time budget per row (< 2 minutes)")
    parser.add_argument("--full", action="store_true", help="add the ~5M-parameter MLP")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=1, help="passes over all rows; the median ratio is reported")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time by this thread's CPU time (with --threads 1: what other processes' load leaves "
                             "untouched; wall time otherwise)")
    parser.add_argument("--models", help="comma-separated subset of the models")
    parser.add_argument("--activation", default="tanh", choices=sorted(ACTIVATIONS),
                        help="after every hidden layer (default tanh, the table's; fedhog's models default to gelu)")
    parser.add_argument("--peak", nargs=3, metavar=("MODEL", "QUANTITY", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.peak:
        measure_peak(*args.peak, args.activation)
        return
    device = torch.device(args.device)
    budget = 0.4 if args.quick else 3.0
    clock = time.thread_time if args.cpu_time else time.perf_counter
    names = ["mlp_15k", "cnn1d_40k", "mlp_1m"] + (["mlp_5m"] if args.full else [])
    if args.models:
        names = [n for n in names if n in args.models.split(",")] or args.models.split(",")
    load_before = os.getloadavg()
    started = time.perf_counter()
    rows = []
    for name in names:
        model, shape = make_model(name, args.activation)
        model = model.to(device)
        x, y = make_batch(shape, args.device)
        base = synchronized(baseline(model, x, y), device)
        peaks: dict[str, float] = {}
        if not args.quick or name == "mlp_1m":
            for m in ("taylor", "torch.func", "autograd"):
                peaks[m] = (
                    peak_cuda(model, x, y, "third_order_vector", m)
                    if device.type == "cuda"
                    else peak_child(name, "third_order_vector", m, args.threads, args.activation)
                )
            peaks["baseline"] = (
                peak_cuda(model, x, y, "gradient", "baseline")
                if device.type == "cuda"
                else peak_child(name, "gradient", "baseline", args.threads, args.activation)
            )
        jobs = []
        for (quantity, method), f in tasks(model, x, y).items():
            slow = method == "torch.func" and quantity.startswith("directional_k") and int(quantity[-1]) >= 4
            if args.quick and slow and name == "mlp_1m":
                continue  # nested jvp of order ≥ 4 takes seconds per call on the 1M model
            jobs.append((quantity, method, synchronized(f, device)))
        ratios: dict[tuple[str, str], list[float]] = {}
        for _ in range(max(1, args.repeat)):
            for quantity, method, f in jobs:
                ratios.setdefault((quantity, method), []).append(interleaved_ratio(f, base, budget, clock))
        for quantity, method, _ in jobs:
            peak = peaks.get(method) if quantity == "third_order_vector" else None
            rows.append(
                {
                    "model": name,
                    "quantity": quantity,
                    "method": method,
                    "ratio_to_gradient": round(statistics.median(ratios[(quantity, method)]), 3),
                    "peak_mib": peak,
                }
            )
        rows.append({"model": name, "quantity": "third_order_vector", "method": "matrix products alone",
                     "ratio_to_gradient": round(product_ratio(model, shape), 3), "peak_mib": None})
        for k in TRACE_DIRECTIONS:
            rows.append({"model": name, "quantity": f"trace_gradient_k{k}", "method": "matrix products alone",
                         "ratio_to_gradient": round(trace_product_floor(model, shape, k), 3), "peak_mib": None})
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
    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": args.threads,
        "activation": args.activation,
        "repeat": args.repeat,
        "clock": "thread CPU time" if args.cpu_time else "wall",
        "batch": BATCH,
        "torch": torch.__version__,
        "load_average_before": [round(v, 2) for v in load_before],
        "load_average_after": [round(v, 2) for v in os.getloadavg()],
        "cpus": os.cpu_count(),
        "seconds": round(time.perf_counter() - started, 1),
    }
    if args.json:
        print(json.dumps({"rows": rows, "greeks": greeks, "meta": meta}))
        return
    print(
        f"device={meta['device']} activation={args.activation} "
        f"threads={args.threads} repeat={args.repeat} clock={meta['clock']} batch={BATCH} torch={torch.__version__} "
        f"load average {meta['load_average_before']} -> {meta['load_average_after']} on {meta['cpus']} CPUs "
        "(medians; ratio to one autograd.grad)"
    )
    print(f"{'model':<10} {'quantity':<20} {'method':<26} {'ratio':>8} {'peak MiB':>9}")
    for r in rows:
        peak = "" if r["peak_mib"] is None else f"{r['peak_mib']:.1f}"
        print(f"{r['model']:<10} {r['quantity']:<20} {r['method']:<26} {r['ratio_to_gradient']:>8.2f} {peak:>9}")
    print(
        f"Greeks of {greeks['options']} calls: engine {greeks['engine_s']:.3f} s, "
        f"numpy/scipy analytic {greeks['numpy_analytic_s']:.3f} s"
    )
    print()
    print("\n".join(summary(rows)))
    print()
    print("\n".join(trace_summary(rows)))


if __name__ == "__main__":
    main()
