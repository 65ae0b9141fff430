"""This folder's test modules import SGLang: pytest collects them only in the SGLang venv
(`scripts/setup_sglang_venv.sh`); the main venv's run (testpaths = tests) skips them unimported.
The scripts beside them are run as subprocesses (see README.md)."""

import importlib.util
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

if importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["test_*.py"]
