"""megatron_rl: RL post-training of LLMs on Megatron-Core with vocabulary-parallel losses."""

from setuptools import find_packages, setup

setup(
    name="megatron_rl",
    version="0.1.0",
    description="Reinforcement-learning post-training on Megatron-Core with vocabulary-sharded losses",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_rl", "megatron_rl.*"]),
    include_package_data=True,
    install_requires=[
        # CPU machines install torch==2.13.0 first (scripts/setup_venv.sh); GPU images bring their own.
        "torch>=2.6",
        # Tested at both ends (scripts/test.sh): 0.16.1, the newest release declaring Python 3.11 support (what pip
        # picks here), and 0.19.2 (MCORE=0.19.2 scripts/setup_venv.sh). 0.19 deprecates GPTModel for HybridModel.
        "megatron-core>=0.16.1,<0.20",
        "transformers>=5.0",  # the tiny tokenizer and the embedded engine use transformers 5 classes
        "safetensors>=0.4",
        "datasets>=3.0",
        "ray>=2.40",
        "numpy>=1.26",
        "pyyaml>=6.0",
        "rich>=13.0",
        "tqdm>=4.66",
        "tensorboard>=2.15",
        "psutil>=5.9",  # undeclared runtime need of megatron-core's dist-checkpoint save
        "einops>=0.7",
        "math-verify[antlr4_13_2]>=0.9.0",
        "matplotlib>=3.7",  # `megatron-rl report` and tools/mismatch_report.py
    ],
    extras_require={
        # triton: its interpreter runs the fused head's GPU kernels on CPU (tests/unit/test_triton_head.py)
        "test": ["pytest>=8.0", "pytest-timeout>=2.3", "hypothesis>=6.100", "triton>=3.2"],
        "gpu": ["transformer-engine[pytorch]>=2.4", "sglang==0.5.23"],
        # tools/bench_rl_step.py only (the TRL GRPOTrainer side of the comparison); adds accelerate
        "bench": ["trl==1.16.0"],
    },
    entry_points={"console_scripts": ["megatron-rl=megatron_rl.cli:main"]},
)
