"""``megatron-rl env``: what this machine offers (versions, devices, optional GPU extras)."""

from __future__ import annotations

import argparse
import importlib.util
import platform
from importlib import metadata

import torch


def add_arguments(p: argparse.ArgumentParser) -> None:
    """No arguments."""


def run(_args: argparse.Namespace) -> int:
    """Print what this machine offers: versions, devices, optional GPU extras. Versions come from the installed
    distributions' metadata, not by importing them (importing Megatron-Core, Ray and SGLang took ~10 s)."""
    print(f"python            {platform.python_version()}")
    print(f"torch             {torch.__version__} (cuda available: {torch.cuda.is_available()})")
    if torch.cuda.is_available():
        print(f"gpus              {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
    for mod, dists in (("megatron.core", ("megatron-core",)), ("transformers", ("transformers",)), ("ray", ("ray",)),
                       ("datasets", ("datasets",)), ("safetensors", ("safetensors",)),
                       ("transformer_engine", ("transformer-engine", "transformer_engine")), ("sglang", ("sglang",))):
        version = None
        for dist in dists:
            try:
                version = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
        if version is None and importlib.util.find_spec(mod.split(".")[0]) is not None:
            version = "installed"  # importable without distribution metadata (a source checkout on the path)
        print(f"{mod:<17} {version or 'not available'}")
    return 0
