"""Block hashes cover image digests: equal images share blocks, different images never do."""
from messages.images import ImageGrid, ImageInput, VisionSizing, plan_image_grid
from messages.prefix import BLOCK_TOKENS, block_hashes

IMAGE = 129264
GRID = ImageGrid(126, 126, 9, 9, 3, 3)   # 3 x (3 + 1) + 2 = 14 tokens


def image(digest: bytes, start: int) -> ImageInput:
    return ImageInput(digest=digest, data=b"", width=100, height=100, grid=GRID, start=start)


def prompt_with_image(start: int, length: int = 3 * BLOCK_TOKENS) -> list[int]:
    ids = [7] * length
    ids[start : start + GRID.tokens] = [IMAGE] * GRID.tokens
    return ids


def test_text_only_prompts_hash_as_before():
    ids = list(range(2 * BLOCK_TOKENS))
    assert block_hashes("m", ids, images=()) == block_hashes("m", ids)


def test_different_images_differ_from_their_block_on():
    ids = prompt_with_image(200)   # inside block 1
    a = block_hashes("m", ids, images=[image(b"a" * 32, 200)])
    b = block_hashes("m", ids, images=[image(b"b" * 32, 200)])
    assert a[0] == b[0]              # the block before the image is shared
    assert a[1] != b[1] and a[2] != b[2]   # the image's block and every later one differ
    assert a == block_hashes("m", ids, images=[image(b"a" * 32, 200)])


def test_an_image_across_a_boundary_enters_both_blocks():
    start = BLOCK_TOKENS - 5
    ids = prompt_with_image(start)
    a = block_hashes("m", ids, images=[image(b"a" * 32, start)])
    plain = block_hashes("m", ids)
    assert a[0] != plain[0] and a[1] != plain[1]


def test_the_same_image_elsewhere_is_another_prefix():
    a = block_hashes("m", prompt_with_image(10), images=[image(b"a" * 32, 10)])
    b = block_hashes("m", prompt_with_image(20), images=[image(b"a" * 32, 20)])
    assert a[0] != b[0]


def test_incremental_hashing_matches_whole():
    ids = prompt_with_image(300)
    images = [image(b"a" * 32, 300)]
    first = block_hashes("m", ids[: 2 * BLOCK_TOKENS], images=images)
    assert block_hashes("m", ids, previous=first, images=images) == block_hashes("m", ids, images=images)


def test_released_sizing_rule():
    sizing = VisionSizing()
    small, large = plan_image_grid(100, 100, sizing), plan_image_grid(4000, 3000, sizing)
    assert small.tokens == 13 * 14 + 2          # raised to min_pixels: a 546 x 546 grid
    assert large.tokens <= sizing.max_image_tokens < plan_image_grid(4000, 3000, VisionSizing(max_image_tokens=4096)).tokens
    assert large.patches > small.patches
