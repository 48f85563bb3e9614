"""offgrid: a local LLM server over llama.cpp's libllama, with no other dependencies."""

__version__ = "0.1.0"
