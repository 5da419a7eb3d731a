"""The training loop, evaluation and run-directory metrics."""
