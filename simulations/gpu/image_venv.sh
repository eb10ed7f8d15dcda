#!/usr/bin/env bash
# A venv that holds what the GPU machine's image holds and nothing more (torch, numpy, scipy, pytest, grpcio,
# protobuf, rich, typer, prometheus-client, psutil and their own dependencies), linked from this machine's .venv:
# check.sh --quick in it, with the wheelhouse for this Python, proves the wheelhouse complete for what the check runs.
#
#   simulations/gpu/image_venv.sh /tmp/gpu-image                  # the venv (its python: /tmp/gpu-image/bin/python)
#   PYTHON_VERSION=3.11 WHEELHOUSE=/tmp/wh311 simulations/gpu/prepare.sh
#   PYTHON=/tmp/gpu-image/bin/python WHEELHOUSE=/tmp/wh311 FEDHOG_GPU_CHECK_DEVICE=cpu OUT=/tmp/gpu-check \
#       simulations/gpu/check.sh --quick
set -euo pipefail
cd "$(dirname "$0")/../.."
TARGET=${1:?usage: image_venv.sh FOLDER}
SOURCE=${SOURCE_PYTHON:-.venv/bin/python}
rm -rf "$TARGET"
"$SOURCE" -m venv "$TARGET"
mkdir -p "$TARGET/image"
"$SOURCE" - "$TARGET/image" <<'EOF'
import importlib.metadata as metadata
import pathlib
import sys

IMAGE = ["torch", "numpy", "scipy", "pytest", "grpcio", "protobuf", "rich", "typer", "prometheus-client", "psutil",
         # their own dependencies
         "filelock", "fsspec", "jinja2", "markupsafe", "networkx", "sympy", "mpmath", "typing-extensions",
         "setuptools", "iniconfig", "pluggy", "packaging", "pygments", "markdown-it-py", "mdurl", "click", "shellingham"]
target = pathlib.Path(sys.argv[1])
for name in IMAGE:
    distribution = metadata.distribution(name)
    tops = {pathlib.Path(str(f)).parts[0] for f in distribution.files or [] if not str(f).startswith("..")}
    for top in sorted(tops):
        source = pathlib.Path(distribution.locate_file(top))
        if source.exists() and not (target / top).exists():
            (target / top).symlink_to(source.resolve())
EOF
site=$("$TARGET/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
realpath "$TARGET/image" > "$site/gpu-image.pth"
"$TARGET/bin/python" -c "import torch, numpy, scipy, pytest, rich, typer; print('image venv:', torch.__version__)"
