"""tokenmill's built-in plugins, one concept per module, registered by tokenmill.plugin_manager."""
