"""The MLX engine, in rooms: ``api`` (the light types that cross to the front end, no MLX), ``engine``
(batching, the engine thread, speculative bursts in ``engine.spec``), ``exact`` (the probe and its
verdicts), ``kernels`` (how a forward runs), ``models`` (loading, demo, GGUF) and ``dist`` (ranks).
Knows nothing of ZeroMQ; importing this package loads nothing (see ``docs/architecture.md``)."""
