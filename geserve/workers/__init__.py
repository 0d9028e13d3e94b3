"""Model instances: the worker processes that own backends, and the clients that talk to them."""
