"""Kernel families, one sub-package each: a torch reference (the specification),
compiled backends (Triton, C++ CPU in megaft._C, CUDA C++ in megaft._cuda) and a
dispatching front taking ``backend=``.

    rmsnorm, swiglu, rope   auto | torch | triton | cuda   (megaft.kernels.dispatch)
    cross_entropy           auto | torch | triton, plain and fused with the head projection
    grouped_gemm            auto | torch | triton | cuda (torch._grouped_mm): the experts' grouped matmuls
    adamw                   auto | torch | cpu | cuda | triton

``megaft.config.kernels.KernelsConfig`` (the ``kernels`` config group) picks the model's
backends; ``megaft.kernels._ext`` imports the extensions once and explains missing ones.
"""
