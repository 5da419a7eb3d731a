"""`python -m megaft.eval RUN_DIR|HF_DIR eval.tasks=[...]`: megaft-eval without the console script."""
import sys

from megaft.eval.cli import main

if __name__ == "__main__":
    sys.exit(main())
