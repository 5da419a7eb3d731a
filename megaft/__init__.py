"""megaft: Slurm-oriented fine-tuning of Llama-style models with tensor parallelism,
compiled kernels and Hydra sweeps. README.md is the front door, docs/ the manual."""

__version__ = "0.1.0"


def env_report() -> str:
    """What was built (megaft._C, megaft._cuda) and why not; torch and device versions."""
    from megaft.kernels._ext import env_report as _report

    return _report()
