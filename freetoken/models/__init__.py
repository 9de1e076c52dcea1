"""Model families (Llama, Gemma 3, gpt-oss) over paged K/V, and their configuration."""
