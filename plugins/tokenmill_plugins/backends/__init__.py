"""Built-in backends plugins."""
