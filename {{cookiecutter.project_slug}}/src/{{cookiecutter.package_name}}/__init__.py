"""Image classification served by NVIDIA Triton: preprocess -> ResNet -> postprocess."""

__version__ = "0.1.0"
