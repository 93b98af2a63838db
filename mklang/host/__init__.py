"""Host integration: tools, hooks, plugins, machine loading, config."""
