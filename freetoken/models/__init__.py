"""Model families (Llama, Gemma 3, gpt-oss, Qwen3, Gemma 4) over paged K/V, their configuration,
and one forward over a paged batch (`forward`)."""
