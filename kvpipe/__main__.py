"""`python -m kvpipe` runs the command line."""
import sys

from kvpipe.cli import main

sys.exit(main())
