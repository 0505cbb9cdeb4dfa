"""`python tests/parallel/masked_train.py [trainer args]`: titanrush's trainer with masked labels (see
masking.py), for the parity tests of the loss normalization under torchrun."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from masking import install_masking  # noqa: E402

from titanrush import train  # noqa: E402

if __name__ == "__main__":
    install_masking()
    sys.exit(train.main())
