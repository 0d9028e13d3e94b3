"""Model repositories on disk: layout, versions and config.pbtxt."""
