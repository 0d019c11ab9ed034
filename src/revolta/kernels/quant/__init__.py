"""Packed-weight kernels: AutoAWQ int4, compressed-tensors int4, NVFP4 (ModelOpt and compressed-tensors).

One module per layout, each with a torch reference (`*_ref`) beside every Triton kernel of the same
signature; `common.py` holds what they share (decoders, tile product, split-K, launch configs).
"""
