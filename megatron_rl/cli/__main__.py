"""``python -m megatron_rl.cli ...`` (what the tests run): the same as ``megatron-rl ...``."""

import sys

from megatron_rl.cli import main

sys.exit(main())
