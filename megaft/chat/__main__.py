"""`python -m megaft.chat` = `megaft-chat`."""
import sys

from megaft.chat.cli import main

if __name__ == "__main__":  # a spawned tp rank imports this module again, as __mp_main__
    sys.exit(main())
