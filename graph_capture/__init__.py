"""Capture one training step (forward and backward, ATen level) as a TrainingGraph."""
from remat.core.training_graph import Node, TrainingGraph

__all__ = ["Node", "TrainingGraph"]
