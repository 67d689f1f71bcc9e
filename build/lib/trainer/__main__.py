"""``python -m trainer`` / ``torchrun --nproc-per-node N -m trainer ...``: same flags as ``agentrl train``."""

import sys

from trainer.cli import main

sys.exit(main())
