"""Flax modules used by the examples and tests.

Every module here runs unchanged under every strategy: modules carry logical
axis annotations at most, never device or mesh knowledge.
"""

from models.cnn import CNN
from models.mlp import MLP, DotReluDot
from models.transformer import DecoderBlock, TransformerLM

__all__ = ["CNN", "MLP", "DecoderBlock", "DotReluDot", "TransformerLM"]
