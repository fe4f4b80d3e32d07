"""ligertune: fine-tune causal language models on packed multi-turn chat data with Triton kernels."""

__version__ = "0.1.0"
