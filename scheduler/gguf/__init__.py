"""GGUF files: the header parser, model metadata, the memory estimate and its calibration, the
model registry.
"""
