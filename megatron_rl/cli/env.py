"""``megatron-rl env``: what this machine offers (versions, devices, optional GPU extras)."""

from __future__ import annotations

import argparse
import importlib
import platform

import torch


def add_arguments(p: argparse.ArgumentParser) -> None:
    """No arguments."""


def run(_args: argparse.Namespace) -> int:
    """Print what this machine offers: versions, devices, optional GPU extras."""
    print(f"python            {platform.python_version()}")
    print(f"torch             {torch.__version__} (cuda available: {torch.cuda.is_available()})")
    if torch.cuda.is_available():
        print(f"gpus              {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
    for mod in ("megatron.core", "transformers", "ray", "datasets", "safetensors", "transformer_engine", "sglang"):
        try:
            m = importlib.import_module(mod)
            print(f"{mod:<17} {getattr(m, '__version__', 'installed')}")
        except Exception as e:  # noqa: BLE001 - report, never crash
            print(f"{mod:<17} not available ({type(e).__name__})")
    return 0
