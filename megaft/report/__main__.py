"""`python -m megaft.report DIR`: the same as `megaft-report DIR`."""
import sys

from megaft.report.cli import main

sys.exit(main())
