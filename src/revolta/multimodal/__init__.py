"""Images and videos: loading, the prompt processor and the vision-encoder cache.

    media.py          decode, resize and patch images and videos; placeholder expansion; mRoPE positions
    sources.py        where media comes from (URLs, data URIs, local files under an allowed root)
    processor.py      a prompt with media -> MultimodalPrompt (expanded pads, items, positions)
    encoder_cache.py  which vision-tower outputs are computed in which step, and kept for how long
"""
