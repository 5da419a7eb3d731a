"""Kernel families, one sub-package each: a torch reference (the specification),
compiled backends (C++ CPU in megaft._C, CUDA in megaft._cuda) and a dispatching
front taking ``backend="auto"|"torch"|"cpu"|"cuda"``.

``megaft.kernels._ext`` imports the extensions once and explains missing ones.
"""
