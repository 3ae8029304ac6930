"""Test helpers: tiny random Qwen3 models live in the package (also used by `evospec bench random`)."""
from evospec.model.random_pair import random_pair, random_qwen3, tiny_config

__all__ = ["random_pair", "random_qwen3", "tiny_config"]
