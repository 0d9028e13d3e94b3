"""Stand-ins for components that cannot run on these machines: the pyACL simulator (`acl/`)."""
