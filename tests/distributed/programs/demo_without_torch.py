"""`python -m gpukv ARGS` as in an environment without PyTorch (`import torch` fails)."""
import sys

sys.modules["torch"] = None  # type: ignore[assignment]
from gpukv.__main__ import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
