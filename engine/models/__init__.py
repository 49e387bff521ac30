"""Model architectures. The Llama family (Llama, Mistral, SmolLM2, Qwen2/2.5/3) shares one module."""
