"""The weights in other formats: weights-only safetensors (weights.py: a finished run's
`model.safetensors`, and any checkpoint's through scripts/export_weights.py) and Hugging Face
folders, out and in (huggingface.py: GPT-2 and Llama layouts, `model.init_from`). Imports the
run layer's atomic writes, the model's config and the data package's tokenizers.
"""
