"""grpo-cli: GRPO (DeepSeekMath, arXiv 2402.03300) training, evaluation and sampling from the command line."""

__version__ = "0.1.0"
