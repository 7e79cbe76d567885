"""Flax modules used by the examples and tests.

Every module here runs unchanged under every strategy: modules carry logical
axis annotations at most, never device or mesh knowledge.
"""

from models import attention, moe, nnx_models
from models.cnn import CNN
from models.layer_stack import LayerStack, NnxLayerStack
from models.mlp import MLP, DotReluDot
from models.resnet import ResNet, ResNetBlock
from models.transformer import DecoderBlock, TransformerLM

__all__ = ["CNN", "MLP", "DecoderBlock", "DotReluDot", "LayerStack", "NnxLayerStack", "ResNet",
           "ResNetBlock", "TransformerLM", "attention", "moe",
           "nnx_models"]
