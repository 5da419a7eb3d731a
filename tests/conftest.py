"""Shared test setup: make tests/ importable (multirank helpers) and keep torch to
one thread per process, since multi-rank tests put several ranks on CI's 2 cores."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
torch.set_num_threads(1)
# Triton reads TRITON_INTERPRET when its own library functions (tl.sum, ...) are decorated, at its
# first import; some test modules import peft/transformers, which may import triton, at collection.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    import slurm_stream  # tests/slurm beside the rest of the session, in a second pytest process

    slurm_stream.configure(config)


def pytest_sessionfinish(session, exitstatus):
    """Stop tests/multirank.py's pooled rank processes (its atexit hook would, later). After a
    passing session, silence the interpreter's shutdown stderr: Triton's nanobind bindings report
    "leaked function ..." objects when libtriton is torn down at exit (nanobind's leak check;
    Triton's own compile workers silence it the same way, triton/_compile_warmup_pool.py). A
    failing session keeps it: shutdown output may then be part of the story."""
    for name in ("multirank", "tests.multirank"):  # imported under either name
        if name in sys.modules:
            sys.modules[name].shutdown()
    if exitstatus == 0:
        import atexit

        def silence_stderr():
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
            os.close(devnull)

        atexit.register(silence_stderr)
