"""CPython 3.11.x (3.11.7 here): ast.parse in two threads at once raises 'AST constructor recursion depth mismatch'.

The AST-to-object conversion keeps its recursion depth in per-interpreter state. It holds the GIL, but its
allocations can start a garbage collection, and a finalizer that lets the GIL go (here time.sleep(0), as
torch tensors' and file objects' do) lets another thread's ast.parse run inside it.
"""
import ast
import sys
import threading
import time

errors = []
SRC = "\n".join("f(" * 40 + "x" + ")" * 40 for _ in range(20))

class Finalised:
    def __init__(self):
        self.cycle = self
    def __del__(self):
        time.sleep(0)

def work(n):
    try:
        for _ in range(n):
            for _ in range(50):
                Finalised()
            ast.parse(SRC)
    except SystemError as e:
        errors.append(repr(e))
ts = [threading.Thread(target=work, args=(int(sys.argv[1]) if len(sys.argv) > 1 else 300,)) for _ in range(2)]
for t in ts:
    t.start()
for t in ts:
    t.join()
print(sys.version.split()[0], len(errors), errors[:1])
