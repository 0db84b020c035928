"""The daemon: a ZeroMQ front end joined to one engine thread."""
