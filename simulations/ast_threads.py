"""Which threads build Python ASTs (``ast.parse``) during a run: issue 35's diverging run died with CPython 3.11's
``SystemError: AST constructor recursion depth mismatch``, which two threads building ASTs at once can raise
(``simulations/ast_race.py`` shows it on 3.11.7). Flower decodes an ``Array`` with ``np.load``, whose header
``ast.literal_eval`` parses; the writer thread used to decode each round's model for its evaluation while the round's
thread decoded the next. Prints (calls, thread, call site); after the fix only MainThread appears.

    python simulations/ast_threads.py [ROUNDS] [RESULTS_DIR]
"""
import ast
import collections
import sys
import tempfile
import threading
import traceback

import torch

torch.set_num_threads(1)
calls: collections.Counter = collections.Counter()
original = ast.parse


def parse(*args, **kwargs):
    stack = traceback.extract_stack(limit=10)[:-1]
    where = " < ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.name}" for f in reversed(stack[-6:]))
    calls[(threading.current_thread().name, where)] += 1
    return original(*args, **kwargs)


ast.parse = parse
from fedhog import api  # noqa: E402  (after the hook)

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
folder = sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp(prefix="fedhog-ast-")
api.run("configs/quickstart.toml", engine="vectorized", population=300, num_samples=6000, rounds=rounds,
        sampling_rate=0.1, model="mlp", results_dir=folder)
for (thread, where), count in calls.most_common(20):
    print(count, thread, where)
