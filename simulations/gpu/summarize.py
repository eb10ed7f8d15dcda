"""The GPU check's summary: every step's outcome and the figures, from the files ``check.sh`` wrote.

Writes ``summary.json`` into the output folder and prints the figures. The quickstart ran twice with the same
``privacy-seed`` (so the same cohorts, ξ and noise): ε must be the same number exactly, and the final
accuracy within :data:`ACCURACY_TOLERANCE`, since the two models differ only by floating-point rounding (CUDA's
kernels sum in another order, and convolutions use TF32 by default), which 80 rounds of training can amplify.

Usage (check.sh calls it)::

    python simulations/gpu/summarize.py --out OUT --steps STEPS.jsonl --device cuda \\
        --quickstart DIR --quickstart-cpu DIR --seconds 470
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

ACCURACY_TOLERANCE = 0.03
"""|accuracy on the device − accuracy on the CPU| allowed for the seeded quickstart: the spread of independent
quickstart runs (0.708, 0.733, 0.758, docs/manual/quickstart.md) is about this, from different cohorts and noise;
the same cohorts and noise leave only rounding, so more than this is a device difference worth reading."""
TWO_CORE_MILLION_SECONDS = 28.5  # the 10⁶-client round measured on the 2-core CPU (docs/manual/vectorized-engine.md)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def pytest_counts(path: Path) -> dict[str, Any] | None:
    """Tests, failures, errors and skips of a JUnit XML report, and the names of the tests that failed."""
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return None
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return None
    counts: dict[str, Any] = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    counts["failed"] = [case.get("name") for case in suite.iter("testcase")
                        if case.find("failure") is not None or case.find("error") is not None]
    return counts


def quickstart(folder: Path, seconds: float | None) -> dict[str, Any] | None:
    """A quickstart run's figures from its results folder, and its whole command's seconds."""
    metrics = _read_json(folder / "metrics.json")
    if metrics is None:
        return None
    summary = metrics.get("summary", {})
    return {"status": metrics.get("status"), "device": metrics.get("config", {}).get("device"),
            "rounds": summary.get("rounds_completed"), "accuracy": summary.get("final_accuracy"),
            "epsilon": summary.get("epsilon"), "delta": summary.get("delta"),
            "noise_multiplier": summary.get("noise_multiplier"), "run_seconds": metrics.get("seconds"),
            "command_seconds": seconds,
            "clients_sampled": [r.get("clients_sampled") for r in metrics.get("rounds", [])],
            "epsilons": [r.get("epsilon") for r in metrics.get("rounds", [])]}


def compare_quickstarts(device: dict | None, cpu: dict | None) -> dict[str, Any] | None:
    """The same seeded quickstart on the device and on the CPU: ε equal, cohorts equal, accuracy within tolerance."""
    if device is None or cpu is None:
        return None
    difference = abs(device["accuracy"] - cpu["accuracy"])
    return {"same_epsilon_exactly": device["epsilons"] == cpu["epsilons"],
            "same_cohort_sizes": device["clients_sampled"] == cpu["clients_sampled"],
            "accuracy_difference": difference, "accuracy_tolerance": ACCURACY_TOLERANCE,
            "accuracy_within_tolerance": difference <= ACCURACY_TOLERANCE,
            "speedup_whole_command": (cpu["command_seconds"] / device["command_seconds"]
                                      if cpu["command_seconds"] and device["command_seconds"] else None)}


def derivatives(rows_file: Path, gradient_ms: dict[str, float] | None) -> list[dict] | None:
    """bench_derivatives' rows (ratio to a gradient on that device) with ms = ratio × one gradient's ms there."""
    document = _read_json(rows_file)
    if document is None:
        return None
    rows = []
    for row in document["rows"]:
        ms = (gradient_ms or {}).get(row["model"])
        measured = not row["method"].startswith("matrix products")
        rows.append({**row, "ms": round(row["ratio_to_gradient"] * ms, 4) if ms and measured else None})
    return rows


def rounds_figures(document: dict | None, device: str) -> dict[str, Any] | None:
    """The scaling rows, each device's against the CPU's where both ran, and the 10⁶ federation's figures."""
    if document is None:
        return None
    measured = [r for r in document["rows"] if "seconds_per_round" in r]
    cpu = {(r["population"], r["model"], r["mechanism"]): r["seconds_per_round"] for r in measured
           if r["device"] == "cpu"}
    speedups = [{"population": r["population"], "model": r["model"], "mechanism": r["mechanism"],
                 "speedup_over_cpu": cpu[key] / r["seconds_per_round"]}
                for r in measured if r["device"] == device != "cpu"
                and (key := (r["population"], r["model"], r["mechanism"])) in cpu]
    million = next((r for r in measured if r["device"] == device and r["population"] == 1_000_000
                    and r["model"] == "mlp" and r["mechanism"] == "gaussian"), None)
    return {"meta": document.get("meta"), "rows": document["rows"], "speedups": speedups,
            "million_mlp_gaussian": None if million is None else {
                "seconds_per_round": million["seconds_per_round"], "peak_gpu_mib": million["peak_gpu_mib"],
                "speedup_over_the_2_core_cpu": TWO_CORE_MILLION_SECONDS / million["seconds_per_round"]},
            "skipped": [r for r in document["rows"] if "skipped" in r]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=Path, required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--quickstart", type=Path, required=True)
    parser.add_argument("--quickstart-cpu", type=Path, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    args = parser.parse_args()
    steps = [json.loads(line) for line in args.steps.read_text().splitlines() if line.strip()]
    seconds = {s["step"]: s.get("seconds") for s in steps}
    gradient = _read_json(args.out / "gradient-ms.json") or {}
    gradient_ms = gradient.get("gradient_ms", {})
    on_device = quickstart(args.quickstart, seconds.get(f"quickstart-{args.device}"))
    on_cpu = quickstart(args.quickstart_cpu, seconds.get("quickstart-cpu-beside"))
    summary = {
        "device": args.device, "seconds": args.seconds, "steps": steps,
        "all_steps_passed": all(s.get("rc") == 0 for s in steps),
        "pytest": pytest_counts(args.out / "pytest.xml"),
        "quickstart": {"device": on_device, "cpu": on_cpu, "comparison": compare_quickstarts(on_device, on_cpu)},
        "derivatives": {device: derivatives(args.out / f"derivatives-{device}.json", gradient_ms.get(device))
                        for device in dict.fromkeys([args.device, "cpu"])},
        "gradient_ms": gradient_ms,
        "rounds": rounds_figures(_read_json(args.out / "rounds.json"), args.device),
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"summary ({args.out / 'summary.json'}): device {args.device}, {args.seconds:.0f} s, "
          "steps " + ", ".join(f"{s['step']}={s.get('rc')}" for s in steps))
    if summary["pytest"]:
        print(f"pytest: {summary['pytest']}")
    comparison = summary["quickstart"]["comparison"]
    if comparison and on_device and on_cpu:
        print(f"quickstart: accuracy {on_device['accuracy']:.4f} ({args.device}) vs {on_cpu['accuracy']:.4f} (cpu), "
              f"ε {on_device['epsilon']} vs {on_cpu['epsilon']}; command {on_device['command_seconds']} s vs "
              f"{on_cpu['command_seconds']} s; {comparison}")
    cnn = [r for r in summary["derivatives"].get(args.device) or [] if r["model"] == "cnn1d_40k"
           and r["quantity"] == "third_order_vector" and r["method"] == "taylor"]
    if cnn:
        print(f"third-order vector on the CNN ({args.device}): {cnn[0]['ratio_to_gradient']} gradients, "
              f"{cnn[0]['ms']} ms")
    rounds = summary["rounds"]
    if rounds:
        print(f"rounds: {rounds['million_mlp_gaussian']}; speed-ups over the CPU beside it: "
              + ", ".join(f"{s['population']:,} {s['model']} {s['mechanism']} {s['speedup_over_cpu']:.1f}×"
                          for s in rounds["speedups"]) + f"; skipped {len(rounds['skipped'])}")


if __name__ == "__main__":
    main()
