"""The model: Hugging Face Llama-family checkpoints (Llama, Mistral, Qwen2, Qwen3) over the paged KV cache."""
