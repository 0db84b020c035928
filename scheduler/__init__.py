"""The daemon: a ZeroMQ front end joined to the engine, which runs in a process of its own."""
