"""The tiny configs of spec/model.md §12.2 as config.json dicts (no transformers import, so any test may use them)."""

L, F = "linear_attention", "full_attention"

T4_TEXT = dict(
    vocab_size=512, eos_token_id=511, hidden_size=64, num_hidden_layers=4, layer_types=[L, L, L, F],
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[2, 1, 1],
                         mrope_interleaved=True),
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    hc_lowrank=16, ple_layer_ids=[2], ple_embed_dim=64, heads_per_ngram=2, ngram_vocab_size_base=97,
    make_ngram_vocab_size_divisible_by=8, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
    indexer_budget=8, indexer_compress_ratio=4, split_ngram_parts=1, output_gate_type="sigmoid",
    rms_norm_eps=1e-6, hidden_act="silu",
)
V_TINY = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, num_position_embeddings=16, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64)
TOKENS = dict(image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503)
