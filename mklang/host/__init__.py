"""Host integration: tools, hooks, plugins, machine loading, config, the host settings of a run."""
