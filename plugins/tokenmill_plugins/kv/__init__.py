"""Built-in kv plugins."""
