"""Client images at the gateway: SSRF-safe fetching, decoding checks, V4.1 grids (issue #13).

`ImageResolver(ImageFetcher(limits), sizing).resolve(sources_of(conversation))` turns a converted
request's images into `messages.images.ImageInput`s, or raises `ImageInputError` (code, path) for a 400.
"""
from services.gateway.vision.decode import ACCEPTED_FORMATS, inspect_image
from services.gateway.vision.errors import ImageDecodeError, ImageFetchError, ImageInputError
from services.gateway.vision.fetch import ImageFetcher
from services.gateway.vision.limits import ImageLimits
from services.gateway.vision.resolve import ImageResolver, ImageSourceRef
from services.gateway.vision.sources import image_part_paths, sources_of

__all__ = ["ACCEPTED_FORMATS", "ImageDecodeError", "ImageFetchError", "ImageFetcher", "ImageInputError",
           "ImageLimits", "ImageResolver", "ImageSourceRef", "image_part_paths", "inspect_image", "sources_of"]
