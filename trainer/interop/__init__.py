"""Weights from and to other libraries: Hugging Face safetensors checkpoints (`hf`), the
model families whose layouts map onto this project's modules (`families`)."""
