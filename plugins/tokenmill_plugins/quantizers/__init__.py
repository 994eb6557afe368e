"""Built-in quantizer plugins: one module per format."""
