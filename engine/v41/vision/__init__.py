"""DeepSeek V4.1 vision tower: image bytes -> patches -> ViT -> aligner -> the rows of the image's span."""

from engine.v41.vision.encoder import VisionEncoder

__all__ = ["VisionEncoder"]
