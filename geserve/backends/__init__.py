"""Model execution backends, selected by name through the registry and run inside workers."""
