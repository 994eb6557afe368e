"""Built-in reasoning parsers (``--reasoning-parser``)."""
