"""The weights in other formats: weights-only safetensors (weights.py) and Hugging Face folders
(huggingface.py).
"""
