"""DeepSeek V4.1 vision tower: image bytes -> patches -> ViT -> aligner -> the rows of the image's span."""

from engine.models.v41.vision.encoder import NoVisionEncoder, VisionEncoder, has_vision_encoder

__all__ = ["NoVisionEncoder", "VisionEncoder", "has_vision_encoder"]
