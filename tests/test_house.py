"""The house's shape: a light edge (the CLI and config load neither torch nor Flower), every config choice
what its implementation offers, and no import circle among fedhog's modules."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest

import fedhog
from fedhog import choices

PACKAGE = Path(fedhog.__file__).parent
HEAVY = ("torch", "flwr", "opacus", "dp_accounting")
# `import` probes, and one that validates the quickstart config
PROBES = {
    "fedhog.cli": "import fedhog.cli",
    "fedhog.config": "import fedhog.config",
    "fedhog.choices": "import fedhog.choices",
    "fedhog.files": "import fedhog.files",
    "load_config(quickstart)": "from importlib.resources import files; from fedhog.config import load_config; "
                               "load_config(str(files('fedhog') / 'quickstart.toml'))",
    "fedhog run --help": "import fedhog.cli, contextlib, io\n"
                         "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
                         "    fedhog.cli.main(['run', '--help'])",
}


def _heavy_loaded(code: str) -> list[str]:
    """The heavy top-level packages a fresh interpreter has loaded after running ``code``."""
    probe = f"{code}\nimport sys, json\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    env = {"PYTHONPATH": str(PACKAGE.parent), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", PROBES)
def test_the_edge_loads_neither_torch_nor_flower(name: str) -> None:
    assert _heavy_loaded(PROBES[name]) == []


def test_a_clientapp_process_loads_no_accountant() -> None:
    """Each message of a deployment starts a fresh flwr-clientapp process that imports the ClientApp: dp-accounting
    (and the scipy.stats it pulls, 1.1 s) loads only where a client accounts (DP-SGD, an operator's max-epsilon)."""
    assert "dp_accounting" not in _heavy_loaded("import fedhog.client_app")


def test_the_probe_sees_a_heavy_import() -> None:
    """The probe above is not blind: a module that needs torch is reported."""
    assert "torch" in _heavy_loaded("import fedhog.models")


# --- every choice is what its implementation offers ---------------------------------------------------

def test_choices_are_what_the_implementations_offer() -> None:
    from opacus.accountants import create_accountant

    from fedhog import aggregators, models
    from fedhog.client_app import INSTRUCTION_KEYS, TRAIN_REPLIES
    from fedhog.privacy import accounting, mechanism, sampling
    from fedhog.server_app import SERVERS

    assert tuple(models.ACTIVATIONS) == choices.ACTIVATIONS
    assert choices.DEFAULT_ACTIVATION in choices.ACTIVATIONS
    assert tuple(mechanism.MECHANISM_REGISTRY) == choices.MECHANISMS
    assert tuple(n for n, kind in mechanism.MECHANISM_REGISTRY.items() if kind.clips) == choices.CLIPPING_MECHANISMS
    assert tuple(n for n, kind in mechanism.MECHANISM_REGISTRY.items() if kind.wants_term) == choices.TERM_MECHANISMS
    assert typing.get_args(sampling.SamplingKind) == choices.SAMPLING_METHODS
    assert tuple(accounting.ACCOUNTANT_REGISTRY) == choices.ACCOUNTANTS
    assert tuple(aggregators.AGGREGATOR_REGISTRY) == choices.AGGREGATORS
    # what each aggregator runs, in the apps
    assert tuple(SERVERS) == tuple(TRAIN_REPLIES) == tuple(INSTRUCTION_KEYS) == choices.AGGREGATORS
    for name in choices.DPSGD_ACCOUNTANTS:  # Opacus builds each DP-SGD accountant by this name
        assert create_accountant(name).mechanism() == name


@pytest.mark.parametrize("name", choices.MODELS)
def test_each_model_choice_builds(name: str) -> None:
    from fedhog.models import build_model

    shape = (1, 8, 8) if name == "cnn2d" else (1, 40)
    for activation in choices.ACTIVATIONS:
        assert sum(p.numel() for p in build_model(name, shape, 3, activation).parameters()) > 0


def test_each_server_choice_runs_and_others_are_refused() -> None:
    import torch

    from fedhog.server_optimizer import ServerOptimizer, ServerOptimizerSettings
    from fedhog.server_step import ServerStepSettings

    for kind in choices.SERVER_OPTIMIZERS:
        moved = ServerOptimizer(ServerOptimizerSettings(kind)).step(torch.zeros(3), torch.ones(3), 1)
        assert bool((moved > 0).all()), kind
    for kind in choices.SERVER_STEPS:
        ServerStepSettings(kind)
    with pytest.raises(ValueError, match="kind='lion' is not allowed"):
        ServerOptimizerSettings("lion")
    with pytest.raises(ValueError, match="kind='halley' is not allowed"):
        ServerStepSettings("halley")


def test_each_data_choice_is_accepted_and_others_are_refused() -> None:
    from fedhog.data import DataSpec, validate_spec

    for dataset in choices.DATASETS:
        for partitioner in choices.PARTITIONERS:
            validate_spec(DataSpec(dataset=dataset, partitioner=partitioner))
    for bad, named in ((DataSpec(dataset="cifar"), "dataset='cifar'"), (DataSpec(partitioner="shards"),
                                                                        "partitioner='shards'")):
        with pytest.raises(ValueError, match=f"{named} is not allowed"):
            validate_spec(bad)


def test_modulus_bit_limits_are_the_lattices() -> None:
    from fedhog.secure_aggregation.quantization import ModularLattice

    for bits in (choices.MIN_MODULUS_BITS, choices.MAX_MODULUS_BITS):
        assert ModularLattice.for_cohort(1.0, 2, bits).modulus_bits == bits
    for bits in (choices.MIN_MODULUS_BITS - 1, choices.MAX_MODULUS_BITS + 1):
        with pytest.raises(ValueError, match=f"modulus_bits={bits} must be in"):
            ModularLattice.for_cohort(1.0, 2, bits)


# --- no import circle ----------------------------------------------------------------------------------

def module_imports(root: Path) -> dict[str, set[str]]:
    """Each module of the package at ``root`` → the package's modules it imports when it is imported.

    Only module-level imports count (not those inside functions, nor under ``if TYPE_CHECKING``);
    ``from .pkg import name`` imports ``pkg`` and, when ``name`` is a submodule, ``pkg.name``. A module's own
    packages are left out: Python initialises them before the module, so importing them closes no circle.
    """
    package = root.name
    modules = {_module_name(package, root, path): path for path in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in _module_level_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            else:
                base = _resolve(name, is_package, node.module, node.level)
                found = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            targets |= {target for target in found if target in modules}
        graph[name] = {target for target in targets if not f"{name}.".startswith(f"{target}.")}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle of ``graph`` (its strongly connected components of more than one module), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while (top := stack.pop()) != node:
                component.append(top)
            if component:
                circles.append(sorted([node, *component]))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(circles)


def _module_name(package: str, root: Path, path: Path) -> str:
    parts = [package, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, is_package: bool, target: str | None, level: int) -> str:
    if level == 0:
        return target or ""
    base = module.split(".")
    base = base[:len(base) - level + (1 if is_package else 0)]
    return ".".join([*base, target] if target else base)


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports run when the module is imported: at module level, in try/with/if bodies but not TYPE_CHECKING."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and not ((isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
                                                or (isinstance(node.test, ast.Attribute)
                                                and node.test.attr == "TYPE_CHECKING")):
            pending += node.body + node.orelse
        elif isinstance(node, (ast.Try, ast.With)):
            pending += node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
            pending += [stmt for handler in getattr(node, "handlers", []) for stmt in handler.body]
    return found


def test_fedhog_has_no_import_circle() -> None:
    graph = module_imports(PACKAGE)
    assert {"fedhog.cli", "fedhog.config", "fedhog.privacy.accounting"} <= set(graph)
    assert "fedhog.choices" in graph["fedhog.config"]
    assert import_circles(graph) == []


def test_the_bottom_floor_imports_only_the_bottom_floor() -> None:
    """choices, files and interrupts serve every floor: they import none above them."""
    graph = module_imports(PACKAGE)
    bottom = {"fedhog.choices", "fedhog.files", "fedhog.interrupts"}
    assert {name: graph[name] - bottom for name in bottom} == {name: set() for name in bottom}


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_circle_check_finds_a_circle(tmp_path: Path) -> None:
    """A synthetic package: a → b.c → a is a circle; imports in functions or under TYPE_CHECKING are not."""
    root = _write(tmp_path / "pkg", {
        "__init__.py": "",
        "a.py": "from .b import c\n",
        "b/__init__.py": "",
        "b/c.py": "import json\nfrom ..a import thing\n",
        "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .e import x\n",
        "e.py": "def f():\n    from .d import y\n",
        "f.py": "try:\n    from . import g\nexcept ImportError:\n    pass\n",
        "g.py": "from pkg import f\n",
        "h/__init__.py": "from .i import j\n",
        "h/i.py": "from . import k\n",
        "h/k.py": "",
    })
    graph = module_imports(root)
    assert graph["pkg.a"] == {"pkg.b", "pkg.b.c"} and graph["pkg.b.c"] == {"pkg.a"}
    assert graph["pkg.d"] == set() and graph["pkg.e"] == set()
    assert graph["pkg.h.i"] == {"pkg.h.k"}  # not its package pkg.h, whose __init__ imports it
    assert import_circles(graph) == [["pkg.a", "pkg.b.c"], ["pkg.f", "pkg.g"]]
