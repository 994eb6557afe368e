"""Built-in schedulers plugins."""
