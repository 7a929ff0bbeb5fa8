"""seqgen: fast, exact batch text generation for Hugging Face checkpoints."""

__version__ = "0.1.0"
