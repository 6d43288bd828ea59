"""The shapes of the models users name, from their published config.json files (MODELS.md), for
planning without a download (core/shapes.py's BUILTIN_SHAPES is built from these). Data only."""

from __future__ import annotations

from typing import Any

# Dense decoders: their sizes as core/shapes.py's ModelShape names them.
DENSE: dict[str, dict[str, Any]] = {
    "meta-llama/Llama-2-7b-hf": dict(hidden=4096, intermediate=11008, layers=32, heads=32, kv_heads=32, vocab=32000,
        max_positions=4096, rope_theta=1e4),
    "meta-llama/Llama-2-13b-hf": dict(hidden=5120, intermediate=13824, layers=40, heads=40, kv_heads=40, vocab=32000,
        max_positions=4096, rope_theta=1e4),
    "meta-llama/Llama-2-70b-hf": dict(hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8, vocab=32000,
        max_positions=4096, rope_theta=1e4),
    "codellama/CodeLlama-34b-hf": dict(hidden=8192, intermediate=22016, layers=48, heads=64, kv_heads=8, vocab=32000,
        max_positions=16384, rope_theta=1e6),
    "01-ai/Yi-34B": dict(hidden=7168, intermediate=20480, layers=60, heads=56, kv_heads=8, vocab=64000,
        max_positions=4096, rope_theta=5e6),
    "01-ai/Yi-34B-200K": dict(hidden=7168, intermediate=20480, layers=60, heads=56, kv_heads=8, vocab=64000,
        max_positions=200000, rope_theta=1e7),
    "meta-llama/Meta-Llama-3-8B": dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128256,
        max_positions=8192, rope_theta=5e5),
    "meta-llama/Llama-3.1-8B": dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128256,
        max_positions=131072, rope_theta=5e5),
    "meta-llama/Meta-Llama-3-70B": dict(hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8, vocab=128256,
        max_positions=8192, rope_theta=5e5),
    "mistralai/Mistral-7B-v0.1": dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=32000,
        max_positions=32768, model_type="mistral", rope_theta=1e4),
    "Qwen/Qwen1.5-7B": dict(hidden=4096, intermediate=11008, layers=32, heads=32, kv_heads=32, vocab=151936,
        max_positions=32768, model_type="qwen2", qkv_bias=True, rope_theta=1e6),
    "Qwen/Qwen1.5-1.8B": dict(hidden=2048, intermediate=5504, layers=24, heads=16, kv_heads=16, vocab=151936,
        max_positions=32768, model_type="qwen2", qkv_bias=True, rope_theta=1e6),
}
# Mixtures of experts, as their published config.json files give them (the fields that size them).
EXPERTS: dict[str, dict[str, Any]] = {
    "mistralai/Mixtral-8x7B-v0.1": dict(
        model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768, num_local_experts=8,
        num_experts_per_tok=2, rope_theta=1e6),
    "Qwen/Qwen3-30B-A3B": dict(
        model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, num_experts=128, num_experts_per_tok=8, tie_word_embeddings=False,
        rope_theta=1e6),
    "openai/gpt-oss-20b": dict(
        model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, vocab_size=201088, max_position_embeddings=131072, num_local_experts=32,
        num_experts_per_tok=4, attention_bias=True, tie_word_embeddings=False, rope_theta=150000),
    "deepseek-ai/DeepSeek-V3": dict(
        model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, vocab_size=129280,
        max_position_embeddings=163840, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
        first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, tie_word_embeddings=False, rope_theta=10000),
}
