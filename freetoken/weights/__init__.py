"""Reading checkpoints: GGUF files and safetensors directories, into HF-named tensors."""
