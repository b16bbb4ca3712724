"""The plugin system: discovery and registries, the default capability answers, capability records, kernel lookup."""
