"""`python -m neuronlocal ...` (so torchrun can launch `-m neuronlocal run script.py`)."""

import sys

from neuronlocal.cli import main

sys.exit(main())
